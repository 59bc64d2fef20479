"""Sweep the multi-tensor kernel's tile (blocks per program, warps, vector width, tiles per program,
prefetch of the next tile) on the GPU, AdamW on the 1.07B and GPT-2 sets, then tiles per program for the
rules with a norm pass against their single-pass counterparts; prints ms (triton's do_bench) and % of copy.
About 110 s on the H200.

    python scripts/tune_step.py
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bnbf  # noqa: E402
from bnbf.kernels import multi_tensor as mt  # noqa: E402


def copy_gbs(n=1 << 30):
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=100)
    return 2 * n / ms / 1e6


def sets():
    big = [(8192, 16384)] * 8
    gpt2 = [(50257, 768), (1024, 768)]
    for _ in range(12):
        gpt2 += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,),
                 (768, 3072), (3072,), (3072, 768), (768,)]
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


def main():
    ap = argparse.ArgumentParser()
    ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    bw = copy_gbs()
    print(f"copy {bw:.0f} GB/s")
    # (rows, warps, vec, iters, prefetch)
    tiles = [(1, 1, 4, 1, False), (1, 1, 4, 2, True), (1, 1, 4, 4, False), (1, 1, 4, 4, True), (1, 1, 4, 8, True),
             (1, 1, 8, 4, True), (1, 1, 8, 2, True)]
    configs = [("power", *t) for t in tiles] + [("dynamic", 1, 1, 1, 1, False), ("dynamic", 1, 1, 1, 4, False),
                                                ("dynamic", 1, 1, 1, 4, True)]
    check()
    for set_name, shapes in sets().items():
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            params = {str(i): (torch.randn(s, device="cuda") * 0.1).to(dtype) for i, s in enumerate(shapes)}
            grads = {k: (torch.randn_like(v, dtype=torch.float32) * 0.01).to(dtype) for k, v in params.items()}
            numel = sum(p.numel() for p in params.values())
            nbytes = numel * (3 * params["0"].element_size() + 4) + numel // 256 * 16
            for bits in (8, 32):
                if bits == 32 and set_name == "big_1B" and dtype == torch.bfloat16:
                    continue
                nb = nbytes if bits == 8 else numel * (3 * params["0"].element_size() + 16)
                todo = configs if bits == 8 else [("power", 1, 1, 4, 1, False), ("power", 1, 1, 4, 4, True)]
                if set_name != "big_1B":
                    todo = [c for c in todo if c[0] == "power"]
                for fmt, rows, warps, vec, iters, prefetch in todo:
                    stored = fmt if bits == 8 else "fp32"
                    mt.ROWS, mt.NUM_WARPS, mt.VEC[fmt], mt.ITERS[stored][dtype] = rows, warps, vec, iters
                    mt.PREFETCH[stored] = prefetch
                    st = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", state_bits=bits, state_format=fmt))
                    step = [0]

                    def fn(params=params, grads=grads, st=st, step=step):
                        step[0] += 1
                        bnbf.update_(params, grads, st, {"lr": 1e-3, "weight_decay": 0.01}, step[0])

                    ms = triton.testing.do_bench(fn, warmup=5, rep=60)
                    tile = f"rows={rows} w={warps} vec={vec} it={iters} pf={int(prefetch)}"
                    print(f"{set_name:10s} {str(dtype)[6:]:9s} {bits:2d}bit {fmt:7s} {tile}: "
                          f"{ms:7.3f} ms {nb / ms / 1e6:6.0f} GB/s {100 * nb / ms / 1e6 / bw:5.1f}% copy",
                          flush=True)
                del st
            del params, grads
            torch.cuda.empty_cache()
    # rules with a norm pass against their single-pass counterparts, by tiles per program
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        params = {str(i): (torch.randn(s, device="cuda") * 0.1).to(dtype) for i, s in enumerate(sets()["big_1B"])}
        grads = {k: (torch.randn_like(v, dtype=torch.float32) * 0.01).to(dtype) for k, v in params.items()}
        for rule in ("adamw", "lamb", "sgd", "lars"):
            hp = {"lr": 1e-3, "momentum": 0.9} if rule in ("sgd", "lars") else {"lr": 1e-3}
            for iters, prefetch in ((1, False), (2, True), (4, True), (8, True)):
                mt.VEC["power"], mt.ITERS["power"][dtype], mt.PREFETCH["power"] = 4, iters, prefetch
                st = bnbf.init_state(params, bnbf.OptimSpec(rule=rule, state_bits=8), hp)
                step = [0]

                def fn(params=params, grads=grads, st=st, step=step, hp=hp):
                    step[0] += 1
                    bnbf.update_(params, grads, st, hp, step[0])

                ms = triton.testing.do_bench(fn, warmup=5, rep=60)
                print(f"big_1B {str(dtype)[6:]:9s} {rule:6s} it={iters} pf={int(prefetch)}: {ms:7.3f} ms", flush=True)
                del st
        del params, grads
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
