"""Does a step wait on the device? The CUDA runtime calls that block the host (synchronizes, blocking copies,
pinned or device allocations) during back-to-back in-place 8-bit AdamW steps on GPT-2's shapes, bf16, taken
several ways (flat or per-param params; lr and step as Python numbers or 0-d device tensors refilled each
call; eager or ``torch.compile(fullgraph=True)``), with each way's back-to-back ms a step and host ms a call.

    python scripts/sync_probe.py [--calls 30] [--ways flat-compiled-tensors,...] [--smoke: tiny shapes, CPU]

A blocking call in a step makes the host wait for the device, so host and device time add up instead of
overlapping: the back-to-back time then exceeds both. GPU only.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.bench_func as bf  # noqa: E402
import benchmarks.bench_step as bs  # noqa: E402
import bnbf  # noqa: E402

BLOCKING = (
    "Synchronize",
    "cudaMemcpy",
    "cudaHostAlloc",
    "cudaMallocHost",
    "cudaMalloc",
    "cudaFree",
    "cudaHostRegister",
)
WAYS = [f"{m}-{c}-{s}" for m in ("flat", "per_param") for c in ("eager", "compiled") for s in ("numbers", "tensors")]


def _step(params, grads, state, lr, i):
    bnbf.update_(params, grads, state, {"lr": lr, "weight_decay": 0.01}, i)


def make_way(ctx, way: str):
    mode, how, scalars = way.split("-")
    params, grads, state, _, _ = bf._state_of(ctx, mode)
    step = torch.compile(_step, fullgraph=True) if how == "compiled" else _step
    lr = torch.tensor(1e-3, device=ctx.device)
    t = torch.tensor(1, device=ctx.device)

    def fn(i: int) -> None:
        if scalars == "numbers":
            step(params, grads, state, 1e-3 * 0.999**i, i)
            return
        lr.fill_(1e-3 * 0.999**i)
        t.fill_(i)
        step(params, grads, state, lr, t)

    return fn


def probe(ctx, way: str, calls: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn = make_way(ctx, way)
    for i in range(1, 6):  # compiles (numbers: twice) and warms up
        fn(i)
    bs.sync(ctx.device)
    host = []
    t0 = time.perf_counter()
    for i in range(6, 6 + calls):
        h0 = time.perf_counter()
        fn(i)
        host.append((time.perf_counter() - h0) * 1e3)
    bs.sync(ctx.device)
    b2b = (time.perf_counter() - t0) * 1e3 / calls
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(6 + calls, 6 + 2 * calls):
            fn(i)
        bs.sync(ctx.device)
    runtime = collections.Counter(
        e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cuda")
    )
    blocking = {n: c for n, c in runtime.items() if any(b in n for b in BLOCKING) and "Async" not in n}
    blocking.pop("cudaDeviceSynchronize", None)  # the probe's own, after the calls
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    host.sort()
    return (
        f"{way}: back to back {b2b:.3f} ms a step, host {host[len(host) // 2]:.3f} ms a call (median); "
        f"{kernels / calls:.1f} device events a call; blocking runtime calls over {calls} calls: {blocking or 'none'}; "
        f"runtime calls: {dict(runtime.most_common(6))}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--set", default="gpt2_124M")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    sets = bs.SMOKE_SETS if args.smoke else bs.SETS
    ctx = bf.Ctx(device, args.set, sets[args.set](), torch.bfloat16, 5, 20)
    print(torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch", torch.__version__)
    for way in args.ways.split(","):
        print(probe(ctx, way, args.calls), flush=True)
        bs.free_memory(ctx.device)


if __name__ == "__main__":
    main()
