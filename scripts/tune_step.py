"""Sweep the multi-tensor kernel's launch configuration on the GPU (vector width, tiles per program,
prefetch of the next tile, register cap): AdamW on the 1.07B and GPT-2 sets for each state storage, then
the other rules on the 1.07B set with and without the register cap; prints ms (triton's do_bench) and % of
copy. Starts with a check of the CUDA kernels against the CPU reference. ``--slots``: only the sweep of
the prefetch limits (tiles x kept states) for LAMB, AdEMAMix and AdamW.

    python scripts/tune_step.py [--slots | --rule NAME]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bnbf  # noqa: E402
from bnbf.kernels import launcher as mt  # noqa: E402


def copy_gbs(n=1 << 30):
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=100)
    return 2 * n / ms / 1e6


def sets():
    big = [(8192, 16384)] * 8
    gpt2 = [(50257, 768), (1024, 768)]
    for _ in range(12):
        gpt2 += [
            (768,),
            (768,),
            (768, 2304),
            (2304,),
            (768, 768),
            (768,),
            (768,),
            (768,),
            (768, 3072),
            (3072,),
            (3072, 768),
            (768,),
        ]
    gpt2 += [(768,), (768,)]
    return {"big_1B": big, "gpt2_124M": gpt2}


def check():
    """CUDA kernels against the CPU reference path on odd sizes, every format and param dtype."""
    worst = 0.0
    for fmt in ("power", "dynamic"):
        for bits in (8, 32):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                torch.manual_seed(0)
                shapes = [(1,), (257,), (4097,), (33, 129)]
                p = {str(i): torch.randn(s).to(dtype) for i, s in enumerate(shapes)}
                spec = bnbf.OptimSpec(rule="adamw", state_bits=bits, state_format=fmt, min_8bit_size=0)
                sc, sg = bnbf.init_state(p, spec), bnbf.init_state({k: v.cuda() for k, v in p.items()}, spec)
                pc, pg = dict(p), {k: v.cuda() for k, v in p.items()}
                for step in range(1, 6):
                    g = {k: (torch.randn_like(v, dtype=torch.float32) * 0.1).to(dtype) for k, v in p.items()}
                    pc, sc = bnbf.update(pc, g, sc, {"lr": 1e-2}, step)
                    pg, sg = bnbf.update(pg, {k: v.cuda() for k, v in g.items()}, sg, {"lr": 1e-2}, step)
                for k in p:
                    d = (pc[k].float() - pg[k].float().cpu()).abs().max().item()
                    worst = max(worst, d / (p[k].float().abs().max().item() * 1e-2))
                    if d > 0.05 * 1e-2 * p[k].float().abs().max().item() + 1e-2:
                        print("MISMATCH", fmt, bits, dtype, k, d)
    print(f"cuda vs cpu reference: worst |dp| / (lr * max|p|) = {worst:.3g}")


def bench(params, grads, rule, bits, fmt, hp):
    st = bnbf.init_state(params, bnbf.OptimSpec(rule=rule, state_bits=bits, state_format=fmt), hp)
    step = [0]

    def fn():
        step[0] += 1
        bnbf.update_(params, grads, st, hp, step[0])

    return triton.testing.do_bench(fn, warmup=5, rep=60)


def configure(stored, dtype, vec, iters, prefetch, maxnreg):
    mt.VEC[stored if stored != "fp32" else "power"] = vec
    mt.ITERS[stored][dtype], mt.PREFETCH[stored] = iters, prefetch
    mt.MAXNREG[stored][dtype] = maxnreg


# (vec, tiles per program, prefetch, register cap): the AdamW sweep, by state storage and param dtype
SWEEP = {
    ("power", torch.float32): [
        (4, 1, False, None),
        (4, 2, True, None),
        (4, 2, True, 80),
        (4, 2, False, None),
        (4, 4, True, None),
        (4, 4, True, 80),
    ],
    ("power", torch.bfloat16): [
        (4, 2, True, 64),
        (4, 2, True, 80),
        (4, 4, True, None),
        (4, 4, True, 64),
        (4, 4, True, 72),
        (4, 4, True, 80),
        (4, 4, False, 64),
        (4, 8, False, 64),
        (4, 1, False, None),
    ],
    ("dynamic", torch.float32): [
        (1, 1, False, 64),
        (4, 1, False, None),
        (4, 1, False, 64),
        (4, 2, False, None),
        (4, 2, True, None),
        (4, 2, True, 80),
    ],
    ("dynamic", torch.bfloat16): [
        (1, 1, False, None),
        (4, 1, False, None),
        (4, 2, False, None),
        (4, 2, True, None),
        (4, 2, True, 80),
        (4, 4, True, 64),
    ],
    ("fp32", torch.float32): [(4, 2, True, None)],
    ("fp32", torch.bfloat16): [(4, 4, True, 64)],
}


def sweep_slots():
    """Prefetch limits (tiles x kept states, by kernel mode) for the rules they gate on the 1.07B set."""
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        params = {str(i): (torch.randn(s, device="cuda") * 0.1).to(dtype) for i, s in enumerate(sets()["big_1B"])}
        grads = {k: (torch.randn_like(v, dtype=torch.float32) * 0.01).to(dtype) for k, v in params.items()}
        for rule, limits in (
            ("lamb", ({1: 4, 2: 4}, {1: 8, 2: 4}, {1: 4, 2: 8}, {1: 8, 2: 8})),
            ("ademamix", ({0: 8}, {0: 12})),
            ("adamw", ({0: 8}, {0: 4})),
        ):
            for limit in limits:
                saved = dict(mt.PREFETCH_SLOTS)
                mt.PREFETCH_SLOTS.update(limit)
                ms = bench(params, grads, rule, 8, "power", {"lr": 1e-3})
                mt.PREFETCH_SLOTS.clear()
                mt.PREFETCH_SLOTS.update(saved)
                print(f"big_1B {str(dtype)[6:]:9s} {rule:8s} prefetch limits {limit}: {ms:7.3f} ms", flush=True)
        del params, grads
        torch.cuda.empty_cache()


def sweep_rule(rule: str) -> None:
    """One rule on the 1.07B set, power format, fp32 and bf16 params: tiles per program x prefetch x register cap
    (the prefetch limit lifted, so that prefetch means prefetch)."""
    bw = copy_gbs()
    print(f"copy {bw:.0f} GB/s")
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        params = {str(i): (torch.randn(s, device="cuda") * 0.1).to(dtype) for i, s in enumerate(sets()["big_1B"])}
        grads = {k: (torch.randn_like(v, dtype=torch.float32) * 0.01).to(dtype) for k, v in params.items()}
        saved = (dict(mt.ITERS["power"]), mt.PREFETCH["power"], dict(mt.MAXNREG["power"]), dict(mt.PREFETCH_SLOTS))
        mt.PREFETCH_SLOTS.update({0: 64, 1: 64, 2: 64})
        for iters in (1, 2, 4):
            for prefetch in (False, True) if iters == 2 else (False,):
                for cap in (None, 80, 128):
                    configure("power", dtype, 4, iters, prefetch, cap)
                    ms = bench(params, grads, rule, 8, "power", {"lr": 1e-3})
                    print(
                        f"big_1B {str(dtype)[6:]:9s} {rule} it={iters} pf={int(prefetch)} maxnreg={cap}: {ms:7.3f} ms",
                        flush=True,
                    )
        mt.ITERS["power"], mt.PREFETCH["power"], mt.MAXNREG["power"] = saved[:3]
        mt.PREFETCH_SLOTS.clear()
        mt.PREFETCH_SLOTS.update(saved[3])
        del params, grads
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", action="store_true", help="only the prefetch-limit sweep (PREFETCH_SLOTS)")
    ap.add_argument("--rule", help="only this rule's sweep of tiles, prefetch and register cap (power format)")
    ap.add_argument("--stored", help="only this state storage's AdamW sweep on the 1.07B set (power, dynamic, fp32)")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    if args.slots:
        sweep_slots()
        return
    if args.rule:
        sweep_rule(args.rule)
        return
    bw = copy_gbs()
    print(f"copy {bw:.0f} GB/s")
    check()
    hp = {"lr": 1e-3, "weight_decay": 0.01}
    for set_name, shapes in sets().items():
        if args.stored and set_name != "big_1B":
            continue
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            params = {str(i): (torch.randn(s, device="cuda") * 0.1).to(dtype) for i, s in enumerate(shapes)}
            grads = {k: (torch.randn_like(v, dtype=torch.float32) * 0.01).to(dtype) for k, v in params.items()}
            numel = sum(p.numel() for p in params.values())
            size = params["0"].element_size()
            for stored in ("power", "dynamic", "fp32"):
                if set_name != "big_1B" and stored != "power" or args.stored not in (None, stored):
                    continue
                nb = numel * (3 * size + 16) if stored == "fp32" else numel * (3 * size + 4) + numel // 256 * 16
                saved = (
                    mt.VEC["power"],
                    mt.VEC["dynamic"],
                    dict(mt.ITERS[stored]),
                    mt.PREFETCH[stored],
                    dict(mt.MAXNREG[stored]),
                )
                for vec, iters, prefetch, maxnreg in SWEEP[(stored, dtype)]:
                    configure(stored, dtype, vec, iters, prefetch, maxnreg)
                    bits, fmt = (32, "power") if stored == "fp32" else (8, stored)
                    ms = bench(params, grads, "adamw", bits, fmt, hp)
                    gbs = nb / ms / 1e6
                    print(
                        f"{set_name:10s} {str(dtype)[6:]:9s} {stored:7s} vec={vec} it={iters} pf={int(prefetch)} "
                        f"maxnreg={maxnreg}: {ms:7.3f} ms {gbs:6.0f} GB/s {100 * gbs / bw:5.1f}% copy",
                        flush=True,
                    )
                mt.VEC["power"], mt.VEC["dynamic"], mt.ITERS[stored], mt.PREFETCH[stored], mt.MAXNREG[stored] = saved
            del params, grads
            torch.cuda.empty_cache()
    # the other rules with the defaults, with and without a 64-register cap
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        params = {str(i): (torch.randn(s, device="cuda") * 0.1).to(dtype) for i, s in enumerate(sets()["big_1B"])}
        grads = {k: (torch.randn_like(v, dtype=torch.float32) * 0.01).to(dtype) for k, v in params.items()}
        for rule in ("lion", "ademamix", "lamb", "lars"):
            hp = {"lr": 1e-3, "momentum": 0.9} if rule == "lars" else {"lr": 1e-4 if rule == "lion" else 1e-3}
            for maxnreg in (None, 64):
                saved = mt.MAXNREG["power"].get(dtype)
                mt.MAXNREG["power"][dtype] = maxnreg
                ms = bench(params, grads, rule, 8, "power", hp)
                mt.MAXNREG["power"][dtype] = saved
                print(f"big_1B {str(dtype)[6:]:9s} {rule:8s} maxnreg={maxnreg}: {ms:7.3f} ms", flush=True)
        del params, grads
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
