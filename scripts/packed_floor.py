"""What torch's own per-input work costs a vmapped and a compiled optimizer step over GPT-2 small's tree, with the
state as it is (a NamedTuple of tensors per param) and with the state of all params packed into a few flat buffers
(a layout bnbf does not have): the floor below which no bnbf code can bring either step (issue 12's two open bars).

    python scripts/packed_floor.py            # on the GPU (CUDA tensors); --cpu for this machine's CPU

Rows, host time of a call in microseconds (median on a GPU, minimum on the CPU):

- ``vmap, identity``: ``torch.func.vmap`` of a function returning its inputs, 8 members: torch.func's pytree
  walk and batching of every leaf, nothing else;
- ``compile, no-op op``: ``torch.compile(fullgraph=True)`` of a no-op in-place custom op over the tensors
  (Dynamo's guards, Inductor's input checks, the op's dispatch).

Each for the state per param (GPT-2's 148 params: 592 state tensors with every param 8-bit, 396 with
``min_8bit_size`` at its default) and packed (4 buffers, one per state field). Params and grads are per param in
both. The tensors are small (the costs are per tensor, not per byte).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.bench_step as bs  # noqa: E402
import bnbf  # noqa: E402


@torch.library.custom_op("bnbf_packed_floor::touch_", mutates_args=("params", "states"))
def touch_(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[torch.Tensor]) -> None:
    """The step's tensors in, nothing done."""


def host_us(fn, n: int, cuda: bool) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
    return (statistics.median(times) if cuda else min(times)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    cuda = not args.cpu and torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    names = [n for n, _ in bs.SETS["gpt2_124M"]()]
    members = 8
    rows = []
    for min_8bit in (0, 4096):
        spec = bnbf.OptimSpec(rule="adamw", min_8bit_size=min_8bit)
        # small stand-ins: 8-bit where the real tensor is, by giving 8-bit leaves enough elements
        real = dict(bs.SETS["gpt2_124M"]())
        numel = {n: 4096 if torch.Size(real[n]).numel() >= max(min_8bit, 1) else 64 for n in names}
        params = {n: torch.zeros(members, numel[n], device=device) for n in names}
        grads = {n: torch.zeros_like(v) for n, v in params.items()}
        state = torch.func.vmap(functools.partial(bnbf.init_state, spec=spec))(params)
        fields = sum(len(s) for s in state.values())
        packed = tuple(torch.zeros(members, 1 << 16, device=device) for _ in range(4))
        ident = torch.func.vmap(lambda p, g, s: (p, s))
        per_leaf = host_us(functools.partial(ident, params, grads, state), args.calls, cuda)
        flat = host_us(functools.partial(ident, params, grads, packed), args.calls, cuda)
        rows.append((f"vmap, identity, {fields} state tensors", per_leaf, flat))

        p1 = {n: v[0].clone() for n, v in params.items()}
        g1 = {n: v[0].clone() for n, v in grads.items()}
        s1 = bnbf.init_state(p1, spec)
        f1 = tuple(b[0].clone() for b in packed)

        def leafy(p, g, s):
            touch_(list(p.values()), list(g.values()), [f for x in s.values() for f in x])

        def packy(p, g, s):
            touch_(list(p.values()), list(g.values()), list(s))

        c_leafy = torch.compile(leafy, fullgraph=True)
        c_packy = torch.compile(packy, fullgraph=True)
        c_leafy(p1, g1, s1)
        c_packy(p1, g1, f1)
        per_leaf = host_us(functools.partial(c_leafy, p1, g1, s1), args.calls, cuda)
        flat = host_us(functools.partial(c_packy, p1, g1, f1), args.calls, cuda)
        rows.append((f"compile, no-op op, {fields} state tensors", per_leaf, flat))
    where = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"{where}, torch {torch.__version__}; {len(names)} params; host us a call")
    print("| row | state per param | state packed (4 buffers) |")
    print("|---|---|---|")
    for name, a, b in rows:
        print(f"| {name} | {a:.0f} | {b:.0f} |")


if __name__ == "__main__":
    main()
