#!/bin/bash
# Runs 52–56, device call 3: the whole GPU suite on the new chunk rule, then
# the GEMM+RS cells it changes.
set -u
cd "$(dirname "$0")/.."
start=$SECONDS
TESTS_TIMEOUT=470 JOB_TIMEOUT=330 HANG_DUMP=320 bash benchmarks/gpu_session.sh build tests > /tmp/sess.log 2>&1
tail -12 /tmp/sess.log
echo "suite done $((SECONDS-start)) s"
mkdir -p /tmp/o
timeout $((585 - SECONDS)) python3 benchmarks/bench.py --ops rs --variants auto,pipelined_ce,xla \
  --shapes 8192x4096x4096,2048x8192x8192,4096x4096x4096 --budget 50 --warmup-first-s 3 --warmup-s 1.5 \
  --out /tmp/o/rs_after.json > /tmp/o/rs_after.log 2>&1
grep "median ms" /tmp/o/rs_after.log | sed 's/|.*//'
cp /tmp/sess.log /tmp/o/
tar czf $OUT/run3_rs.tar.gz -C /tmp/o .
echo "all done $((SECONDS-start)) s"
