"""What a step with tensor hyperparameters costs the device beside the step with Python numbers: kernel time per step
(torch.profiler) of the same in-place 8-bit AdamW step (flat params, :func:`bnbf.flat_layout`) taken five ways:

- ``numbers``: ``bnbf.update_`` with Python-number lr and step, new values every call (the scalars go to the step
  kernel as arguments);
- ``compiled_numbers``: ``torch.compile(fullgraph=True)`` of the same call with Python-number lr and step changing
  every call (graph inputs from Dynamo's first recompile; the op reads their row on the host and the step kernel
  takes them as arguments);
- ``compiled``: the same compiled call with lr and step 0-d device tensors, the step refilled every call (Inductor
  derives the scalars in one kernel; the step kernel reads them from a row);
- ``captured``: the eager call with those tensors captured in a CUDA graph, timed per replay;
- ``tensors``: the eager call with those tensors (each scalar derived by small torch ops, then stacked).

    python scripts/scalar_cost.py [--sets gpt2_124M,big_1B] [--dtype bf16] [--steps 20] [--launches]

Prints, per set and way, the device time of a step, its kernel count and the three kernels that take the most;
``numbers_again`` and ``compiled_numbers_again``, last, time the first two ways again (the device's clock drifts
within a run). ``--launches`` first prints how one eager and one compiled call with numbers launch: configuration
key, grid, the compiled kernel's handle and every argument that differs (to tell a specialization from a value).
GPU only.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.bench_step as bs  # noqa: E402
import bnbf  # noqa: E402


def device_time(fn, steps: int) -> tuple[float, float, list]:
    """Device microseconds a call of ``fn`` takes, kernels a call, and the top three kernels' (name, us a call)."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            fn(i)
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    count = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:40]] += e.device_time / steps
            count += 1
    top = sorted(per.items(), key=lambda kv: -kv[1])[:3]
    return sum(per.values()), count / steps, top


def _lr(step: int) -> float:
    """The Python-number ways' lr: a new value every step, as under a schedule (the same values in each way)."""
    return 1e-3 * 0.999 ** (step % 50)


def compare_launches(ways: dict) -> None:
    """Print how one call's launches differ between ``ways``: configuration key, grid, the compiled kernel's
    handle (the same handle: the same Triton specialization) and each argument that differs (ints with their
    remainder mod 16, which Triton specializes on)."""
    import bnbf.kernels.launcher as launcher

    real, seen = launcher.launch, {}

    def recorder(name):
        def rec(compiled, device, key, grid, args, dispatch):
            real(compiled, device, key, grid, args, dispatch)
            handle = compiled.get(key, (None, None))[1]
            seen.setdefault(name, []).append((key, grid, handle, args))

        return rec

    for name, fn in ways.items():
        launcher.launch = recorder(name)
        try:
            fn(0)
        finally:
            launcher.launch = real
    torch.cuda.synchronize()
    (a_name, a), (b_name, b) = seen.items()
    print(f"launches: {a_name} {len(a)}, {b_name} {len(b)}")
    for (ka, ga, ha, xa), (kb, gb, hb, xb) in zip(a, b):
        same = f"key same {ka == kb} ({ka}), grid {ga} / {gb}, kernel handle same {ha == hb}"
        print(f"  {same}, args {len(xa)} / {len(xb)}")
        for i, (u, v) in enumerate(zip(xa, xb)):
            if u != v:
                mod = f" (mod 16: {u % 16} / {v % 16})" if isinstance(u, int) and isinstance(v, int) else ""
                print(f"    arg {i}: {u!r} / {v!r}{mod}")


