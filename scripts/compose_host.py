"""Host time of the composing forms' step (``bnbf.update`` fed its outputs back, and ``bnbf.update_``) on GPT-2 small's
148 tensors (bf16, 8-bit AdamW), against one shared mapping: per-leaf hyperparameters (a callable that returns new
dicts every call), a schedule on lr, two rules (Lion for the embeddings) by rule.

    python scripts/compose_host.py          # on a CUDA machine (no synchronize inside the timed calls)
    python scripts/compose_host.py --cpu    # anywhere: CPU tensors (148 small ones of the same structure) on the
                                            # Triton path's host code, every kernel launch stubbed out
    python scripts/compose_host.py --nested # the params nested by module ({"h.0.attn.c_attn": {"weight": ...}}),
                                            # the grads and states alike
    python scripts/compose_host.py --ordered # the params as a flat OrderedDict (model.state_dict()'s type)

Prints the median (CUDA) or minimum (``--cpu``: on a shared CPU the median mostly measures other processes)
microseconds of a call over ``--calls`` calls.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--nested", action="store_true")
    ap.add_argument("--ordered", action="store_true")
    args = ap.parse_args()
    if args.cpu:  # the Triton path's host code on CPU tensors, every kernel launch a no-op
        os.environ["TRITON_INTERPRET"] = "1"
        launcher.launch_group = plan.launch_group = lambda *a, **k: None
    device = torch.device("cpu" if args.cpu else "cuda")
    shapes = (bs.SMOKE_SETS if args.cpu else bs.SETS)["gpt2_124M"]()
    params = {n: torch.randn(s, device=device).to(torch.bfloat16) for n, s in shapes}
    if args.nested:  # a dict by module of dicts by param name
        nested: dict = {}
        for n, v in params.items():
            module, _, leaf = n.rpartition(".")
            nested.setdefault(module, {})[leaf] = v
        params = nested
    if args.ordered:
        params = collections.OrderedDict(params)
    grads = torch.utils._pytree.tree_map(torch.randn_like, params)
    adamw = bnbf.OptimSpec(rule="adamw")
    no_decay = lambda path, p: {"lr": 1e-3, "weight_decay": 0.0 if p.ndim == 1 else 0.1}  # noqa: E731
    forms = {
        "one shared mapping": (adamw, {"lr": 1e-3, "weight_decay": 0.01}),
        "per-leaf callable (new dicts)": (adamw, no_decay),
        "schedule on lr": (adamw, {"lr": lambda t: 1e-3 * min(1.0, t / 100), "weight_decay": 0.01}),
        "two rules, by rule": (
            lambda path, p: bnbf.OptimSpec(rule="lion" if "wte" in path or "wpe" in path else "adamw"),
            {"adamw": {"lr": 1e-3}, "lion": {"lr": 1e-4}},
        ),
    }  # fmt: skip

    def timed(fn) -> float:
        for i in range(10):
            fn(i)
        times = []
        for i in range(args.calls):
            t0 = time.perf_counter()
            fn(10 + i)
            times.append(time.perf_counter() - t0)
            if not args.cpu and i % 20 == 19:
                torch.cuda.synchronize()  # a short queue: the host's work is timed, not a full launch queue
        if not args.cpu:
            torch.cuda.synchronize()
        return (min(times) if args.cpu else statistics.median(times)) * 1e6

    name = "CPU (launch stubbed out)" if args.cpu else torch.cuda.get_device_name()
    n = len(torch.utils._pytree.tree_leaves(params))
    tree = ("nested by module" if args.nested else "a flat dict") + (", OrderedDicts" if args.ordered else "")
    print(f"{name}, torch {torch.__version__}, host checks {'native' if NATIVE else 'python'}, {n} params ({tree})")
    print("| hyperparameters | update (pure, fed back) | update_ (in place) |\n|---|---|---|")
    for form, (spec, hp) in forms.items():
        held = [params, bnbf.init_state(params, spec)]

        def pure(i: int, held=held, hp=hp) -> None:
            held[:] = bnbf.update(held[0], grads, held[1], hp, i + 1)

        own_p, own_s = torch.utils._pytree.tree_map(torch.clone, params), bnbf.init_state(params, spec)
        in_place = lambda i, p=own_p, s=own_s, hp=hp: bnbf.update_(p, grads, s, hp, i + 1)  # noqa: E731
        print(f"| {form} | {timed(pure):.0f} us | {timed(in_place):.0f} us |")


if __name__ == "__main__":
    main()
