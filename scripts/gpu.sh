#!/usr/bin/env bash
# The body of `make gpu`, run in the repository root on a machine with a CUDA GPU:
#   1. print the machine (nvidia-smi) and the versions;
#   2. the test suite on the GPU: python -m pytest -m "not slow" tests, i.e. every kernel and
#      graded test on CUDA (bf16 added) plus the gpu-marked large shapes (their status is
#      reported, and does not stop the benchmarks);
#   3. the benchmarks: python -m bench.run (ceilings, every registered benchmark, including the
#      ncu traffic measurement, bench/ch01_traffic.py), saved to bench/results/<gpu-slug>.{json,md};
#   4. if $OUT is set, copy the logs, ncu's raw output and the updated result files there.
# Exits non-zero if the tests failed (after the benchmarks ran) or the benchmarks failed.
#
# The repository need not be installed: it runs with PYTHONPATH=<repo>. Environment:
#   PYTHON          interpreter (default python3)
#   OUT             folder for logs and copies of the results (optional)
#   TEST_TIMEOUT    seconds for the GPU tests (default 300)
#   TEST_PATHS      what pytest collects (default "tests"; e.g. "tests/test_ch07_flash_decoding_kernels.py")
#   TEST_MARKS      pytest's -m expression (default "not slow"; "gpu" runs only the GPU-marked tests,
#                   e.g. Chapter 13's two-GPU comparisons without its CPU (gloo) tests first)
#   TEST_JOBS       pytest processes run side by side (default 1). The GPU tests spend most
#                   of their time compiling kernels on the CPU, so on a many-core host 4
#                   processes (test files dealt round-robin) finish several times sooner
#   SKIP_TESTS      1: benchmarks only
#   BENCH_ONLY      space-separated benchmark names or prefixes (default: all), e.g. "ch02"
#   BENCH_TIMEOUT   seconds for bench.run (default 360; on timeout the results measured so far
#                   are saved, marked "partial")
#   MINILLM_CH01_BUDGET_S, MINILLM_NCU_TIMEOUT_S   limits inside the benchmarks (300, 150)
#   MINILLM_CH09_REQUESTS, MINILLM_CH09_ONLINE_REQUESTS   the engine benchmark's workload sizes
#                   (128, 96; about 150 s on an H200, a third of it the transformers peer). It
#                   also writes $OUT/<gpu-slug>.ch09_timeline.json (steps and batches, for the
#                   chapter's timeline plot)
set -u

cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export MINILLM_CH01_BUDGET_S=${MINILLM_CH01_BUDGET_S:-300}
export MINILLM_NCU_TIMEOUT_S=${MINILLM_NCU_TIMEOUT_S:-150}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-360}

if [ -n "${OUT:-}" ]; then
    LOG="$OUT"
    mkdir -p "$LOG"
else
    LOG=$(mktemp -d /tmp/minillm-gpu.XXXXXX)
fi
export MINILLM_ARTIFACTS="$LOG"   # bench/ch01_traffic.py copies ncu's raw CSV here
STAMP=$(mktemp /tmp/minillm-gpu-stamp.XXXXXX)
start=$(date +%s)

echo "== machine ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
nvidia-smi || echo "nvidia-smi failed (rc $?)"
"$PY" - <<'EOF' || echo "could not import torch/triton"
import platform, torch, triton
print(f"python {platform.python_version()}  torch {torch.__version__}  CUDA {torch.version.cuda}  "
      f"triton {triton.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device {torch.cuda.get_device_name(0)}: {p.multi_processor_count} SMs, "
          f"{p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
else:
    print("torch sees no CUDA device")
EOF
NCU_BIN=${NCU:-$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | tail -n 1)}
if [ -n "$NCU_BIN" ]; then
    echo "ncu: $NCU_BIN ($("$NCU_BIN" --version 2>&1 | tail -n 1))"
    export NCU="$NCU_BIN"
else
    echo "ncu: not found (the traffic benchmark will record nothing)"
fi