def placement(numbers, compiled_numbers, flat, state, steps: int) -> None:  # noqa: ARG001 (flat, state: the key)
    """Whether the eager and compiled numbers ways differ by their tables alone (one group: the 1.07B set): the
    two groups' tables compared, the compiled way timed with the eager plan's tables, then the eager way with
    its table copied to other addresses."""
    from bnbf import functional, ops

    pg = functional._LAST[id(flat), id(state)]().groups[0][1]  # the eager way's plan
    cached = [g for g, _ in ops._GROUPS.values() if g.table.shape == pg.table.shape and g is not pg]
    og = cached[-1]  # the op's most recently used group: the compiled numbers way's (it ran last)
    for g in cached:
        same = torch.equal(g.table, pg.table), torch.equal(g.grad_table, pg.grad_table)
        print(f"placement: op group {'(the last) ' * (g is og)}table equal {same[0]}, grad table equal {same[1]}")

    def timed(name, fn):
        us = device_time(fn, steps)[0]
        print(f"  {name}: {us:.1f} us (table at {pg.table.data_ptr() % 65536} / {og.table.data_ptr() % 65536})")

    timed("numbers", numbers)
    timed("compiled_numbers", compiled_numbers)
    og.table, og.grad_table = pg.table, pg.grad_table  # the compiled way now launches with the eager tables
    timed("compiled_numbers, the eager tables", compiled_numbers)
    timed("numbers", numbers)
    junk = []
    for k in range(4):  # the eager table moved: allocations of other sizes between
        junk.append(torch.empty(512 * (k + 1) + 128, dtype=torch.uint8, device=pg.table.device))
        pg.table = og.table = pg.table.clone()
        timed(f"numbers, table copy {k}", numbers)
        timed("compiled_numbers, sharing it", compiled_numbers)


def run(set_name: str, dtype: torch.dtype, steps: int, launches: bool = False) -> None:
    device = torch.device("cuda")
    shapes = bs.SETS[set_name]()
    params = bs.make_tensors(shapes, dtype, device, 0.02, 0)
    grads = bs.make_tensors(shapes, dtype, device, 0.01, 1)
    layout = bnbf.flat_layout(params, bnbf.OptimSpec(rule="adamw"))
    flat, flat_grads = layout.flatten(params), layout.flatten(grads)
    state = layout.init_state(flat)
    lr = torch.tensor(1e-3, device=device)
    t = torch.tensor(1, device=device)
    count = [100]

    def numbers(i: int) -> None:
        count[0] += 1
        bnbf.update_(flat, flat_grads, state, {"lr": _lr(count[0]), "weight_decay": 0.01}, count[0])

    def tensors(i: int) -> None:
        bnbf.update_(flat, flat_grads, state, {"lr": lr, "weight_decay": 0.01}, t)

    step = torch.compile(
        lambda p, g, s, lr, t: bnbf.update_(p, g, s, {"lr": lr, "weight_decay": 0.01}, t), fullgraph=True
    )

    def compiled(i: int) -> None:
        count[0] += 1
        t.fill_(count[0])
        step(flat, flat_grads, state, lr, t)

    step_numbers = torch.compile(  # its own code object: Dynamo keeps these compiles apart from the tensors' way
        lambda p, g, s, lr, t: bnbf.update_(p, g, s, {"lr": lr, "weight_decay": 0.01}, t), fullgraph=True
    )

    def compiled_numbers(i: int) -> None:
        count[0] += 1
        step_numbers(flat, flat_grads, state, _lr(count[0]), count[0])

    for fn in (numbers, tensors, compiled, compiled_numbers):
        for i in range(3):
            fn(i)
    if launches:
        compare_launches({"numbers": numbers, "compiled_numbers": compiled_numbers})
        if len(bnbf.functional._LAST[id(flat), id(state)]().groups) == 1:
            placement(numbers, compiled_numbers, flat, state, steps)
    side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graphs asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            tensors(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tensors(0)
    ways = {
        "numbers": numbers,
        "compiled_numbers": compiled_numbers,
        "compiled": compiled,
        "captured": lambda i: graph.replay(),
        "tensors": tensors,
        "numbers_again": numbers,  # the device's clock drifts within a run: the first two ways timed again, last
        "compiled_numbers_again": compiled_numbers,
    }
    base = None
    for name, fn in ways.items():
        us, kernels, top = device_time(fn, steps)
        base = base or us
        names = "; ".join(f"{k} {v:.1f}" for k, v in top)
        print(f"| {set_name} | {name} | {us:.1f} | {us / base:.3f} | {kernels:.0f} | {names} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="gpt2_124M,big_1B")
    parser.add_argument("--dtype", default="bf16", choices=sorted(bs.DTYPES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--launches", action="store_true", help="first: how the eager and compiled launches differ")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", __import__("triton").__version__)
    print("| set | way | device us a step | / numbers | kernels a step | top kernels (us a step) |")
    print("|---|---|---|---|---|---|")
    for set_name in args.sets.split(","):
        run(set_name, bs.DTYPES[args.dtype], args.steps, args.launches)


if __name__ == "__main__":
    main()
