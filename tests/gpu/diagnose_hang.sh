#!/bin/bash
# Reproduces the one-process-per-GPU job of the GPU suite (every check of
# tests/gpu/checks.py, in order) with a short call deadline, autotune's batch
# log, and a watcher that dumps every thread's native stack (gdb, if the
# machine has it) once the workers' logs stop growing. For a hang that only
# shows after many checks (one was seen in autotune_step at the end of the
# whole suite, and not with that check alone).
# Usage: tests/gpu/diagnose_hang.sh OUT_DIR [CHECKS]
# (on a machine with two GPUs and the project installed; docs/gpu-testing.md)
set -uo pipefail
out=${1:?output folder}
mkdir -p "$out"
checks=${2:-$(python3 -c "import sys; sys.path.insert(0, 'tests/gpu'); import checks; \
print(','.join(checks.CHECKS))" 2>/dev/null)}
export JAX_COMM_GEMM_TIMEOUT=${JAX_COMM_GEMM_TIMEOUT:-25} JAX_COMM_GEMM_ABORT_GRACE=10
export JCG_AUTOTUNE_DEBUG=${JCG_AUTOTUNE_DEBUG-1} JCG_HANG_DUMP_S=${JCG_HANG_DUMP_S:-250}
pids=()
for i in 0 1; do
  python3 tests/gpu/worker.py --checks "$checks" --process-id $i --num-processes 2 \
    --port 12433 > "$out/hang_process$i.log" 2>&1 &
  pids+=($!)
done
last="" still=0 dumped=0
while kill -0 "${pids[@]}" 2>/dev/null; do
  sleep 5
  now=$(cat "$out"/hang_process*.log | wc -c)
  if [ "$now" = "$last" ]; then still=$((still + 5)); else still=0; fi
  last=$now
  if [ $still -ge 15 ] && [ $dumped = 0 ]; then
    dumped=1
    echo "no log output for $still s: native stacks" | tee "$out/native_stacks.txt"
    for pid in "${pids[@]}"; do
      echo "===== pid $pid" >> "$out/native_stacks.txt"
      if command -v gdb > /dev/null; then
        timeout 60 gdb -p "$pid" -batch -ex "thread apply all bt 25" >> "$out/native_stacks.txt" 2>&1
      else
        for t in /proc/$pid/task/*; do
          echo "$t $(cat $t/comm) $(cat $t/wchan 2>/dev/null)" >> "$out/native_stacks.txt"
        done
      fi
    done
  fi
done
wait
grep -h "autotune\|Aborted\|abort\|jax_comm_gemm\|deadline\|did not answer" "$out"/hang_process*.log \
  | grep -v "^JCG_CHECK" | tail -30
grep -hc ": ok (" "$out"/hang_process*.log
