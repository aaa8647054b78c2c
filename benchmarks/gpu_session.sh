#!/bin/bash
# A full pass on a machine with GPUs: builds the extension, runs the GPU tests,
# the example on GPUs and the benchmark, and leaves the logs in $OUT. Run from
# the repository root on a machine set up as docs/gpu-testing.md ("The
# machine") says: two or more GPUs, the NVIDIA wheels, NVLink multicast off.
# Knobs: EXAMPLE_ARGS, TESTS_TIMEOUT, JOB_TIMEOUT, HANG_DUMP, CALL_TIMEOUT,
# CHECKS, FAILURES_K, STRESS_RUNS, STRESS_VARIANTS, BENCH_BUDGET, BENCH_ARGS (see
# each step), NGPU (processes of the one-process-per-GPU jobs; default every GPU
# of the machine).
# Usage: benchmarks/gpu_session.sh [build] [checks] [tests] [failures] [stress] [schedule] [example] [bench] [bench-quick]
set -uo pipefail
: "${OUT:?set OUT to the folder for the logs}"
steps=${*:-build tests example bench}
# One process per GPU of the machine (tensor parallelism over all), or NGPU.
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c "^GPU ")}
export JCG_GPU_PROCESSES=$NGPU  # the pytest suite's process-per-GPU job too
ranks() { seq 0 $((NGPU - 1)); }
has() { [[ " $steps " == *" $1 "* ]]; }
summary=()

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)"
  python3 -c "import nvidia.cublasmp, os; print('cublasmp wheel', os.path.dirname(nvidia.cublasmp.__path__[0]))"
  echo "processes per process-per-GPU job: $NGPU"
} > "$OUT/machine.txt" 2>&1

if has build; then
  start=$SECONDS
  if python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/build.log 2>&1; then
    summary+=("build: ok ($((SECONDS - start)) s)")
  else
    cp /tmp/build.log "$OUT/build.log"
    tail -40 /tmp/build.log
    echo "build: FAILED"
    exit 1
  fi
fi

if has checks; then
  # Chosen checks (CHECKS, comma separated names of tests/gpu/checks.py) in one
  # process driving both GPUs, then one process per GPU: quicker than `tests`.
  start=$SECONDS
  : > "$OUT/checks.log"
  JCG_HANG_DUMP_S=150 timeout 170 python3 tests/gpu/worker.py --checks "$CHECKS" \
    > /tmp/checks_single.log 2>&1
  echo "single process: rc=$?" >> "$OUT/checks.log"
  rm -f /tmp/checks_p*.log
  for i in $(ranks); do
    JCG_HANG_DUMP_S=150 timeout 170 python3 tests/gpu/worker.py --checks "$CHECKS" \
      --process-id $i --num-processes $NGPU --port 12421 > /tmp/checks_p$i.log 2>&1 &
  done
  wait
  for f in /tmp/checks_single.log /tmp/checks_p*.log; do
    { echo "===== $(basename "$f")"; grep -v -E "^[IW][0-9]{4} " "$f"; } >> "$OUT/checks.log"
  done
  grep -h "^\[process" /tmp/checks_single.log /tmp/checks_p*.log | tail -40
  summary+=("checks: $(cat /tmp/checks_*.log | grep -c ': ok (') ok, $(cat /tmp/checks_*.log | grep -c ': FAILED') failed ($((SECONDS - start)) s)")
fi

