#!/usr/bin/env bash
# cuBLASMp's FP8 (per-tensor E4M3) AllGather+GEMM and GEMM+ReduceScatter on a plain
# cudaMalloc workspace, ranks sharing GPU 0 (NCCL_HOSTID per process, so NCCL joins
# them through its network transport and has no symmetric memory).
# Run on the GPU machine from the repository root, with NCCL >= 2.29 and cuBLASMp
# found through DEVLIBS_NCCL_INCLUDE/_LIB and DEVLIBS_CUBLASMP_ROOT (or edit below):
#   bash benchmarks/probes/plain_workspace_fp8.sh [OUT_LOG]
# Prints per rank: the error against float64, where the gathered FP8 operand lies in
# the workspace, or cuBLASMp's status where it refuses the algorithm; then the same
# AllGather+GEMM in bf16 (PROBE_TYPE=bf16) at 2, 4 and 8 ranks: where the gathered
# operand that jax_comm_gemm's reuse reads lies (TAIL, FRONT or the offset).
set -u
log=${1:-/dev/stdout}
here=$(cd "$(dirname "$0")" && pwd)
CU=$(python3 -c "import nvidia,os;print([p for p in nvidia.__path__ if 'site-packages' in p][0])")/cu13
bin=/tmp/plain_workspace_fp8
g++ -std=c++17 -O2 -o $bin "$here/plain_workspace_fp8.cpp" -I/usr/local/cuda/include \
  -I"$DEVLIBS_NCCL_INCLUDE" -I"$CU/include" -I"$DEVLIBS_CUBLASMP_ROOT/include" -I"$here/../../xla_ffi" \
  -L/usr/local/cuda/lib64 -L"$DEVLIBS_NCCL_LIB" -L"$DEVLIBS_CUBLASMP_ROOT/lib" \
  -l:libcublasmp.so.0 -l:libnccl.so.2 -lcudart || exit 1
run() {  # P n k m op algo
  local P=$1; shift
  local uid=/tmp/plain_fp8_uid_$$
  rm -f "$uid"
  for ((r = 0; r < P; r++)); do
    NCCL_HOSTID=fp8probe-$r PROBE_DEVICE=0 timeout 90 $bin $r $P "$uid" "$@" \
      > /tmp/plain_fp8_r$r.log 2>&1 &
  done
  wait
  echo "=== ranks $P, ${PROBE_TYPE:-e4m3}, n k m op algo = $*"
  for ((r = 0; r < P; r++)); do
    grep -E "version|workspace|max_err|gathered_B|cublasmp_status|CUDA|NCCL" /tmp/plain_fp8_r$r.log | cut -c1-200
  done
}
{
  for P in 2 4 8; do
    run $P 2048 1024 2048 ag 0   # DEFAULT
    run $P 2048 2048 1024 rs 0
  done
  run 2 2048 1024 2048 ag 5      # NO_OVERLAP
  run 2 2048 1024 2048 ag 1      # SPLIT_P2P: expected refused (status 7 in bf16)
  run 2 2048 2048 1024 rs 1
  for P in 2 4 8; do
    PROBE_TYPE=bf16 run $P 2048 1024 2048 ag 0
  done
} > "$log" 2>&1
