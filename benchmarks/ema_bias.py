"""How far an 8-bit second moment drifts from the 32-bit one when a block mixes gradients of very different sizes.

    python benchmarks/ema_bias.py [--steps 4000] [--every 500]

Adam (lr 1e-3, betas 0.9/0.999), 4096 params, one gradient of 1.0 in every 256-element block and ``small`` for the
other 255, the same every step: the 8-bit step's codes of the small elements sit far below their block's scale,
where rounding decides the stored value. Prints, per state format and ``small``, the mean 8-bit second moment of
the small elements over the 32-bit one every ``--every`` steps. Above 1: the 8-bit step divides by a larger
second moment (a smaller update, by the square root of the ratio). The power format's stochastic rounding is
unbiased in the code position, and its values go as the position's fourth power; the dynamic format rounds up
below 1e-5 of the block's scale (the zero point, bnbf.quant). Runs on the CPU's reference path.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bnbf  # noqa: E402


def ratios(fmt: str, small: float, steps: int, every: int) -> list[float]:
    n = 4096
    p = torch.zeros(n)
    g = torch.full((n,), small)
    g[::256] = 1.0
    s8 = bnbf.init_state(p, bnbf.OptimSpec(rule="adam", state_bits=8, state_format=fmt))
    s32 = bnbf.init_state(p, bnbf.OptimSpec(rule="adam", state_bits=32))
    others = torch.ones(n, dtype=torch.bool)
    others[::256] = False
    out = []
    for t in range(1, steps + 1):
        _, s8 = bnbf.update(p, g, s8, {"lr": 1e-3}, t)
        _, s32 = bnbf.update(p, g, s32, {"lr": 1e-3}, t)
        if t % every == 0:
            v8 = bnbf.dequantize_state(s8)["exp_avg_sq"][others]
            v32 = bnbf.dequantize_state(s32)["exp_avg_sq"][others]
            out.append(float(v8.mean() / v32.mean()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--every", type=int, default=500)
    args = ap.parse_args()
    print(f"torch {torch.__version__}; the small elements' mean 8-bit / 32-bit second moment, every {args.every} steps")
    print("| format | small (block max 1.0) | v / block max | ratios | last |")
    print("|---|---|---|---|---|")
    for fmt in ("power", "dynamic"):
        for small in (1e-3, 3e-3, 1e-2, 3e-2, 1e-1):
            r = ratios(fmt, small, args.steps, args.every)
            print(f"| {fmt} | {small:g} | {small * small:.0e} | {' '.join(f'{x:.3f}' for x in r)} | {r[-1]:.3f} |")


if __name__ == "__main__":
    main()
