#!/bin/bash
# Runs 52–56, device call 2: host time per phase of a call (uncommitted instrumentation).
set -u
cd "$(dirname "$0")/.."
start=$SECONDS
python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $((SECONDS-start)) s"
mkdir -p /tmp/o
B="python3 benchmarks/bench.py --warmup-first-s 2 --warmup-s 1 --rounds 6 --budget 40 --hang-timeout 60"
run() {  # name op variant shape
  JCG_EXP_HOST_TIMES=400 timeout 90 $B --ops $2 --variants $3,xla --shapes $4 --out /tmp/o/$1.json > /tmp/o/$1.log 2>&1
  echo "== $1"; grep -E "median ms" /tmp/o/$1.log | sed 's/|.*//'; grep "host times" /tmp/o/$1.log | tail -2
}
run ag_pipelined ag pipelined 4096x4096x4096
run ag_pipelined_ce ag pipelined_ce 4096x4096x4096
run ag_default ag cublasmp_default 4096x4096x4096
run rs_pipelined_ce rs pipelined_ce 8192x4096x4096
run rs_default rs cublasmp_default 8192x4096x4096
echo "all done $((SECONDS-start)) s"
tar czf $OUT/run2.tar.gz -C /tmp/o .
