"""Host time of the vmapped ensemble step with the memo of its checks (bnbf/_vmap_memo.py) and without it, the two
alternating in one process: bench_func's ``vmap_flat`` set-up (8 GPT-2-small-shaped members, flat params,
stacked; bf16, 8-bit AdamW, Python-number lr and step, or with ``--tensors`` 0-d tensors on the device: the step
filled before each call, as a captured step's warm-up passes them), the kernel launch stubbed out (CPU) or real
(CUDA).

    python scripts/vmap_memo_host.py [--in-place] [--tensors] [--rounds 6] [--calls 150]
    TRITON_INTERPRET=1 python scripts/vmap_memo_host.py --cpu [--in-place]

Prints, per mode, the median microseconds of a call: torch.func's processing of the inputs before the vmapped
function runs, bnbf's time from there to its first launch (``--cpu``: to the stubbed launch), bnbf's whole time
inside the call, and the call's; on CUDA also the median synchronized step (CUDA events after a synchronize, as
benchmarks/bench_step.py times a step). ``--cpu`` takes GPT-2's structure at small sizes (host time depends on the
tensor count, not their sizes); the launch is stubbed there, so CPU tables miss their cache each pure call (the
CPU allocator hands out new addresses; CUDA's caching allocator hands back the same blocks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.bench_func as bench_func  # noqa: E402
import benchmarks.bench_step as bs  # noqa: E402
import bnbf  # noqa: E402
import bnbf.functional as F  # noqa: E402
import bnbf.kernels.launcher as launcher  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--in-place", action="store_true")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--tensors", action="store_true")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=150)
    args = ap.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    if args.cpu and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        # CPU tensors take the reference path unless the interpreter is on: no launch would be timed
        ap.error("--cpu times the Triton route's host code: set TRITON_INTERPRET=1")
    launches: list = []
    if args.cpu:
        launcher.launch_group = lambda *a, **k: launches.append(time.perf_counter())
    else:
        real = launcher.launch_group

        def timed_launch(*a, **k):
            launches.append(time.perf_counter())
            return real(*a, **k)

        launcher.launch_group = timed_launch
    shapes = bs.SMOKE_SETS["gpt2_124M"]() if args.cpu else bs.SETS["gpt2_124M"]()
    members, hp = bench_func.MEMBERS, bench_func.HP
    step_of = lambda n: n  # noqa: E731
    if args.tensors:
        hp = {**hp, "lr": torch.tensor(hp["lr"], device=device)}
        count = torch.tensor(1, device=device)
        step_of = count.fill_
    ctx = types.SimpleNamespace(shapes=shapes, dtype=torch.bfloat16, device=device)
    params, grads, state = bench_func._ensemble(ctx, "flat")  # the vmap_flat row's ensemble
    fn = bnbf.update_ if args.in_place else bnbf.update
    marks: list = []

    def body(p, g, s, i):
        marks.append(time.perf_counter())
        out = fn(p, g, s, hp, i)
        marks.append(time.perf_counter())
        return out

    step = torch.func.vmap(body, in_dims=(0, 0, 0, None))
    held = [params, state]

    def call(k) -> None:  # one step: in place, or the outputs fed back as the next call's inputs
        if args.in_place:
            step(params, grads, state, k)
        else:
            held[:] = step(held[0], grads, held[1], k)

    memo = F._vmapped_hit
    results: dict = {True: [], False: []}
    for _ in range(args.rounds):
        for on in (False, True):
            F._vmapped_hit = memo if on else (lambda *a, **k: None)
            for i in range(args.calls):
                launches.clear()
                marks.clear()
                k = step_of(i + 1)  # a tensor count filled before the timed call
                t0 = time.perf_counter()
                call(k)
                t1 = time.perf_counter()
                if i >= 20:
                    results[on].append((marks[0] - t0, launches[0] - marks[0], marks[1] - marks[0], t1 - t0))
                if device.type == "cuda" and i % 20 == 19:
                    torch.cuda.synchronize()  # a short queue: the host's work is timed, not a full queue's wait
    synced: dict = {True: [], False: []}  # CUDA: each call between two events after a synchronize (bench_step's)
    if device.type == "cuda":
        for _ in range(args.rounds):
            for on in (False, True):
                F._vmapped_hit = memo if on else (lambda *a, **k: None)
                for i in range(20):
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    call(step_of(i + 1))
                    end.record()
                    torch.cuda.synchronize()
                    if i >= 3:
                        synced[on].append(start.elapsed_time(end))
    F._vmapped_hit = memo
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    scalars = "0-d tensor lr and step" if args.tensors else "Python-number lr and step"
    print(f"{name}, torch {torch.__version__}, vmap({fn.__name__}), {members} members, flat params, {scalars}")
    print("| | torch.func's input processing | bnbf to its first launch | bnbf in all | the call | synchronized step |")
    print("|---|---|---|---|---|---|")
    for on in (False, True):
        us = [statistics.median(r[k] for r in results[on]) * 1e6 for k in range(4)]
        step_ms = f"{statistics.median(synced[on]):.3f} ms" if synced[on] else "n/a"
        print(f"| {'memo' if on else 'full checks'} | " + " | ".join(f"{u:.0f} us" for u in us) + f" | {step_ms} |")


if __name__ == "__main__":
    main()
