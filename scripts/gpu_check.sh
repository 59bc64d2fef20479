#!/usr/bin/env bash
# One call on the GPU machine: versions, the whole test suite (slow and GPU tests included), the step
# benchmark, then the training-quality benchmark. The device tool allows 600 s per call; the LAST thing printed
# is a summary (test counts + benchmark and quality tables).
#
#   device run, carry [".peers"], command:  bash scripts/gpu_check.sh
#
# Budgets: the build (about 60 s) + 45 (big-memory tests) + 400 (tests) + 100 (benchmark) + 60 (rules) + 150
# (quality) + 2 x 25 (profile), more than the call: each step after the tests gets at most what is left of
# CALL_BUDGET_S (590) less the profile's 50 s, and is skipped under 30 s. The suite outgrew a call shared with the
# benchmarks: on 2026-12-07 (H100, 14 workers) 4707 of its tests had passed or skipped when its 312 s budget cut
# it. For the whole suite, a call of its own; for the whole quality table, too:
# python benchmarks/quality.py --json $OUT/quality.json --markdown $OUT/quality.md
#
# Logs and results go to $OUT (else .gpu_check in the repository, ignored by git): tests.log, bench.log, bench.json, bench.md, rules.*,
# quality.log, quality.json, quality.md, profile.log. Exits non-zero if the tests failed (or timed out) or the
# benchmark ran and produced nothing; the benchmarks run even when the tests fail. Knobs (environment):
# BIG_BUDGET_S (default 45), TEST_BUDGET_S (400), TEST_WORKERS (14), BNBF_TEST_DEVICES (cuda), BENCH_BUDGET_S
# (100; 0 skips it), RULES_BUDGET_S (60; 0 skips it), QUALITY_BUDGET_S (150), QUALITY_ARGS,
# CALL_BUDGET_S (590), PROFILE_BUDGET_S (25 per script), PYTEST_ARGS, BENCH_ARGS (default "--quick --steps 20
# --warmup 5": the anchors' step counts, without torchao), RULES_CANDIDATES (bnbf8).
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-.gpu_check}
mkdir -p "$OUT"
if [ -d .peers/site ]; then
  export PYTHONPATH="$PWD/.peers/site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "note: .peers/site not found (carry .peers): peer tests and peer benchmarks will be skipped"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
t0=$(date +%s)

echo "== machine"
nvidia-smi -L 2>&1 || echo "nvidia-smi failed"
$PY - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE")
try:
    import triton; print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
EOF

# the C++ host checks, as `pip install --no-build-isolation` builds them (against this machine's torch; a .so
# built elsewhere is not carried: .gitignore); on failure the plain-Python twins serve
tb=$(date +%s)
$PY setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || tail -5 "$OUT/build.log"
$PY -c "import bnbf._host_checks as h; print('host checks:', 'native' if h.NATIVE else 'python')"
echo "build: $(( $(date +%s) - tb )) s"

echo "== tests (budget ${BIG_BUDGET_S:-45} s for the big-memory tests alone, ${TEST_BUDGET_S:-400} s for the rest)"
timeout_arg=()
$PY -c "import pytest_timeout" 2>/dev/null && timeout_arg=(--timeout 120)
export BNBF_TEST_DEVICES=${BNBF_TEST_DEVICES:-cuda}
# tests that need tens of GB of GPU memory (>2**31-element tensors) run alone: beside 14 workers that each
# hold cached blocks they once ran out of memory
timeout -s INT -k 10 "${BIG_BUDGET_S:-45}" \
  $PY -m pytest tests -q -rfE -m "big_memory or alone" -p no:cacheprovider "${timeout_arg[@]}" 2>&1 | tee "$OUT/tests.log"
big_rc=$?
# the GPU machine has pytest-xdist and 16 cores: Triton compiles in parallel workers; CPU-device tests are
# CI's job, so only the cuda parametrizations run here unless BNBF_TEST_DEVICES says otherwise
$PY -c "import xdist" 2>/dev/null && timeout_arg+=(-n "${TEST_WORKERS:-14}")
# -x-style: stop after a few failures so a broken kernel cannot eat the call; SIGINT at the budget makes
# pytest print its summary before it exits
timeout -s INT -k 20 "${TEST_BUDGET_S:-400}" \
  $PY -m pytest tests -q --maxfail=5 -rfE -m "(slow or not slow) and not big_memory and not alone" -p no:cacheprovider \
  "${timeout_arg[@]}" ${PYTEST_ARGS:-} 2>&1 | tee -a "$OUT/tests.log"
test_rc=$?
case $big_rc in 0|5) ;; *) [ "$test_rc" -eq 0 ] && test_rc=$big_rc ;; esac  # 5: none collected
t1=$(date +%s)

