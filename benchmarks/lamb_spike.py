"""LAMB's largest single-element step near a gradient spike, 8-bit state against 32-bit state (CPU).

Usage (from the repository root)::

    python benchmarks/lamb_spike.py                 # every pattern, 8-bit (power, dynamic) and 32-bit state
    python benchmarks/lamb_spike.py --n 256 --steps 20 --seeds 1   # one size, shorter

LAMB scales each tensor's update u by lr x min(||p||, clamp_value) / ||u||, so one element's step is at most
clamp_value x lr (10 lr by default) however its moments are stored. A spike in an 8-bit block sets the block's
absmax: the second moments of the block's other elements round up, their u_i shrink, and the trust ratio hands
their share of ||u|| to the spike's element. This script measures how close a step comes to that ceiling.

Setup: one tensor of ``--n`` params (256, 1024 and 4096: one block, 4 and 16) ~ N(0, 1) (unit scale, so
||p|| is far above the update's norm), gradients N(0, 1e-3^2) with 1e6 spikes placed by each pattern, LAMB
with torch_optimizer.Lamb's defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-6, clamp_value 10),
``min_8bit_size=0``. Reported: the largest |p_new - p_old| / lr of any element over the steps.
Patterns (a spike is 1e6 times the sign shown):

- ``one element, every step``: element 0, +1e6 at every step;
- ``one element, sign alternating``: element 0, (-1)^t 1e6;
- ``one element, every other step``: element 0, +1e6 at odd steps;
- ``one element, the first step``: element 0 at step 1 only;
- ``every block, every step``: the first element of every 256-element block, +1e6;
- ``every block, sign alternating``: the first element of every block, (-1)^t 1e6;
- ``a block in turn``: the first element of block t mod (blocks), +1e6.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bnbf  # noqa: E402

BLOCK = 256


def _spike(g: torch.Tensor, idx, value: float) -> None:
    g[idx] = value


PATTERNS = {
    "one element, every step": lambda g, t: _spike(g, 0, 1e6),
    "one element, sign alternating": lambda g, t: _spike(g, 0, 1e6 * (-1) ** t),
    "one element, every other step": lambda g, t: _spike(g, 0, 1e6) if t % 2 else None,
    "one element, the first step": lambda g, t: _spike(g, 0, 1e6) if t == 1 else None,
    "every block, every step": lambda g, t: _spike(g, slice(0, None, BLOCK), 1e6),
    "every block, sign alternating": lambda g, t: _spike(g, slice(0, None, BLOCK), 1e6 * (-1) ** t),
    "a block in turn": lambda g, t: _spike(g, BLOCK * (t % (g.numel() // BLOCK)), 1e6),
}


def largest_step(bits: int, fmt: str, pattern, n: int, steps: int, seed: int) -> tuple[float, int]:
    """The largest |p_new - p_old| / lr over the steps, and the step where it happened."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    spec = bnbf.OptimSpec(rule="lamb", state_bits=bits, min_8bit_size=0, state_format=fmt)
    state = bnbf.init_state(p, spec)
    lr = 1e-3
    worst, at = 0.0, 0
    for t in range(1, steps + 1):
        g = 1e-3 * torch.randn(n, generator=gen)
        pattern(g, t)
        new, state = bnbf.update(p, g, state, {"lr": lr}, t)
        step = float((new - p).abs().max()) / lr
        if step > worst:
            worst, at = step, t
        p = new
    return worst, at


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run without TRITON_INTERPRET: the CPU reference path is what this measures")
    cases = [("8-bit power", 8, "power"), ("8-bit dynamic", 8, "dynamic"), ("32-bit", 32, "power")]
    print(f"torch {torch.__version__}; LAMB, {args.steps} steps, seeds 0..{args.seeds - 1}")
    print("largest step over the steps, in lr (max over the seeds; the step where it happened)")
    for n in args.n:
        print(f"\n{n} params\n")
        print("| pattern | " + " | ".join(name for name, _, _ in cases) + " |")
        print("|---|" + "---|" * len(cases))
        for name, pattern in PATTERNS.items():
            cells = []
            for _, bits, fmt in cases:
                worst = max(largest_step(bits, fmt, pattern, n, args.steps, s) for s in range(args.seeds))
                cells.append(f"{worst[0]:.2f} (step {worst[1]})")
            print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
