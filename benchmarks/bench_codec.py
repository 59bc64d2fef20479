"""Time the public block-wise codec: ``bnbf.quantize_blockwise`` / ``dequantize_blockwise`` against
bitsandbytes' ``functional.quantize_blockwise`` / ``dequantize_blockwise`` (when importable), same inputs.

Usage (from the repository root)::

    PYTHONPATH=.peers/site python benchmarks/bench_codec.py              # CUDA
    python benchmarks/bench_codec.py --smoke                             # tiny sizes on the CPU, checks the script

Method as bench_step's: 5 warm-ups, then the median of 20 calls, each between two CUDA events after a device
synchronize. ``quantize_blockwise`` reads each block's absmax back to refuse NaN and inf, so its figure includes
that wait; bitsandbytes' does not check. Effective bandwidth: the fewest bytes a call must move (quantize: read x,
write one code byte per element and one float32 absmax per 256; dequantize: the reverse) over its time, and its
fraction of a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

try:
    import bnbf
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bnbf

from benchmarks.bench_step import DTYPES, Timer, copy_bandwidth_gbs, free_memory

BLOCK = 256


def peer() -> object | None:
    try:
        import bitsandbytes.functional as F
    except Exception:  # not installed, or no library for this machine
        return None
    return F


def codec_bytes(numel: int, dtype: torch.dtype) -> int:
    return numel * (dtype.itemsize + 1) + 4 * -(-numel // BLOCK)


def codec_calls(F, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor) -> dict:
    """call -> (bnbf's, bitsandbytes' or None): the same inputs, the same output dtype."""
    theirs = F and F.QuantState(absmax=absmax, code=code, blocksize=BLOCK, dtype=x.dtype)
    return {
        "quantize": (
            lambda: bnbf.quantize_blockwise(x, code),
            F and (lambda: F.quantize_blockwise(x, code=code, blocksize=BLOCK)),
        ),
        "dequantize": (
            lambda: bnbf.dequantize_blockwise(codes, absmax, code, dtype=x.dtype),
            F and (lambda: F.dequantize_blockwise(codes, theirs)),
        ),
    }


def median_ms(fn, device: torch.device, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        fn()
    timer = Timer(device)
    for _ in range(steps):
        timer.time(fn)
    return statistics.median(timer.results_ms())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16777216,134217728", help="element counts, comma-separated")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    sizes = [4097] if args.smoke else [int(s) for s in args.sizes.split(",")]
    steps, warmup = (2, 1) if args.smoke else (args.steps, args.warmup)
    F = None if device.type == "cpu" else peer()
    copy = copy_bandwidth_gbs(device, 256 << 20 if device.type == "cuda" else 1 << 20)
    code = bnbf.create_dynamic_map(signed=True).to(device)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    print(f"# codec benchmark: {name}, torch {torch.__version__}, device copy {copy:.0f} GB/s")
    print("| numel | dtype | call | bnbf ms (% copy) | bitsandbytes ms (% copy) |")
    print("|---|---|---|---|---|")
    for n in sizes:
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            x = torch.randn(n, device=device).to(dtype)
            codes, absmax = bnbf.quantize_blockwise(x, code)
            nbytes = codec_bytes(n, dtype)
            calls = codec_calls(F, x, codes, absmax, code)
            for call, (ours, theirs) in calls.items():
                cells = []
                for fn in (ours, theirs):
                    if fn is None:
                        cells.append("-")
                        continue
                    ms = median_ms(fn, device, warmup, steps)
                    cells.append(f"{ms:.3f} ({100 * nbytes / (ms * 1e-3) / 1e9 / copy:.0f}%)")
                print(f"| {n} | {dname} | {call} | {cells[0]} | {cells[1]} |")
            del x, codes, absmax
            free_memory(device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
