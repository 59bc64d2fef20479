"""Where a bnbf step's time goes on the GPU: host time of the call, kernel time, and wall time.

python scripts/profile_step.py        # GPT-2 small's 148 tensors and one 4096x4096 tensor
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bnbf  # noqa: E402
import bnbf_nn  # noqa: E402
from benchmarks.bench_step import SETS  # noqa: E402


def profile(
    set_name: str, dtype: torch.dtype, rule: str = "adamw", steps: int = 20, adapter: bool = False, plan: bool = False
) -> None:
    shapes = SETS[set_name]()
    params = {name: (torch.randn(s, device="cuda") * 0.1).to(dtype) for name, s in shapes}
    grads = {k: (torch.randn_like(v, dtype=torch.float32) * 0.01).to(dtype) for k, v in params.items()}
    hp = {"lr": 1e-3, "weight_decay": 0.01}
    if adapter:  # the drop-in class: the same step through torch.optim's step()
        leaves = [torch.nn.Parameter(p) for p in params.values()]
        for leaf, g in zip(leaves, grads.values()):
            leaf.grad = g
        opt = bnbf_nn.AdamW8bit(leaves, **hp)
        step = lambda i: opt.step()
    elif plan:  # the explicit plan, held by the loop
        opt = bnbf.plan(params, bnbf.init_state(params, bnbf.OptimSpec(rule=rule), hp))
        step = lambda i: opt.step(grads, hp, i)
    else:
        state = bnbf.init_state(params, bnbf.OptimSpec(rule=rule), hp)
        step = lambda i: bnbf.update_(params, grads, state, hp, i)
    for i in range(1, 4):
        step(i)
    torch.cuda.synchronize()
    host, wall = [], []
    for i in range(4, 4 + steps):
        t0 = time.perf_counter()
        step(i)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        wall.append(t2 - t0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(100, 100 + steps):
            step(i)
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0:
            kernels[e.key[:40]] = e.self_device_time_total / steps / 1e3
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3
    what = "bnbf_nn.AdamW8bit" if adapter else f"{rule} plan.step" if plan else f"{rule} update_"
    print(
        f"{set_name} {str(dtype)[6:]} {what}: host {med(host):.3f} ms, wall {med(wall):.3f} ms, kernels "
        + ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:4])
    )


if __name__ == "__main__":
    for name in ("gpt2_124M", "single_4096x4096"):
        for dt in (torch.float32, torch.bfloat16):
            profile(name, dt)
    for dt in (torch.float32, torch.bfloat16):
        profile("gpt2_124M", dt, plan=True)
        profile("gpt2_124M", dt, adapter=True)
    profile("gpt2_124M", torch.float32, "lamb")
    profile("gpt2_124M", torch.float32, "lars")
