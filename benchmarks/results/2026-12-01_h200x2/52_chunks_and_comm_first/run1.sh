#!/bin/bash
# Runs 52–56, device call 1: experiments (uncommitted env switches in pipelined.cc).
set -u
cd "$(dirname "$0")/.."
start=$SECONDS
python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $((SECONDS-start)) s"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader > $OUT/machine.txt
python3 -c "import jax; print('jax', jax.__version__)" >> $OUT/machine.txt
B="python3 benchmarks/bench.py --warmup-first-s 4 --warmup-s 1.5 --budget 80 --hang-timeout 60"
filt() { grep -v -E "^[IW][0-9]{4} |^\{" "$1" | grep -E "median ms|WATCHDOG|Error|error" | head -20; }
# 1. autotune's timing against the benchmark's, GEMM+RS
timeout 150 python3 benchmarks/timing_probe.py --op rs --shapes 8192x4096x4096,2048x8192x8192 > $OUT/probe_rs.log 2>&1
grep -v -E "^[IW][0-9]{4} " $OUT/probe_rs.log | grep -v "^  gpu" | tail -14
echo "probe done $((SECONDS-start)) s"
# 2. GEMM+RS pipelined_ce chunks
for c in 4 2 1; do
  prof=""; [ $c = 4 ] && prof="--profile matmul_reduce_scatter:8192x4096x4096:pipelined_ce --profile-out $OUT/rs_profile_c4.txt --profile-dir /tmp/prof_rs"
  [ $c = 2 ] && prof="--profile matmul_reduce_scatter:8192x4096x4096:pipelined_ce --profile-out $OUT/rs_profile_c2.txt --profile-dir /tmp/prof_rs2"
  JCG_EXP_RS_CHUNKS=$c timeout 150 $B --ops rs --variants pipelined_ce,xla --shapes 8192x4096x4096,4096x4096x4096,2048x8192x8192 \
    --out $OUT/rs_chunks_$c.json $prof > $OUT/rs_chunks_$c.log 2>&1
  echo "chunks $c:"; filt $OUT/rs_chunks_$c.log
done
echo "chunks done $((SECONDS-start)) s"
# 3. pipelined AllGather+GEMM: SendRecv enqueued before the local GEMM
for f in 0 1; do
  if [ $f = 1 ]; then export JCG_EXP_COMM_FIRST=1; else unset JCG_EXP_COMM_FIRST; fi
  timeout 150 $B --ops ag --variants pipelined,pipelined_ce,xla --shapes 4096x4096x4096,8192x4096x4096,2048x8192x8192 \
    --out $OUT/ag_comm_first_$f.json --profile all_gather_matmul:4096x4096x4096:pipelined \
    --profile-out $OUT/ag_profile_comm_first_$f.txt --profile-dir /tmp/prof_ag$f > $OUT/ag_comm_first_$f.log 2>&1
  echo "comm first $f:"; filt $OUT/ag_comm_first_$f.log
done
unset JCG_EXP_COMM_FIRST
echo "all done $((SECONDS-start)) s"
