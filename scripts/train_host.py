"""Where a compiled training step's time goes, with and without the optimizer: bench_func's ``train`` row
(a GPT-2-small-shaped ``bnbf.demo.CharTransformer``, 150 tensors, batch 8x256, bf16, 8-bit AdamW through
``bnbf.update_``, lr and step 0-d tensors) under ``torch.compile(fullgraph=True)``, profiled.

    python scripts/train_host.py            # on a GPU
    python scripts/train_host.py --tiny     # a 2-layer model, for a CPU (TRITON_INTERPRET=1 for the Triton route)

Prints, for the step with ``update_`` and for the same step returning its grads instead: the median step time
(CUDA events), the host time of a call, the device kernels of one call by name (count), and torch.profiler's
table of host time by region and op (self CPU), so that what the optimizer adds to a compiled step shows
(guards over its state inputs, Inductor's input checks, the op, any copies).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch
from torch.func import grad_and_value
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_func  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    _, params, state, x, y, loss_fn, with_update, _ = bench_func.train_case(device, torch.bfloat16, args.tiny)
    lr, t = torch.tensor(1e-4, device=device), torch.tensor(1, device=device)

    def grads_only(params, state, x, y, lr, i):
        return grad_and_value(loss_fn)(params, x, y)

    cuda = device.type == "cuda"
    print(f"{torch.cuda.get_device_name(0) if cuda else 'CPU'}, torch {torch.__version__}, {len(params)} tensors")
    for name, fn in (("with update_", with_update), ("grads returned", grads_only)):
        step = torch.compile(fn, fullgraph=True)
        for i in range(3):
            t.fill_(i + 1)
            step(params, state, x, y, lr, t)
        if cuda:
            torch.cuda.synchronize()
        host, ms = [], []
        for i in range(args.calls):
            t.fill_(i + 4)
            start = torch.cuda.Event(enable_timing=True) if cuda else None
            end = torch.cuda.Event(enable_timing=True) if cuda else None
            if cuda:
                torch.cuda.synchronize()
                start.record()
            t0 = time.perf_counter()
            step(params, state, x, y, lr, t)
            host.append((time.perf_counter() - t0) * 1e3)
            if cuda:
                end.record()
                torch.cuda.synchronize()
                ms.append(start.elapsed_time(end))
        step_ms = f"{statistics.median(ms):.3f} ms" if ms else "n/a"
        print(f"\n== {name}: step {step_ms}, host {statistics.median(host):.3f} ms a call (median of {args.calls})")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            step(params, state, x, y, lr, t)
            if cuda:
                torch.cuda.synchronize()
        kernels = collections.Counter(
            e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
        )
        print(f"{sum(kernels.values())} device kernels; most frequent: {kernels.most_common(6)}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
