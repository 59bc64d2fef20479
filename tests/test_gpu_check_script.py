"""scripts/gpu_check.sh's budgets: the GPU run's steps after the tests take what is left of the call, so that a long
suite cannot push the call past the device's limit. Run with a stand-in interpreter that answers at once (pytest's
summary line, a benchmark that writes its json), so only the script's own control flow runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# every Python call of the script: pytest prints a summary, a benchmark writes the --json file it is given
STAND_IN = """#!/usr/bin/env bash
case "$*" in
  *"-m pytest"*) echo "3 passed, 1 skipped in 0.1s" ;;
  *bench_step.py*|*quality.py*)
    echo "ran $1"
    while [ $# -gt 0 ]; do [ "$1" = --json ] && echo '{}' > "$2"; shift; done ;;
esac
exit 0
"""

KNOBS = {
    "BIG_BUDGET_S", "TEST_BUDGET_S", "TEST_WORKERS", "BENCH_BUDGET_S", "RULES_BUDGET_S", "QUALITY_BUDGET_S",
    "QUALITY_ARGS", "CALL_BUDGET_S", "PROFILE_BUDGET_S", "PYTEST_ARGS", "BENCH_ARGS", "RULES_CANDIDATES",
}  # fmt: skip

pytestmark = pytest.mark.skipif(
    sys.platform == "win32" or shutil.which("bash") is None or shutil.which("timeout") is None,
    reason="needs bash and coreutils' timeout",
)


def _run(tmp_path, script: str = STAND_IN, **env) -> subprocess.CompletedProcess:
    stand_in = tmp_path / "python"
    stand_in.write_text(script)
    stand_in.chmod(0o755)
    # the knobs of a gpu_check.sh run this suite may itself be part of stay out: the defaults are under test
    mine = {k: v for k, v in os.environ.items() if k not in KNOBS}
    full = {**mine, "PYTHON": str(stand_in), "OUT": str(tmp_path / "out"), "PROFILE_BUDGET_S": "0", **env}
    return subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_step_runs_within_a_whole_call(tmp_path):
    run = _run(tmp_path, CALL_BUDGET_S="590")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "== benchmark (budget 100 s; 100 s left for it in this call)" in run.stdout
    assert "== every rule on big_1B (budget 60 s; 60 s left for it in this call)" in run.stdout
    assert "ran benchmarks/bench_step.py" in run.stdout
    assert "| PASS | 6 | 0 | 0 | 2 |" in run.stdout  # both pytest runs' summary lines, summed


def test_steps_after_the_tests_take_only_what_is_left_of_the_call(tmp_path):
    run = _run(tmp_path, CALL_BUDGET_S="50")
    assert run.returncode == 0, run.stdout + run.stderr

    def left(step: str) -> int:  # "== STEP (budget B s; L s left for it in this call)"
        line = next(x for x in run.stdout.splitlines() if x.startswith(f"== {step}"))
        return int(line.split("; ")[1].split()[0])

    # 50 s of call, a moment gone: the benchmark (100 s) and the rules (60 s) each capped to what is left
    assert 30 <= left("benchmark") <= 50
    assert left("every rule") <= left("benchmark")
    assert "ran benchmarks/bench_step.py" in run.stdout


def test_a_call_with_no_time_left_skips_the_benchmarks_without_failing(tmp_path):
    run = _run(tmp_path, CALL_BUDGET_S="20")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "benchmark skipped:" in run.stdout
    assert "quality skipped:" in run.stdout
    assert "ran benchmarks/bench_step.py" not in run.stdout
    assert "benchmark: rc skipped" in run.stdout


def test_a_benchmark_that_ran_and_wrote_nothing_fails_the_run(tmp_path):
    run = _run(tmp_path, STAND_IN.replace("echo '{}' > \"$2\"", ":"), CALL_BUDGET_S="590")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "no benchmark table" in run.stdout
