"""The largest 8-bit Adam step over long runs whose blocks mix one large gradient with small, noisy, sparse ones.

    python benchmarks/step_tail.py [--steps 3000]

Adam (lr 1e-3, betas 0.9/0.999), 2048 params at 0; in every 256-element block one element's gradient is 1.0
every step and the other 255 get ``small * (1 + 0.5 * randn)`` on a random half of the steps (zero otherwise),
so their second moments sit at a few times 1e-7 to 1e-5 of the block's largest: power-format codes 5 to 18.
Prints, per state format and ``small``, the largest step in lr of the 8-bit run, of the 32-bit run (bnbf's
32-bit state), and of torch.optim.Adam on the same gradients, with the steps above 3 lr after step 1000. The
tests' hypothesis runs are at most 400 steps; this is what a longer run does. Runs on the CPU's reference path.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bnbf  # noqa: E402

N, LR = 2048, 1e-3


def grads(small: float, steps: int):
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        g = small * (1 + 0.5 * torch.randn(N, generator=gen)) * (torch.rand(N, generator=gen) < 0.5)
        g[::256] = 1.0
        yield g


def largest_steps(fmt: str | None, small: float, steps: int) -> tuple[float, int]:
    """(largest |step| / lr, steps above 3 lr after step 1000) of bnbf's 8-bit state in ``fmt`` (None: 32-bit)."""
    p = torch.zeros(N)
    spec = bnbf.OptimSpec(
        rule="adam", state_bits=32 if fmt is None else 8, state_format=fmt or "power", min_8bit_size=0
    )
    state = bnbf.init_state(p, spec)
    worst, late = 0.0, 0
    for t, g in enumerate(grads(small, steps), start=1):
        new, state = bnbf.update(p, g, state, {"lr": LR}, t)
        d = (new - p).abs() / LR
        worst = max(worst, float(d.max()))
        late += int((d > 3).sum()) if t > 1000 else 0
        p = new
    return worst, late


def torch_largest(small: float, steps: int) -> float:
    p = torch.nn.Parameter(torch.zeros(N))
    opt = torch.optim.Adam([p], lr=LR, foreach=False)
    worst = 0.0
    for g in grads(small, steps):
        before = p.detach().clone()
        p.grad = g
        opt.step()
        worst = max(worst, float((p.detach() - before).abs().max() / LR))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args()
    print(f"torch {torch.__version__}; {args.steps} steps; largest step in lr (steps > 3 lr after step 1000)")
    print("| small | 8-bit power | 8-bit dynamic | 32-bit | torch.optim.Adam |")
    print("|---|---|---|---|---|")
    for small in (6e-4, 2e-3, 6e-3):
        cells = [largest_steps(fmt, small, args.steps) for fmt in ("power", "dynamic", None)]
        text = " | ".join(f"{w:.2f} ({n})" for w, n in cells)
        print(f"| {small:g} | {text} | {torch_largest(small, args.steps):.2f} |")


if __name__ == "__main__":
    main()