echo
TEST_PATHS=${TEST_PATHS:-tests}
TEST_JOBS=${TEST_JOBS:-1}
TEST_MARKS=${TEST_MARKS:-not slow}
echo "== GPU tests: $PY -m pytest -m '$TEST_MARKS' $TEST_PATHS -q, $TEST_JOBS process(es) (timeout ${TEST_TIMEOUT}s)"
if [ "${SKIP_TESTS:-0}" = 1 ]; then
    echo "(skipped: SKIP_TESTS=1)"
    test_rc=0
elif [ "$TEST_JOBS" -le 1 ]; then
    # shellcheck disable=SC2086  # TEST_PATHS is a list of paths
    timeout -k 10 "$TEST_TIMEOUT" "$PY" -m pytest -m "$TEST_MARKS" $TEST_PATHS -q -p no:cacheprovider 2>&1 \
        | tee "$LOG/pytest_gpu.log"
    test_rc=${PIPESTATUS[0]}
else
    # Deal the test files round-robin to TEST_JOBS processes; each writes its own log.
    # shellcheck disable=SC2086
    mapfile -t files < <(find $TEST_PATHS -name 'test_*.py' | sort)
    pids=()
    for ((j = 0; j < TEST_JOBS; j++)); do
        group=()
        for ((i = j; i < ${#files[@]}; i += TEST_JOBS)); do group+=("${files[i]}"); done
        [ ${#group[@]} -gt 0 ] || continue
        timeout -k 10 "$TEST_TIMEOUT" "$PY" -m pytest -m "$TEST_MARKS" "${group[@]}" -q -p no:cacheprovider \
            > "$LOG/pytest_gpu.$j.log" 2>&1 &
        pids+=($!)
    done
    test_rc=0
    for pid in "${pids[@]}"; do
        wait "$pid"; rc=$?
        # 5 (nothing collected) is fine for one group; keep the worst other code.
        if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then test_rc=$rc; fi
    done
    for log in "$LOG"/pytest_gpu.*.log; do echo "-- $log"; tail -n 15 "$log"; done | tee "$LOG/pytest_gpu.log"
fi
case $test_rc in
    0) test_msg="passed" ;;
    5) test_msg="no GPU tests collected (pytest exit 5), not counted as a failure"; test_rc=0 ;;
    124|137) test_msg="TIMED OUT after ${TEST_TIMEOUT}s" ;;
    *) test_msg="FAILED (pytest exit $test_rc)" ;;
esac
echo "== GPU tests: $test_msg"

echo
ONLY_ARGS=()
for name in ${BENCH_ONLY:-}; do ONLY_ARGS+=(--only "$name"); done
echo "== benchmarks: $PY -m bench.run ${ONLY_ARGS[*]} (timeout ${BENCH_TIMEOUT}s)"
timeout -s TERM -k 30 "$BENCH_TIMEOUT" "$PY" -m bench.run "${ONLY_ARGS[@]}" 2>&1 | tee "$LOG/bench.log"
bench_rc=${PIPESTATUS[0]}
case $bench_rc in
    0) bench_msg="done" ;;
    124|130|137) bench_msg="TIMED OUT or interrupted (exit $bench_rc); rows measured so far were saved as partial" ;;
    *) bench_msg="FAILED (exit $bench_rc)" ;;
esac
echo "== benchmarks: $bench_msg"

# Copy the result files this run wrote (at most the JSON and markdown of this GPU).
if [ -n "${OUT:-}" ]; then
    find bench/results -maxdepth 1 -type f \( -name '*.json' -o -name '*.md' \) -newer "$STAMP" \
        -exec cp {} "$OUT/" \; 2>/dev/null
    echo
    echo "== files in \$OUT:"
    ls -l "$OUT"
else
    echo "logs in $LOG"
fi
rm -f "$STAMP"

echo
echo "== summary: tests $test_msg; benchmarks $bench_msg; $(( $(date +%s) - start )) s in all"
[ "$test_rc" -eq 0 ] || exit 1
[ "$bench_rc" -eq 0 ] || exit 3
exit 0
