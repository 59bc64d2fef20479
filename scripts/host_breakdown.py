"""Where the host time of one ``bnbf.update_`` call goes on this machine (needs CUDA).

    python scripts/host_breakdown.py [--profile]

Prints, per parameter set, the median host microseconds of: the whole call; the call with the launch
stubbed out (Python only); the whole call with the pure-Python twins of the compiled checks; uploading
the scalar row; the launch alone through the direct path and through Triton's dispatch; and for scale,
one torch kernel launch and torch's fused AdamW step.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bnbf  # noqa: E402
import bnbf.functional as F  # noqa: E402
import bnbf.kernels.multi_tensor as mt  # noqa: E402
from benchmarks.bench_step import SETS  # noqa: E402
from bnbf import _host_checks as hc  # noqa: E402
from bnbf.rules.base import as_scalar_row  # noqa: E402

PROFILE = "--profile" in sys.argv


def host_us(fn, n=200) -> float:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
        if i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def breakdown(set_name: str, dtype=torch.float32) -> dict:
    shapes = SETS[set_name]()
    params = {n: (torch.randn(s, device="cuda") * 0.1).to(dtype) for n, s in shapes}
    grads = {k: (torch.randn_like(v) * 0.01) for k, v in params.items()}
    hp = {"lr": 1e-3, "weight_decay": 0.01}
    state = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw"), hp)
    out = {}
    out["update_"] = host_us(lambda i: bnbf.update_(params, grads, state, hp, i + 1))
    real = F.launch_group
    F.launch_group = lambda *a, **k: None
    try:
        out["python only"] = host_us(lambda i: bnbf.update_(params, grads, state, hp, i + 1))
    finally:
        F.launch_group = real
    # the same call with the pure-Python twins of the compiled checks (a new plan picks them up)
    saved_impl = hc._IMPL
    hc._IMPL = (hc.PYTHON, "python (host_breakdown)")
    F._PLANS.clear()
    try:
        out["update_ (Python checks)"] = host_us(lambda i: bnbf.update_(params, grads, state, hp, i + 1))
    finally:
        hc._IMPL = saved_impl
        F._PLANS.clear()
    bnbf.update_(params, grads, state, hp, 1)  # the plan with the compiled checks again
    rule = bnbf.RULES["adamw"]
    h = rule.make_hparams(hp)
    values = (*rule.scalars(h, 5), 0.0, h.lr)
    dev = torch.device("cuda")
    out["scalar row upload"] = host_us(lambda i: as_scalar_row(values, dev))
    plan = next(p for p in F._PLANS.values() if p.params[0] is next(iter(params.values())))
    gl = list(grads.values())
    launches = [(group, gl if pick is None else pick(gl)) for pick, group in plan.groups]
    row = as_scalar_row(values, dev)

    def launch_all(i):
        for group, gs in launches:
            mt.launch_group(group, gs, row)

    out["launches"] = len(launches)
    out["launch (direct)"] = host_us(launch_all)
    saved = [dict(group.compiled) for group, _ in launches]
    mt.DIRECT_LAUNCH = False
    for group, _ in launches:
        group.compiled.clear()
    out["launch (triton dispatch)"] = host_us(launch_all)
    mt.DIRECT_LAUNCH = True
    for (group, _), kept in zip(launches, saved):
        group.compiled.update(kept)
    x = torch.zeros(1, device="cuda")
    out["torch add_ (1 launch)"] = host_us(lambda i: x.add_(1.0))
    tp = [torch.nn.Parameter(v.detach().clone().float()) for v in params.values()]
    for p, g in zip(tp, grads.values()):
        p.grad = g.float()
    opt = torch.optim.AdamW(tp, lr=1e-3, fused=True)
    opt.step()
    out["torch AdamW fused step"] = host_us(lambda i: opt.step())
    import bnbf_nn

    for p, g in zip(tp, grads.values()):
        p.data = p.data.to(dtype)
        p.grad = g
    ad = bnbf_nn.AdamW8bit(tp, lr=1e-3, weight_decay=0.01)
    ad.step()
    out["bnbf_nn.AdamW8bit step"] = host_us(lambda i: ad.step())
    if PROFILE:
        for name, fn in (("update_", lambda: bnbf.update_(params, grads, state, hp, 7)), ("adapter", ad.step)):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(200):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            print(f"== {set_name} {name}: cProfile of 200 calls")
            pstats.Stats(pr).sort_stats("tottime").print_stats(12)
    return out


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, "| host checks:", hc.status())
    rows = {name: breakdown(name) for name in ("single_4096x4096", "gpt2_124M")}
    keys = list(next(iter(rows.values())))
    print("| host us (median) | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{rows[n][k]:.1f}" for n in rows) + " |")
