"""Where the host time of the pure per-param step goes (``bnbf.update`` on GPT-2 small's 148 tensors, bf16, 8-bit
AdamW, outputs fed back as a torch.func training loop does), against the in-place step on the same tensors.

    python scripts/pure_host.py [--calls 100]      # on a CUDA machine
    python scripts/pure_host.py --cpu              # anywhere: CPU tensors (148 small ones of the same structure) on
                                                   # the Triton path's host code, the kernel launch stubbed out

Prints the median host microseconds of a call (no synchronize inside the timed calls) of ``bnbf.update`` and
``bnbf.update_``; what allocating the outputs alone costs (``torch.empty_like`` per tensor, as the step does it,
against one buffer per dtype cut into views by ``split_with_sizes``); the functions with the most own time over
the calls under cProfile; and the runtime and aten calls torch.profiler counts in one call. ``--cpu`` times the
minimum over the calls (on a shared CPU the median mostly measures other processes) and skips the profiles.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.bench_step as bs  # noqa: E402
import bnbf  # noqa: E402
import bnbf.kernels.launcher as launcher  # noqa: E402
from bnbf._host_checks import NATIVE  # noqa: E402

plan = importlib.import_module("bnbf.plan")  # the module (``bnbf.plan`` is the function)


CPU = "--cpu" in sys.argv


def sync() -> None:
    if not CPU:
        torch.cuda.synchronize()


def host_us(fn, calls: int) -> float:
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
        if i % 20 == 19:
            sync()  # a short queue: the host's work is timed, not a full launch queue
    sync()
    return (min(times) if CPU else statistics.median(times)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    device = torch.device("cpu" if CPU else "cuda")
    if CPU:  # the Triton path's host code on CPU tensors, every kernel launch a no-op
        os.environ["TRITON_INTERPRET"] = "1"
        launcher.launch_group = plan.launch_group = lambda *a, **k: None
    shapes = (bs.SMOKE_SETS if CPU else bs.SETS)["gpt2_124M"]()
    params = {n: torch.randn(s, device=device).to(torch.bfloat16) for n, s in shapes}
    grads = {n: torch.randn_like(v) for n, v in params.items()}
    spec = bnbf.OptimSpec(rule="adamw")
    hp = {"lr": 1e-3, "weight_decay": 0.01}
    state = bnbf.init_state(params, spec)
    held = [params, state]

    def pure(i: int) -> None:
        held[:] = bnbf.update(held[0], grads, held[1], hp, i + 1)

    in_place_state = bnbf.init_state(params, spec)
    in_place_params = {k: v.clone() for k, v in params.items()}
    leaves = [*params.values(), *torch.utils._pytree.tree_leaves(state)]
    by_dtype: dict = {}
    for t in leaves:
        by_dtype.setdefault(t.dtype, []).append(t)

    def split(i: int) -> None:
        for dtype, ts in by_dtype.items():
            sizes = [t.numel() for t in ts]
            buf = torch.empty(sum(sizes), dtype=dtype, device=device)
            list(map(torch.Tensor.view, buf.split_with_sizes(sizes), [t.shape for t in ts]))

    rows = {
        "update (pure), outputs fed back": pure,
        "update_ (in place)": lambda i: bnbf.update_(in_place_params, grads, in_place_state, hp, i + 1),
        f"empty_like of the {len(leaves)} outputs alone": lambda i: list(map(torch.empty_like, leaves)),
        f"one buffer per dtype ({len(by_dtype)}) split into the {len(leaves)} outputs": split,
    }
    name = "CPU (launch stubbed out)" if CPU else torch.cuda.get_device_name()
    print(f"{name} torch {torch.__version__}, host checks {'native' if NATIVE else 'python'}, {len(params)} params, "
          f"{len(leaves)} tensors")  # fmt: skip
    for name, fn in rows.items():
        for i in range(10):
            fn(i)
        print(f"| {name} | {host_us(fn, args.calls):.0f} us |")
    if CPU:
        return
    prof = cProfile.Profile()
    prof.enable()
    for i in range(args.calls):
        pure(i)
    prof.disable()
    torch.cuda.synchronize()
    print(f"\nupdate (pure): own time over {args.calls} calls (cProfile)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        pure(0)
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