# what is left of the call for a step after the tests: its budget ($1) at most, less the profile's reserve
capped() {
  local left=$(( ${CALL_BUDGET_S:-590} - ($(date +%s) - t0) - 2 * ${PROFILE_BUDGET_S:-25} ))
  [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}

bench_budget=$(capped "${BENCH_BUDGET_S:-100}")
echo "== benchmark (budget ${BENCH_BUDGET_S:-100} s; $bench_budget s left for it in this call)"
rm -f "$OUT/bench.json" "$OUT/bench.md"
bench_rc=0
if [ "${BENCH_BUDGET_S:-100}" -gt 0 ]; then  # 0 skips it, as for the rules below
  if [ "$bench_budget" -ge 30 ]; then
    timeout -s INT -k 20 "$bench_budget" \
      $PY benchmarks/bench_step.py ${BENCH_ARGS:---quick --steps 20 --warmup 5} --json "$OUT/bench.json" \
      --markdown "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log"
    bench_rc=$?
  else
    bench_rc="skipped"
    echo "benchmark skipped: $bench_budget s left in the call"
  fi
fi

rules_budget=$(capped "${RULES_BUDGET_S:-60}")
echo "== every rule on big_1B (budget ${RULES_BUDGET_S:-60} s; $rules_budget s left for it in this call)"
# a budget of 0 skips it: `timeout 0` would mean no limit at all
if [ "${RULES_BUDGET_S:-60}" -gt 0 ] && [ "$rules_budget" -ge 30 ]; then
  timeout -s INT -k 20 "$rules_budget" \
    $PY benchmarks/bench_step.py --quick --rules all --sets big_1B --candidates ${RULES_CANDIDATES:-bnbf8} \
    --json "$OUT/rules.json" --markdown "$OUT/rules.md" > "$OUT/rules.log" 2>&1
  echo "rules benchmark rc $?"
fi

# training quality, 8-bit vs 32-bit state (benchmarks/quality.py); capped by what is left of the call
quality_budget=$(capped "${QUALITY_BUDGET_S:-150}")
echo "== quality (budget ${QUALITY_BUDGET_S:-150} s; $quality_budget s left for it in this call)"
rm -f "$OUT/quality.json" "$OUT/quality.md" "$OUT/quality.log"
tq=$(date +%s)
if [ "$quality_budget" -ge 30 ]; then
  # SIGINT at the budget: the script writes the rows it finished and prints its table
  timeout -s INT -k 20 "$quality_budget" \
    $PY benchmarks/quality.py --json "$OUT/quality.json" --markdown "$OUT/quality.md" ${QUALITY_ARGS:-} \
    > "$OUT/quality.log" 2>&1
  quality_rc=$?
else
  quality_rc="skipped"
  echo "quality skipped: $quality_budget s left in the call (run benchmarks/quality.py in a call of its own)"
fi
quality_s=$(( $(date +%s) - tq ))
echo "quality benchmark rc $quality_rc, $quality_s s"
echo "== host and kernel time per step"
if [ "${PROFILE_BUDGET_S:-25}" -gt 0 ]; then  # 0 skips (`timeout 0` is no limit)
  timeout -s INT -k 10 "${PROFILE_BUDGET_S:-25}" $PY scripts/profile_step.py 2>&1 | grep -v -i warn | tee "$OUT/profile.log"
  timeout -s INT -k 10 "${PROFILE_BUDGET_S:-25}" $PY scripts/host_breakdown.py 2>&1 | grep -v -i warn | tee -a "$OUT/profile.log"
fi
t2=$(date +%s)

# ---- summary: the last thing printed
# both pytest runs' summary lines, summed
summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|errors|skipped|deselected|xfailed|xpassed)' "$OUT/tests.log")
count() { echo "$summary" | grep -oE "[0-9]+ $1" | grep -oE '^[0-9]+' | awk '{n += $1} END {print n + 0}'; }
case $test_rc in
  0) test_status=PASS ;;
  124|137) test_status="TIMED OUT after ${TEST_BUDGET_S:-400} s" ;;
  5) test_status="NO TESTS COLLECTED" ;;
  *) test_status="FAIL (pytest rc $test_rc)" ;;
esac
echo
echo "================================ SUMMARY ================================"
echo "| tests | passed | failed | errors | skipped | time |"
echo "|---|---|---|---|---|---|"
echo "| $test_status | $(count passed) | $(count failed) | $(count 'errors?') | $(count skipped) | $((t1 - t0)) s |"
grep -E '^(FAILED|ERROR) ' "$OUT/tests.log" | head -10
echo
echo "benchmark: rc $bench_rc, $((t2 - t1)) s; total $((t2 - t0)) s; files in $OUT"
if [ -s "$OUT/bench.md" ]; then
  # the compact table (everything before the long per-row table), then the notes
  awk '/^\| set \| params \| rule \| candidate \|/{skip=1} /^Notes:/{skip=0} !skip' "$OUT/bench.md"
else
  echo "no benchmark table (see $OUT/bench.log)"
  [ -f "$OUT/bench.log" ] && tail -5 "$OUT/bench.log"
fi
[ -s "$OUT/rules.md" ] && grep -E '^\| big_1B' "$OUT/rules.md" | tail -n 18
echo
echo "quality: rc $quality_rc, $quality_s s (budget $quality_budget s)"
if [ -s "$OUT/quality.md" ]; then
  # the noise floor, any interruption note, then the table (one row per rule, variant and state)
  grep -E '^(Noise: |interrupted|\|)' "$OUT/quality.md"
else
  echo "no quality table (see $OUT/quality.log)"
  [ -f "$OUT/quality.log" ] && tail -5 "$OUT/quality.log"
fi
[ "$test_rc" -eq 0 ] && { [ "$bench_rc" = skipped ] || [ "${BENCH_BUDGET_S:-100}" -eq 0 ] || [ -s "$OUT/bench.json" ]; } || exit 1
