"""`benchmarks/quality.py --smoke` runs in-process on the CPU and its table has every expected row, finite.

The plain pass runs the default rules, variants and reruns through the pure-torch reference. Under
TRITON_INTERPRET=1 every step runs the Triton kernels in the interpreter (about a second per step even for
this tiny model), so that pass takes one rule, the spike variant only, no rerun and two steps.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest
from conftest import triton_mode

ROOT = Path(__file__).resolve().parents[1]


def _load_quality():
    spec = importlib.util.spec_from_file_location("bnbf_bench_quality", ROOT / "benchmarks" / "quality.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def test_quality_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    quality = _load_quality()
    argv = ["--smoke", "--json", str(tmp_path / "q.json"), "--markdown", str(tmp_path / "q.md")]
    if triton_mode():
        rules, variants, reruns, steps = ["adamw"], ["spikes"], 0, 2
        argv += ["--rules", "adamw", "--spikes", "only", "--reruns", "0", "--steps", "2"]
    else:  # the defaults
        rules, variants, reruns, steps = quality.DEFAULT_RULES.split(","), ["plain", "spikes"], 1, 8
    rows = quality.main(argv)
    out = capsys.readouterr().out

    group = [("32", 0), ("power", 0), ("dynamic", 0)] + [("32", k) for k in range(1, reruns + 1)]
    want = [(r, v, f, k) for r in rules for v in variants for f, k in group]
    assert [(r.rule, r.variant, r.format, r.rerun) for r in rows] == want
    for r in rows:
        assert r.finite, r
        for value in (r.held_out_loss, r.train_loss, r.max_step_lr, r.steps_per_s):
            assert math.isfinite(value) and value > 0, r
        assert 1 <= r.max_step_at <= steps
        # from random weights over 256 byte values: near log(256) = 5.55, and training has not blown up
        assert 3.0 < r.held_out_loss < 7.0, r
        assert (r.rel_vs_32 is None) == (r.format == "32" and not r.rerun)
        if r.rel_vs_32 is not None:
            assert abs(r.rel_vs_32) < 0.1, r

    # the markdown table is printed last, one line per row, and the markdown file holds the same table
    assert out.startswith("GPU: ")
    table = out.strip().split("\n\n")[-1].splitlines()
    assert table[0].startswith("| rule | variant | state | held-out loss | vs 32-bit |")
    body = table[2:]
    assert len(body) == len(want)
    for line, (rule, variant, fmt, rerun) in zip(body, want):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0].split()[0] == rule and cells[1] == variant
        assert cells[2] == ("32-bit rerun" if rerun else "32-bit" if fmt == "32" else f"8-bit {fmt}")
        assert re.fullmatch(r"\d+\.\d{4}", cells[3]), line  # held-out loss
        if fmt == "32" and not rerun:
            assert cells[4] == "—", line
        else:
            assert re.fullmatch(r"[+-]\d+\.\d\d%", cells[4]), line
        assert cells[5] == ("yes" if fmt != "32" else "—"), line  # tiny runs: far within 1%
    md = (tmp_path / "q.md").read_text()
    assert md.rstrip().endswith("\n".join(table))
    data = json.loads((tmp_path / "q.json").read_text())
    assert len(data["rows"]) == len(want) and data["meta"]["smoke"] is True
    if reruns:
        assert "Noise: a 32-bit rerun" in out and data["meta"]["noise"]
    if "lamb" in rules:
        assert "lamb †" in "\n".join(body)  # the trust-ratio note marks LAMB's rows
