#!/usr/bin/env bash
# The shared-GPU mode's runs on a machine with one GPU (docs/gpu-testing.md):
#   tests/gpu/shared_gpu.sh suite RANKS [PATTERNS] [SECONDS]  the GPU suite at RANKS ranks
#   tests/gpu/shared_gpu.sh failures [SECONDS]                the failure scenarios, stress at 2
#                                                             (ONLY=EXPR: those pytest -k selects)
#   tests/gpu/shared_gpu.sh example PROCESSES [SECONDS]       the example: trains, resumes
# Logs go to $LOG_DIR (default ./shared_gpu_logs), one folder per run; each run
# ends with one summary line in $LOG_DIR/summary.txt. SECONDS bounds the run.
set -uo pipefail
LOG_DIR=${LOG_DIR:-$PWD/shared_gpu_logs}
mkdir -p "$LOG_DIR"
what=$1; shift

summary() { echo "$*" | tee -a "$LOG_DIR/summary.txt"; }

pytest_counts() {  # the last line of a pytest log: "N passed, M skipped in S s"
  tail -n 1 "$1" | sed 's/=//g; s/^ *//'
}

case $what in
  suite)
    ranks=$1 patterns=${2:-*} seconds=${3:-540}
    # NAME labels the run's folder (default: the patterns, or their checksum when long).
    label=${NAME:-$(echo "$patterns" | tr -c 'a-z0-9_\n' '-')}
    [ ${#label} -gt 60 ] && label=$(echo "$patterns" | cksum | cut -d' ' -f1)
    dir=$LOG_DIR/suite_${ranks}ranks${2:+_$label}
    mkdir -p "$dir"
    start=$(date +%s)
    JCG_GPU_SHARED=$ranks JCG_GPU_CHECKS=$patterns JCG_GPU_LOG_DIR=$dir \
      JCG_GPU_JOB_TIMEOUT_S=$((seconds - 25)) \
      timeout "$seconds" python3 -m pytest -q -rfs -p no:cacheprovider \
      tests/gpu/test_gpu_suite.py > "$dir/pytest.log" 2>&1
    rc=$?
    summary "suite ranks=$ranks checks=$patterns: $(pytest_counts "$dir/pytest.log")" \
            "(rc $rc, $(( $(date +%s) - start )) s)"
    ;;
  failures)
    seconds=${1:-560}
    dir=$LOG_DIR/failures_2ranks
    mkdir -p "$dir"
    start=$(date +%s)
    JCG_GPU_SHARED=2 JCG_STRESS_RUNS=${JCG_STRESS_RUNS:-200} JCG_GPU_LOG_DIR=$dir \
      timeout "$seconds" python3 -m pytest -q -rfs -p no:cacheprovider ${ONLY:+-k "$ONLY"} \
      tests/gpu/test_gpu_failures.py > "$dir/pytest.log" 2>&1
    rc=$?
    summary "failures ranks=2 stress_runs=${JCG_STRESS_RUNS:-200}: $(pytest_counts "$dir/pytest.log")" \
            "(rc $rc, $(( $(date +%s) - start )) s)"
    ;;
  example)
    n=$1 seconds=${2:-280}
    dir=$LOG_DIR/example_${n}processes
    mkdir -p "$dir"
    # A model that fits N ranks' shares of one GPU; 16 steps with a checkpoint
    # at 8, then a resumed run to 24.
    args=(--processes "$n" --share-gpu --size gpu --d-model 1024 --hidden 4096 --layers 2
          --seq-len 512 --batch 8 --ab-steps 0 --log-every 4 --eval-every 8 --checkpoint-every 8
          --checkpoint-dir "$dir/checkpoints" --json-out "$dir/run.json")
    start=$(date +%s)
    export JAX_COMM_GEMM_AUTOTUNE_CACHE=$dir/autotune.json  # the resumed run reads the choices
    timeout -k 20 $((seconds * 2 / 3)) python3 examples/train_byte_gpt.py "${args[@]}" --steps 16 \
      > "$dir/train.log" 2>&1
    rc_train=$?
    timeout -k 20 $((seconds / 3)) python3 examples/train_byte_gpt.py "${args[@]}" --steps 24 --resume \
      --json-out "$dir/resume.json" > "$dir/resume.log" 2>&1
    rc_resume=$?
    summary "example processes=$n: train rc $rc_train, resume rc $rc_resume" \
            "($(( $(date +%s) - start )) s); $(grep -m1 -i 'resum' "$dir/resume.log" | cut -c1-120)"
    ;;
  *)
    echo "usage: $0 suite RANKS [PATTERNS] [SECONDS] | failures [SECONDS] | example N [SECONDS]" >&2
    exit 2
    ;;
esac
