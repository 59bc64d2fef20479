"""Time the CPU (pure-torch reference) optimizer step: 8-bit state against 32-bit state.

Usage (from the repository root)::

    python benchmarks/cpu_step.py                         # both sets, fp32 and bf16, 10 timed steps
    python benchmarks/cpu_step.py --sets single_1M --dtypes fp32 --steps 20
    python benchmarks/cpu_step.py --smoke                 # tiny shapes, 1 step: checks the script

Runs AdamW through ``bnbf.update_`` (in place) and ``bnbf.update`` (new tensors) with 32-bit state and each
8-bit state format, the cases taking turns step by step, and prints a markdown table of the minimum and median
step time (``--clock wall``: ``time.perf_counter``; ``cpu``: the process's CPU time, steadier on a shared machine)
and the 8-bit / 32-bit ratio of each. 8-bit states take the native CPU codec where it was built (``--codec torch``:
bnbf.quant's pure-torch oracle instead, the same bits). CPU tensors take the reference path only without
``TRITON_INTERPRET`` (the interpreter runs the Triton kernels instead), so the script refuses to run with it set.
Threads: torch's default unless ``--threads`` (printed with the table). With glibc's default malloc settings
every step page-faults its freed temporaries back in (~15K faults a step on gpt2_4M with 32-bit state), up to half
of the step and most of its noise; ``MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824`` in the
environment keeps them mapped, for steadier figures of the step's own work.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

# the checkout this script is in, before any installed bnbf: its reference step is what the script times
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bnbf  # noqa: E402
from bnbf import _cpu_codec  # noqa: E402
from bnbf.quant import STATE_FORMATS  # noqa: E402

HPARAMS = {"lr": 1e-3, "weight_decay": 0.01}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def gpt2_shapes(vocab: int, ctx: int, d: int, layers: int) -> list[tuple]:
    """GPT-2's parameter shapes (as benchmarks/bench_step.py), at a chosen scale."""
    shapes = [("wte", (vocab, d)), ("wpe", (ctx, d))]
    for i in range(layers):
        shapes += [
            (f"h{i}.ln_1.w", (d,)),
            (f"h{i}.ln_1.b", (d,)),
            (f"h{i}.attn.w", (d, 3 * d)),
            (f"h{i}.attn.b", (3 * d,)),
            (f"h{i}.proj.w", (d, d)),
            (f"h{i}.proj.b", (d,)),
            (f"h{i}.ln_2.w", (d,)),
            (f"h{i}.ln_2.b", (d,)),
            (f"h{i}.fc.w", (d, 4 * d)),
            (f"h{i}.fc.b", (4 * d,)),
            (f"h{i}.fc_proj.w", (4 * d, d)),
            (f"h{i}.fc_proj.b", (d,)),
        ]
    return shapes + [("ln_f.w", (d,)), ("ln_f.b", (d,))]


SETS = {
    "gpt2_4M": lambda: gpt2_shapes(vocab=4096, ctx=256, d=256, layers=4),  # 52 tensors (18 8-bit), 4.27M params
    "single_1M": lambda: [("w", (1024, 1024))],
}
SMOKE_SETS = {
    "gpt2_4M": lambda: gpt2_shapes(vocab=128, ctx=16, d=64, layers=1),
    "single_1M": lambda: [("w", (64, 64))],
}


def make_tensors(shapes: list[tuple], dtype: torch.dtype, std: float, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(shape, generator=gen) * std).to(dtype) for name, shape in shapes}


def bench(shapes: list[tuple], dtype: torch.dtype, specs: list, warmup: int, steps: int, clock) -> list[dict]:
    """Per spec {"update_": times, "update": times}: in place on a params copy, then out of place from the state
    the in-place steps left (nonzero moments), its result discarded. The specs take turns, one step each, so a
    change of load on a shared machine falls on all of them alike."""
    cases = []
    for spec in specs:
        params = make_tensors(shapes, dtype, 0.1, 0)
        cases.append((params, make_tensors(shapes, dtype, 0.01, 1), bnbf.init_state(params, spec, HPARAMS)))
    out = [{"update_": [], "update": []} for _ in specs]
    for call, fn in (("update_", bnbf.update_), ("update", bnbf.update)):
        for i in range(warmup + steps):
            for times, (params, grads, state) in zip(out, cases):
                t0 = clock()
                fn(params, grads, state, HPARAMS, i + 1)
                if i >= warmup:
                    times[call].append(clock() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default=",".join(SETS), help="comma-separated: " + ", ".join(SETS))
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: " + ", ".join(DTYPES))
    ap.add_argument("--formats", default=",".join(STATE_FORMATS), help="8-bit state formats")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per case")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: leave torch's)")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: time.perf_counter; cpu: the process's CPU time (time.process_time), steadier on a machine "
        "shared with other jobs, and equal to wall time with --threads 1 on an idle one",
    )
    ap.add_argument(
        "--codec",
        choices=("native", "torch"),
        default="native",
        help="8-bit states' codec: the native one where it was built (bnbf/csrc/cpu_codec.cpp), or bnbf.quant's "
        "pure-torch oracle",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 1 + 1 steps")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: under it CPU tensors run the Triton interpreter, not the reference")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    sets = SMOKE_SETS if args.smoke else SETS
    warmup, steps = (1, 1) if args.smoke else (args.warmup, args.steps)
    formats = args.formats.split(",")
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    if args.codec == "torch":
        _cpu_codec.NATIVE = None  # the switch bnbf.reference reads at each step
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
        f"AdamW, {warmup} warm-up + {steps} timed steps per case ({args.clock} ms: min / median), "
        f"native CPU codec: {'yes' if _cpu_codec.NATIVE is not None else 'no'}\n"
    )
    print("| set | params | dtype | state | update_ ms | update ms | update_ 8/32 | update 8/32 |")
    print("|---|---|---|---|---|---|---|---|")
    for set_name in args.sets.split(","):
        shapes = sets[set_name]()
        numel = sum(torch.Size(s).numel() for _, s in shapes)
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            labels = ["fp32", *formats]
            specs = [
                bnbf.OptimSpec(rule="adamw", state_bits=32)
                if fmt == "fp32"
                else bnbf.OptimSpec(rule="adamw", state_bits=8, state_format=fmt)
                for fmt in labels
            ]
            base = None
            for fmt, t in zip(labels, bench(shapes, dtype, specs, warmup, steps, clock)):
                mins = {k: min(v) * 1e3 for k, v in t.items()}
                meds = {k: statistics.median(v) * 1e3 for k, v in t.items()}
                if base is None:
                    base = mins, meds
                ratio = {k: f"{mins[k] / base[0][k]:.2f} / {meds[k] / base[1][k]:.2f}" for k in meds}
                state = "32-bit" if fmt == "fp32" else f"8-bit {fmt}"
                print(
                    f"| {set_name} | {numel / 1e6:.2f}M | {dname} | {state} "
                    f"| {mins['update_']:.1f} / {meds['update_']:.1f} | {mins['update']:.1f} / {meds['update']:.1f} "
                    f"| {ratio['update_']} | {ratio['update']} |",
                    flush=True,
                )
    print("\n8/32: 8-bit step time over the 32-bit one (same set, dtype and call), of the minima / of the medians.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
