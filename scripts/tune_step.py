"""Sweep the multi-tensor kernel's tile (blocks per program, warps) on the GPU; prints ms and % of copy.

    python scripts/tune_step.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    bw = copy_gbs()
    print(f"copy {bw:.0f} GB/s")
    tiles = [(1, 4), (2, 4), (4, 4), (4, 8), (8, 8)] if not args.quick else [(2, 4), (4, 4)]
    configs = [(e, d, r, w) for e, d in [(0, 0), (1, 0), (0, 1), (1, 1)] for r, w in tiles]
    for set_name, shapes in sets().items():
        for dtype in (torch.float32, torch.bfloat16):
            if set_name == "gpt2_124M" and dtype == torch.bfloat16:
                continue
            torch.manual_seed(0)
            params = {str(i): (torch.randn(s, device="cuda") * 0.1).to(dtype) for i, s in enumerate(shapes)}
            grads = {k: (torch.randn_like(v, dtype=torch.float32) * 0.01).to(dtype) for k, v in params.items()}
            numel = sum(p.numel() for p in params.values())
            nbytes = numel * (3 * params["0"].element_size() + 4) + numel // 256 * 16
            for bits in (8, 32):
                if bits == 32 and set_name == "big_1B" and dtype == torch.bfloat16:
                    continue
                st = bnbf.init_state(params, bnbf.OptimSpec(rule="adamw", state_bits=bits))
                nb = nbytes if bits == 8 else numel * (3 * params["0"].element_size() + 16)
                todo = configs if bits == 8 and set_name == "big_1B" else [(1, 1, 2, 4), (1, 1, 4, 4)]
                for enc, dec, rows, warps in todo:
                    mt.ROWS, mt.NUM_WARPS, mt.ENCODER, mt.DECODER = rows, warps, enc, dec
                    step = [0]

                    def fn():
                        step[0] += 1
                        bnbf.update_(params, grads, st, {"lr": 1e-3, "weight_decay": 0.01}, step[0])

                    ms = triton.testing.do_bench(fn, warmup=5, rep=60)
                    print(f"{set_name:10s} {str(dtype)[6:]:9s} {bits:2d}bit enc={enc} dec={dec} rows={rows} w={warps}: "
                          f"{ms:7.3f} ms {nb / ms / 1e6:6.0f} GB/s {100 * nb / ms / 1e6 / bw:5.1f}% copy",
                          flush=True)
                del st
            del params, grads
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
