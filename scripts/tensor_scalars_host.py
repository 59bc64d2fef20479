"""Where the host time of the eager vmapped in-place ensemble step goes when lr and the step are 0-d device tensors
(``vmap_graph``'s eager twin in benchmarks/bench_func.py), against Python numbers: the median host time of a call and
of bnbf's parts inside it (each wrapped with a timer), then ``torch.profiler``'s ops and kernels over 10 calls.
``--torch-ops`` turns off the one-launch program of the tensor scalars (bnbf.kernels.scalar_program): each scalar
then comes from small torch ops, as before it. ``--int-step``: a tensor lr beside a Python int step.

    python scripts/tensor_scalars_host.py [--numbers | --torch-ops | --int-step] [--calls 200]

CUDA only (the question is what the small ops on device scalars cost a GPU's host).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
import types

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks.bench_func as bench_func  # noqa: E402
import benchmarks.bench_step as bs  # noqa: E402
import bnbf  # noqa: E402
import bnbf.functional as F  # noqa: E402
import bnbf.ops as ops  # noqa: E402
from bnbf import _vmap_memo  # noqa: E402

# the parts of the memo's step (bnbf.functional._vmapped_hit) timed, by the module whose name the caller looks up
PARTS = [
    (F, "_vmapped_hit"), (_vmap_memo, "confirm"), (F, "hparam_tensors"), (F, "check_not_differentiated"),
    (F, "_check_step"), (F, "_scalars"), (F, "_one_set"), (ops, "check_vmapped_leaves_apart"),
    (ops, "_stacked_step_"),
]  # fmt: skip


def timed_parts() -> dict:
    spent: dict = collections.defaultdict(list)
    for mod, name in PARTS:
        real = getattr(mod, name)

        def wrapper(*a, _real=real, _name=name, **k):
            t = time.perf_counter()
            out = _real(*a, **k)
            spent[_name].append(time.perf_counter() - t)
            return out

        setattr(mod, name, wrapper)
    return spent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numbers", action="store_true", help="Python-number lr and step instead of 0-d device tensors")
    ap.add_argument("--torch-ops", action="store_true", help="the tensor scalars from small torch ops, no program")
    ap.add_argument("--int-step", action="store_true", help="a 0-d device tensor lr, a Python int step")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    if args.torch_ops:
        sys.modules["bnbf.plan"].PROGRAM_DEVICES = set()
    device = torch.device("cuda")
    ctx = types.SimpleNamespace(shapes=bs.SETS["gpt2_124M"](), dtype=torch.bfloat16, device=device)
    params, grads, state = bench_func._ensemble(ctx, "flat")
    lr = bench_func.HP["lr"] if args.numbers else torch.tensor(bench_func.HP["lr"], device=device)
    count = torch.tensor(1, device=device)
    step_of = (lambda i: i) if args.numbers or args.int_step else count.fill_
    hp = {"lr": lr, "weight_decay": bench_func.HP["weight_decay"]}
    step_ = torch.func.vmap(lambda p, g, s, i: bnbf.update_(p, g, s, hp, i), in_dims=(0, 0, 0, None))
    spent = timed_parts()
    for i in range(1, 31):
        step_(params, grads, state, step_of(i))
    torch.cuda.synchronize()
    spent.clear()
    calls = []
    for i in range(31, 31 + args.calls):
        t = time.perf_counter()
        step_(params, grads, state, step_of(i))
        calls.append(time.perf_counter() - t)
        if i % 10 == 0:
            torch.cuda.synchronize()  # a short queue: the host's own work is timed
    kind = "Python-number" if args.numbers else "0-d device tensor"
    kind += " (torch ops)" if args.torch_ops else ""
    kind += " lr, int step" if args.int_step else " lr and step"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, vmap(update_), {kind}")
    print(f"the call: median {statistics.median(calls) * 1e6:.0f} us")
    for name, times in spent.items():
        print(f"  {name}: {len(times)} calls, median {statistics.median(times) * 1e6:.0f} us")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(1000, 1010):
            step_(params, grads, state, step_of(i))
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="count", row_limit=30, max_name_column_width=50))


if __name__ == "__main__":
    main()
