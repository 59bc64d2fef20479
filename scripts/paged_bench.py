"""Paged optimizer state on one GPU: the step with the state resident, and with GPU memory oversubscribed.

Usage (from the repository root; bitsandbytes' rows need it importable, e.g. ``PYTHONPATH=.peers/site``)::

    python scripts/paged_bench.py                          # both parts, < 120 s on an H200
    python scripts/paged_bench.py --free-gib 2 --state-gib 3.5 --json out.json
    python scripts/paged_bench.py --smoke                  # tiny shapes, part 1 only, also on the CPU

Part 1, no pressure (GPT-2 small and the 1.07B set, fp32 and bf16 params): ``bnbf_nn.PagedAdamW8bit`` against
``bnbf_nn.AdamW8bit``, also with ``bnbf.paged.PREFETCH_HEADROOM`` raised so that every step prefetches, and
bitsandbytes' ``PagedAdamW8bit`` against its ``AdamW8bit``. Reports the median step (CUDA events after a
synchronize, so host time counts), its ratio to the unpaged step, the median host time of a step, the
prefetch calls a step makes, and the GPU's free memory after ``del optimizer`` against before it.

Part 2, oversubscription: bf16 params whose 8-bit AdamW state is about ``--state-gib``; after params and
grads, a filler tensor takes the GPU's free memory but ``--free-gib``, so the state does not fit. Rows:
unpaged ``AdamW8bit`` (expected to run out of memory), ``PagedAdamW8bit`` (the state pages to host: the steps
complete, and the params equal those of an unpaged run without the filler, bit for bit) and bitsandbytes'
``PagedAdamW8bit``; each with its median step, torch's peak allocated bytes (managed memory is not in it),
the GPU memory in use after the steps (the driver's count: filler, params, grads and resident pages) and
the managed bytes bnbf holds.

Prints one JSON line per row, and a markdown table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_step as bs  # noqa: E402

import bnbf  # noqa: E402
import bnbf.paged  # noqa: E402
import bnbf_nn  # noqa: E402

HP = {"lr": 1e-3, "weight_decay": 0.01}
GIB = 1 << 30
BIG_SHAPE = (8192, 16384)  # part 2's tensors: 134M elements, 272 MB of 8-bit AdamW state each


def level(device: torch.device) -> int:
    """Free GPU memory once everything dropped is freed (torch's cached blocks too)."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


class PrefetchCounter:
    """Counts the driver prefetch calls bnbf makes while it is entered."""

    def __init__(self, device: torch.device):
        self.calls, self.drv, self.orig = 0, None, None
        if device.type == "cuda":
            self.drv = bnbf.paged._driver()

    def __enter__(self) -> PrefetchCounter:
        if self.drv is not None:
            self.orig = self.drv.prefetch_all

            def counted(dev: int, ranges: list, stream: int) -> None:
                self.calls += len(ranges)
                self.orig(dev, ranges, stream)

            self.drv.prefetch_all = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.drv is not None:
            del self.drv.prefetch_all  # the bound method of the class again


def leaves_for(shapes: list[tuple], dtype: torch.dtype, device: torch.device, seed: int = 0) -> list:
    params = bs.make_tensors(shapes, dtype, device, 0.1, seed)
    grads = bs.make_tensors(shapes, dtype, device, 0.01, seed + 1)
    out = []
    for k, p in params.items():
        leaf = torch.nn.Parameter(p)
        leaf.grad = grads[k]
        out.append(leaf)
    return out


DEADLINE = [math.inf]  # perf_counter() past which no row times another step (--budget-s)


def time_steps(opt: Any, device: torch.device, warmup: int, steps: int, budget_s: float) -> dict:
    """Median step ms (and host ms) of ``steps`` steps after ``warmup``; stops early past ``budget_s`` (or
    the script's deadline), after at least one timed step."""
    t0 = time.perf_counter()
    budget_s = min(budget_s, DEADLINE[0] - t0)
    for _ in range(warmup):
        opt.step()
    bs.sync(device)
    timer = bs.Timer(device)
    with PrefetchCounter(device) as counter:
        for _ in range(steps):
            timer.time(opt.step)
            if time.perf_counter() - t0 > budget_s:
                break
    ms = timer.results_ms()
    host = timer.host_ms or ms
    return {
        "ms": statistics.median(ms),
        "host_ms": statistics.median(host),
        "timed_steps": len(ms),
        "prefetch_calls_per_step": counter.calls / len(ms),
    }


def bnb_optim() -> Any:
    try:
        import bitsandbytes as bnb

        return bnb.optim
    except Exception as e:  # noqa: BLE001 - a peer that does not import is a note, not a failed run
        return f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------------------------------------------
# part 1: no pressure


def part1_row(args, device, rows, dname: str, shapes: list, name: str, factory: Callable, headroom=None) -> dict:
    """One optimizer's row of part 1 (``headroom``: bnbf.paged.PREFETCH_HEADROOM for this row)."""
    row = {"part": "1 no pressure", "params": dname, "optimizer": name}
    old = bnbf.paged.PREFETCH_HEADROOM
    try:
        free0 = level(device)
        leaves = leaves_for(shapes, bs.DTYPES[dname.split()[-1]], device)
        opt = factory(leaves)
        if headroom is not None:
            bnbf.paged.PREFETCH_HEADROOM = headroom
        row.update(time_steps(opt, device, args.warmup, args.steps, args.row_budget_s))
        del opt, leaves
        if device.type == "cuda":
            row["free_after_del_vs_before_B"] = level(device) - free0
    except Exception as e:  # noqa: BLE001 - a failed row is reported, the others still run
        row["note"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        bnbf.paged.PREFETCH_HEADROOM = old
    emit(rows, row)
    return row


def part1(args: argparse.Namespace, device: torch.device, rows: list[dict]) -> None:
    for set_name in args.sets.split(","):
        shapes = (bs.SMOKE_SETS if args.smoke else bs.SETS)[set_name]()
        part1_set(args, device, rows, set_name, shapes)


def part1_set(args: argparse.Namespace, device: torch.device, rows: list[dict], set_name: str, shapes: list) -> None:
    bnb = bnb_optim()
    for dtype_name in args.dtypes.split(","):
        dname = f"{set_name} {dtype_name}"
        # a paged warm-up first: the driver keeps a few MiB for Unified Memory after a process's first
        # managed allocation (tests/test_paged.py), which would show as memory the first paged row kept
        if device.type == "cuda":
            warm = leaves_for(shapes[:3], bs.DTYPES[dname.split()[-1]], device)
            bnbf_nn.PagedAdamW8bit(warm, **HP).step()
            del warm
        base = part1_row(args, device, rows, dname, shapes, "bnbf_nn AdamW8bit", lambda ps: bnbf_nn.AdamW8bit(ps, **HP))
        for name, headroom in (
            ("bnbf_nn PagedAdamW8bit", None),
            ("bnbf_nn PagedAdamW8bit, prefetch every step", 1 << 62),
        ):
            paged = lambda ps: bnbf_nn.PagedAdamW8bit(ps, **HP)  # noqa: E731
            row = part1_row(args, device, rows, dname, shapes, name, paged, headroom)
            if "ms" in row and "ms" in base:
                row["vs_unpaged"] = row["ms"] / base["ms"]
        if isinstance(bnb, str):
            emit(rows, {"part": "1 no pressure", "params": dname, "optimizer": "bitsandbytes", "note": bnb})
        elif device.type == "cuda":
            b_base = part1_row(
                args, device, rows, dname, shapes, "bitsandbytes AdamW8bit", lambda ps: bnb.AdamW8bit(ps, **HP)
            )
            b_paged = lambda ps: bnb.PagedAdamW8bit(ps, **HP)  # noqa: E731
            row = part1_row(args, device, rows, dname, shapes, "bitsandbytes PagedAdamW8bit", b_paged)
            if "ms" in row and "ms" in b_base:
                row["vs_unpaged"] = row["ms"] / b_base["ms"]


# ---------------------------------------------------------------------------------------------------------
# part 2: oversubscription


def part2(args: argparse.Namespace, device: torch.device, rows: list[dict]) -> None:
    per_tensor = _state_bytes(BIG_SHAPE)
    count = max(1, math.ceil(args.state_gib * GIB / per_tensor))
    shapes = [(f"w{i}", BIG_SHAPE) for i in range(count)]
    state = count * per_tensor
    common = {"part": "2 oversubscribed", "params": f"bf16, {count} x {BIG_SHAPE[0]}x{BIG_SHAPE[1]}"}
    steps = args.warmup2 + args.steps2

    # the reference: unpaged, no filler (the same kernels: paged params must equal these bit for bit)
    leaves = leaves_for(shapes, torch.bfloat16, device)
    opt = bnbf_nn.AdamW8bit(leaves, **HP)
    for _ in range(steps):
        opt.step()
    reference = [p.detach().cpu() for p in leaves]
    del opt, leaves
    level(device)

    leaves = leaves_for(shapes, torch.bfloat16, device)
    free = level(device)
    filler = torch.empty(max(0, free - int(args.free_gib * GIB)), dtype=torch.uint8, device=device)
    left = level(device)
    note0 = f"state {state / GIB:.2f} GiB, {left / GIB:.2f} GiB free after params, grads and filler"

    def one(name: str, factory: Callable[[list], Any], leaves: list, check: bool = False) -> None:
        row = {**common, "optimizer": name, "state_GiB": state / GIB, "free_GiB": left / GIB}
        opt = None
        try:
            with torch.no_grad():  # a fresh start: the same params as the reference's
                for p, r in zip(leaves, fresh_params):
                    p.copy_(r)
            torch.cuda.reset_peak_memory_stats(device)
            live0 = bnbf.paged.live_bytes()
            opt = factory(leaves)
            row.update(time_steps(opt, device, args.warmup2, args.steps2, args.row_budget_s))
            bs.sync(device)
            row["completed"] = True
            row["peak_torch_GiB"] = torch.cuda.max_memory_allocated(device) / GIB
            free_now, total = torch.cuda.mem_get_info(device)
            row["gpu_used_GiB"] = (total - free_now) / GIB
            row["managed_GiB"] = (bnbf.paged.live_bytes() - live0) / GIB
            if check:
                ran = args.warmup2 + row["timed_steps"]
                if ran == steps:
                    same = all(torch.equal(p.detach().cpu(), r) for p, r in zip(leaves, reference))
                    row["equal_to_unpaged"] = same
                else:
                    row["note"] = f"stopped after {ran} of {steps} steps (budget): not compared"
        except torch.OutOfMemoryError as e:
            row["completed"] = False
            row["note"] = f"out of memory: {str(e).splitlines()[0][:120]}"
        except Exception as e:  # noqa: BLE001 - a failed row is reported, the others still run
            row["completed"] = False
            row["note"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        row["note"] = "; ".join(x for x in (note0, row.get("note")) if x)
        opt = None  # its state (a failed row's too) freed before the next row measures
        gc.collect()
        torch.cuda.empty_cache()
        emit(rows, row)

    fresh_params = [p.detach().clone().cpu() for p in leaves]
    one("bnbf_nn AdamW8bit (unpaged)", lambda ps: bnbf_nn.AdamW8bit(ps, **HP), leaves)
    one("bnbf_nn PagedAdamW8bit", lambda ps: bnbf_nn.PagedAdamW8bit(ps, **HP), leaves, check=True)
    bnb = bnb_optim()
    if isinstance(bnb, str):
        emit(rows, {**common, "optimizer": "bitsandbytes PagedAdamW8bit", "note": bnb})
    else:  # last: bitsandbytes' paged buffers are never freed
        one("bitsandbytes PagedAdamW8bit", lambda ps: bnb.PagedAdamW8bit(ps, **HP), leaves)
    del filler, leaves


def _state_bytes(shape: tuple) -> int:
    """8-bit AdamW state of one tensor: two uint8 moments and two float32 scales per 256 elements."""
    n = math.prod(shape)
    return 2 * n + 2 * 4 * math.ceil(n / 256)


# ---------------------------------------------------------------------------------------------------------
# output


COLUMNS = [
    ("part", "part"),
    ("params", "params"),
    ("optimizer", "optimizer"),
    ("ms", "median step ms"),
    ("vs_unpaged", "vs unpaged"),
    ("host_ms", "host ms"),
    ("prefetch_calls_per_step", "prefetch calls/step"),
    ("completed", "completed"),
    ("equal_to_unpaged", "= unpaged"),
    ("peak_torch_GiB", "torch peak GiB"),
    ("gpu_used_GiB", "GPU used GiB"),
    ("managed_GiB", "bnbf managed GiB"),
    ("free_after_del_vs_before_B", "free after del - before (B)"),
    ("note", "note"),
]


def emit(rows: list[dict], row: dict) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def markdown(rows: list[dict], meta: dict) -> str:
    head = f"{meta['device']}, torch {meta['torch']}, bitsandbytes {meta['bnb']}, {meta['seconds']:.0f} s"
    lines = [f"Paged optimizer benchmark: {head}", ""]
    lines.append("| " + " | ".join(h for _, h in COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(k)) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="1,2", help="which parts: 1 (no pressure), 2 (oversubscribed)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="part 1's param dtypes")
    ap.add_argument("--sets", default="gpt2_124M,big_1B", help="part 1's sets (benchmarks/bench_step.py)")
    ap.add_argument("--warmup", type=int, default=5, help="part 1's warm-up steps")
    ap.add_argument("--steps", type=int, default=50, help="part 1's timed steps")
    ap.add_argument("--state-gib", type=float, default=3.5, help="part 2: the 8-bit state's size")
    ap.add_argument("--free-gib", type=float, default=2.0, help="part 2: GPU memory the filler leaves free")
    ap.add_argument("--warmup2", type=int, default=1, help="part 2's warm-up steps")
    ap.add_argument("--steps2", type=int, default=3, help="part 2's timed steps")
    ap.add_argument("--row-budget-s", type=float, default=25.0, help="a row stops timing past this")
    ap.add_argument("--budget-s", type=float, default=100.0, help="no row times a step past this many seconds")
    ap.add_argument("--json", help="write the rows and the machine here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, part 1 only (runs on the CPU too)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("paged_bench.py needs CUDA (managed memory); --smoke runs part 1 on the CPU", file=sys.stderr)
        return 2
    bnb = bnb_optim()
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "bnb": "not importable" if isinstance(bnb, str) else getattr(sys.modules["bitsandbytes"], "__version__", "?"),
        "argv": sys.argv[1:],
    }
    rows: list[dict] = []
    t0 = time.perf_counter()
    DEADLINE[0] = t0 + args.budget_s
    parts = args.parts.split(",")
    # part 2 first: part 1's bitsandbytes paged rows leave managed buffers (never freed) resident, which the
    # driver evicts to make room for later allocations, so part 2's filler would leave more room than it says
    # (an H200 run after part 1 saw the unpaged row fit)
    if "2" in parts and not args.smoke:
        part2(args, device, rows)
    if "1" in parts:
        part1(args, device, rows)
    meta["seconds"] = time.perf_counter() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
