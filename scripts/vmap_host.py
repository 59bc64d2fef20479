"""Where the host time of the vmapped ensemble step goes (bench_func's ``vmap_flat`` set-up: 8 GPT-2-small-shaped
members, flat params, stacked; bf16, 8-bit AdamW, Python-number lr and step).

    python scripts/vmap_host.py [--cpu] [--members 8] [--calls 200] [--no-gc]

Prints the median host microseconds of a call (no synchronize inside the timed calls) of ``vmap(bnbf.update)``
(outputs fed back), ``vmap(bnbf.update_)``, and vmap of a function returning its inputs (torch.func's own floor),
then the functions with the most own time over the calls under cProfile, and on CUDA the runtime calls
torch.profiler counted in one call. ``--no-gc``: Python's garbage collector off while timing (what its
collections add to a call). ``--cpu`` needs ``TRITON_INTERPRET=1`` for the Triton route; its launches
then run in the interpreter, so ``--cpu`` takes GPT-2's structure at tiny sizes (two layers of width 16).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.bench_func as bench_func  # noqa: E402
import benchmarks.bench_step as bs  # noqa: E402
import bnbf  # noqa: E402


def host_us(device: torch.device, fn, calls: int) -> float:
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
        if i % 20 == 19 and device.type == "cuda":
            torch.cuda.synchronize()  # keep the queue short: what is timed is the host's work, not a full queue
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--no-gc", action="store_true")
    args = ap.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    shapes = bs.gpt2_shapes(vocab=64, ctx=16, d=16, layers=2) if args.cpu else bs.SETS["gpt2_124M"]()
    hp = bench_func.HP
    ctx = types.SimpleNamespace(shapes=shapes, dtype=torch.bfloat16, device=device)
    params, grads, state = bench_func._ensemble(ctx, "flat", args.members)  # the vmap_flat row's ensemble
    pure = torch.func.vmap(lambda p, g, s, i: bnbf.update(p, g, s, hp, i), in_dims=(0, 0, 0, None))
    in_place = torch.func.vmap(lambda p, g, s, i: bnbf.update_(p, g, s, hp, i), in_dims=(0, 0, 0, None))
    floor = torch.func.vmap(lambda p, g, s, i: (p, s), in_dims=(0, 0, 0, None))
    held = [params, state]

    def step(i: int) -> None:
        held[:] = pure(held[0], grads, held[1], i + 1)

    rows = {
        "vmap(update), outputs fed back": step,
        "vmap(update_)": lambda i: in_place(params, grads, state, i + 1),
        "vmap of a function returning its inputs": lambda i: floor(params, grads, state, i + 1),
    }
    print(
        f"{device} torch {torch.__version__}, {args.members} members, {len(params)} param buffers, "
        f"{len(torch.utils._pytree.tree_leaves(state))} state tensors"
    )
    for name, fn in rows.items():
        for i in range(10):
            fn(i)
        collections = sum(s["collections"] for s in gc.get_stats())
        if args.no_gc:
            gc.disable()
        us = host_us(device, fn, args.calls)
        gc.enable()
        collections = sum(s["collections"] for s in gc.get_stats()) - collections
        print(f"| {name} | {us:.0f} us | {collections} collections in {args.calls} calls |")
    for name in ("vmap(update), outputs fed back", "vmap(update_)"):
        prof = cProfile.Profile()
        prof.enable()
        for i in range(args.calls):
            rows[name](i)
        prof.disable()
        print(f"\n{name}: own time over {args.calls} calls (cProfile)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        if device.type == "cuda":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                rows[name](0)
                torch.cuda.synchronize()
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