if has tests; then
  start=$SECONDS
  # A call deadline well inside the hang dump: should a call of ours get stuck
  # (on the host or the GPU), the watchdog says so before the dump ends the
  # workers. The dump limits a whole worker, whose checks take a few minutes
  # on 2x H200 (docs/gpu-testing.md): raise HANG_DUMP and JOB_TIMEOUT together
  # on a slower machine.
  JCG_GPU_LOG_DIR=/tmp/jcg_gpu_logs JCG_GPU_JOB_TIMEOUT_S=${JOB_TIMEOUT:-400} \
    JAX_COMM_GEMM_TIMEOUT=${CALL_TIMEOUT:-60} JAX_COMM_GEMM_ABORT_GRACE=20 \
    JCG_HANG_DUMP_S=${HANG_DUMP:-370} timeout ${TESTS_TIMEOUT:-570} \
    python3 -m pytest tests/gpu -q -rs -p no:cacheprovider --ignore=tests/gpu/test_gpu_failures.py \
      > "$OUT/gpu_tests.log" 2>&1
  rc=$?
  for f in /tmp/jcg_gpu_logs/*.log; do
    [ -f "$f" ] && { echo; echo "===== $(basename "$f")"; cat "$f"; } >> "$OUT/gpu_tests.log"
  done
  grep -E "passed|failed|error|FAILED" "$OUT/gpu_tests.log" | grep -v "^\[process" | tail -25
  summary+=("gpu tests: rc=$rc, $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$OUT/gpu_tests.log" | tail -1) ($((SECONDS - start)) s)")
fi

if has failures; then
  # The failure scenarios and the 500-run stress check (tests/gpu/failures.py):
  # the workers' logs follow pytest's; failures_summary.txt has the kill
  # scenario's exit path and the stress counts.
  start=$SECONDS
  rm -rf /tmp/jcg_failure_logs
  JCG_GPU_LOG_DIR=/tmp/jcg_failure_logs timeout ${FAILURES_TIMEOUT:-420} \
    python3 -m pytest tests/gpu/test_gpu_failures.py -q -rs -p no:cacheprovider \
    ${FAILURES_K:+-k "$FAILURES_K"} > "$OUT/gpu_failures.log" 2>&1
  rc=$?
  cat /tmp/jcg_failure_logs/failures_summary.log /tmp/jcg_failure_logs/stress.log \
    > "$OUT/failures_summary.txt" 2>/dev/null
  for f in /tmp/jcg_failure_logs/failures_*_process*.log; do
    [ -f "$f" ] && { echo; echo "===== $(basename "$f")"; cat "$f"; } >> "$OUT/gpu_failures.log"
  done
  cat "$OUT/failures_summary.txt"
  grep -E "passed|failed|FAILED|Warning" "$OUT/gpu_failures.log" | grep -v "^\[process" | tail -25
  summary+=("gpu failures: rc=$rc, $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$OUT/gpu_failures.log" | tail -1) ($((SECONDS - start)) s)")
fi

if has stress; then
  # The stress check alone (tests/gpu/stress.py: MLP fwd+bwd on fresh inputs,
  # per row against a reference), one process per GPU: a race between a fused
  # call and the XLA work around it shows as wrong runs, not as errors
  # (docs/design.md#ordering-against-xla-the-fence). STRESS_VARIANTS picks
  # stress.py's variants (default: all of them).
  start=$SECONDS
  for i in $(ranks); do
    JCG_STRESS_VARIANTS=${STRESS_VARIANTS:-} JCG_HANG_DUMP_S=150 \
      timeout 170 python3 tests/gpu/stress.py --runs ${STRESS_RUNS:-150} --process-id $i \
      --num-processes $NGPU --port 12448 > /tmp/stress_$i.log 2>&1 &
  done
  wait
  result=$(grep -h "^JCG_RESULT" /tmp/stress_0.log | head -1)
  line="stress: $(echo "$result" | grep -o '"runs": [0-9]*, "wrong": [0-9]*' | head -1) ($((SECONDS - start)) s)"
  echo "$line" | tee "$OUT/stress.log"
  { grep -h "^JCG_RESULT" /tmp/stress_0.log | cut -c1-3000
    grep -v -E "^[IW][0-9]{4} |^JCG_RESULT|GRPC|grpc_util|Source Location|UNAVAILABLE|^$" \
      /tmp/stress_0.log | tail -12; } >> "$OUT/stress.log"
  summary+=("$line")
fi

if has schedule; then
  # Where XLA puts its async collectives around the fused calls in the MLP step
  # (the entry computation of the optimised module, in schedule order).
  rm -rf /tmp/hlo
  XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" \
    timeout 60 python3 tests/gpu/worker.py --checks mlp_bf16,mlp_bf16_keep_input \
    > /tmp/schedule_run.log 2>&1
  grep "^\[process" /tmp/schedule_run.log > "$OUT/schedule.txt"
  python3 - >> "$OUT/schedule.txt" <<'EOF'
import glob
for f in sorted(glob.glob("/tmp/hlo/*after_optimizations.txt")):
  text = open(f).read()
  if "jax_comm_gemm_all_gather_matmul" not in text:
    continue
  print("=====", f.rsplit("/", 1)[-1])
  entry = text[text.index("\nENTRY"):]
  print("\n".join(line.strip()[:200] for line in entry[:entry.index("\n}\n")].splitlines()))
EOF
  summary+=("schedule: $(grep -c '^=====' "$OUT/schedule.txt") modules")
fi

if has example; then
  # The main example (the byte-level GPT) in both process modes, each ending
  # with its A/B of backend="auto" against "xla" (tests/gpu/example_ab.py).
  start=$SECONDS
  JCG_EXAMPLE_TIMEOUT_S=${EXAMPLE_TIMEOUT:-200} timeout ${EXAMPLE_TIMEOUT_ALL:-420} \
    python3 tests/gpu/example_ab.py "$OUT/example" ${EXAMPLE_ARGS:-} > "$OUT/example.log" 2>&1
  rc=$?
  tail -30 "$OUT/example.log"
  summary+=("example (both process modes) ${EXAMPLE_ARGS:-}: rc=$rc ($((SECONDS - start)) s)")
fi

# The project's side of the benchmark alone (benchmarks/run_all.sh runs it with
# the peers); BENCH_BUDGET seconds, BENCH_ARGS added.
for mode in bench bench-quick; do
  if has $mode; then
    start=$SECONDS
    extra=$([ $mode = bench-quick ] && echo --quick)
    budget=${BENCH_BUDGET:-$([ $mode = bench-quick ] && echo 150 || echo 300)}
    timeout $((budget + 40)) python3 benchmarks/bench.py --out "$OUT/bench.json" \
      --budget "$budget" $extra ${BENCH_ARGS:-} 2>&1 \
      | grep -v -E "^[IW][0-9]{4} " | tee "$OUT/bench.log"
    summary+=("$mode: rc=${PIPESTATUS[0]} ($((SECONDS - start)) s)")
  fi
done

echo "==== summary"
printf '%s\n' "${summary[@]}"
