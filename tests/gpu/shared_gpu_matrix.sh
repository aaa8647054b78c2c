#!/usr/bin/env bash
# Every check of the GPU suite at 2, 4 and 8 ranks sharing one GPU, the FP8 probe of
# cuBLASMp's plain workspace and the 'told' failure scenario, in two bounded runs
# (docs/gpu-testing.md). From the repository root, on a machine with one GPU:
#   OUT=dir bash tests/gpu/shared_gpu_matrix.sh first  [SECONDS]  build; FP8 probe; the suite
#                                                               at 2 and 4 ranks and the first
#                                                               third of it at 8, concurrently
#   OUT=dir bash tests/gpu/shared_gpu_matrix.sh second [SECONDS]  the rest at 8 ranks (two
#                                                               concurrent jobs) and 'told'
#   OUT=dir bash tests/gpu/shared_gpu_matrix.sh one    [SECONDS]  all of it in one run but the
#                                                               8-rank tuning checks (EIGHT_C)
#   OUT=dir bash tests/gpu/shared_gpu_matrix.sh short  [SECONDS]  all at 2 ranks, cuBLASMp's core
#                                                               checks at 4 and 8, probe, 'told'
#   python3 tests/gpu/suite_table.py OUT/table.md 2=OUT/suite_2ranks_all ...   (printed last)
# Jobs run side by side (the ranks mostly wait on sockets), each bounded by what is left
# of SECONDS (default 560); the processes share the GPU's memory (XLA's share each, not
# preallocated). Logs and each job's pytest output go under OUT, packed at the end into
# OUT/logs_PART.tar.gz beside the summaries.
set -uo pipefail
part=$1 budget=${2:-560}
OUT=${OUT:?set OUT to the results folder}
mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }
suite() {  # RANKS NAME PATTERNS: one job, in the background
  NAME=$2 LOG_DIR=$OUT bash "$here/shared_gpu.sh" suite "$1" "$3" "$(( $(left) - 15 ))" &
}
# A third of the suite each, for 8 ranks (whose collectives take ~60 ms through sockets).
EIGHT_A='status,plain_workspace,inputs_intact,all_gather_matmul_*,matmul_reduce_scatter_*,routing,layout_self_test,connect_arguments,ffi_errors,vmap,pallas_*'
EIGHT_B='mlp_*,fp8_fused_gemm,fp8_tensor_fused_*,mesh_2d'
EIGHT_C='memory_flat,rs_pipelined_chunks,fp8_tensor,fp8_row,fp8_tensor_keep_input,fp8_*ring*,fp8_heads_*,autotune*'
build() {
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
  python3 -c "import jax_comm_gemm as j; print('cublasmp_status:', j.cublasmp_status())" \
    >> "$OUT/build.log" 2>&1
}
told() {
  ONLY=a_rank_that_fails_alone LOG_DIR=$OUT timeout "$(( $(left) - 10 ))" \
    bash "$here/shared_gpu.sh" failures "$(( $(left) - 20 ))" &
}
case $part in
  one)
    build
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.035  # 26 processes at once
    timeout "$(( $(left) - 20 ))" bash benchmarks/probes/plain_workspace_fp8.sh \
      "$OUT/probe_plain_workspace_fp8.log" &
    told
    suite 2 all '*'
    suite 4 all '*'
    suite 8 a "$EIGHT_A"
    suite 8 b "$EIGHT_B"
    wait
    tables="2=$OUT/suite_2ranks_all 4=$OUT/suite_4ranks_all 8=$OUT/suite_8ranks_a 8=$OUT/suite_8ranks_b"
    ;;
  short)  # where device time is short: the cuBLASMp core at 4 and 8 ranks, all at 2
    build
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.05
    timeout "$(( $(left) - 20 ))" bash benchmarks/probes/plain_workspace_fp8.sh \
      "$OUT/probe_plain_workspace_fp8.log" &
    told
    suite 2 all '*'
    suite 4 a "$EIGHT_A"
    suite 8 core 'status,plain_workspace,routing,layout_self_test,fp8_fused_gemm'
    wait
    tables="2=$OUT/suite_2ranks_all 4=$OUT/suite_4ranks_a 8=$OUT/suite_8ranks_core"
    ;;
  first)
    build
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.05  # 14 processes at once
    timeout "$(( $(left) - 20 ))" bash benchmarks/probes/plain_workspace_fp8.sh \
      "$OUT/probe_plain_workspace_fp8.log" &
    suite 2 all '*'
    suite 4 all '*'
    suite 8 a "$EIGHT_A"
    wait
    tables="2=$OUT/suite_2ranks_all 4=$OUT/suite_4ranks_all 8=$OUT/suite_8ranks_a"
    ;;
  second)
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.045  # 20 processes at once
    suite 8 b "$EIGHT_B"
    suite 8 c "$EIGHT_C"
    told
    wait
    tables="8=$OUT/suite_8ranks_b 8=$OUT/suite_8ranks_c"
    ;;
  *) echo "usage: OUT=dir $0 one|short|first|second [SECONDS]" >&2; exit 2 ;;
esac
cat "$OUT/summary.txt" 2>/dev/null
python3 tests/gpu/suite_table.py "$OUT/table_$part.md" $tables
# The per-rank logs in one archive (the summaries stay beside it): a device run
# hands back only so many files, and a results folder keeps no file over 1 MB.
(cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name '*.md' ! -name summary.txt \
   ! -name build.log ! -name 'probe_*' ! -name 'logs_*.tar.gz' -print0 \
   | tar czf "logs_$part.tar.gz" --null -T - --remove-files)
echo "$part: $(( $(date +%s) - start )) s"
