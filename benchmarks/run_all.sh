#!/bin/bash
# The whole benchmark as one command: the project's side (bench.py: the
# ops and the transformer block, the profiles, the MLP memory rows), then each
# peer in its own processes (XLA's windowed einsum, PyTorch SymmetricMemory
# through torchrun, jax's Pallas Mosaic GPU kernel), within one time budget; a
# short summary is printed last.
#
# Run from the repository root on a GPU machine set up as docs/gpu-testing.md
# ("The machine") says:
#   OUT=$OUT benchmarks/run_all.sh [options]
# Options:
#   --budget S    seconds for everything after this script starts (default 510)
#   --quick       fewer shapes, rounds and tile configs (about 4-5 minutes)
#   --parts LIST  comma list of project,windowed_einsum,torch_symm_mem,pallas_mgpu
#   --build       pip install -e . first (default: only when the project part runs
#                 and jax_comm_gemm is not importable from outside the tree)
#   --no-build    never build
#   --no-profiles skip the jax.profiler traces and the peers' (the torch peer's
#                 all_gather_matmul at 16384x8192x8192 and 4096x4096x4096, Pallas's at 4096^3)
# Environment: MEMORY_ENV="K=V ..." is passed to the memory workers (e.g. a
# variable that turns the backend's autotuning cache off); BENCH_ARGS is added
# to the project's bench.py command line, WINDOWED_ARGS to the windowed one,
# TORCH_ARGS to the torch peer's (e.g. TORCH_ARGS="--profile matmul_reduce_scatter:4096x4096x4096").
# NGPU: how many GPUs the peers run on (default: every GPU, as the project's part).
# AG_PROFILE_SHAPES: more AllGather+GEMM shapes to profile, the project's and the
# peers' (e.g. AG_PROFILE_SHAPES="8192x8192x7168 8192x4096x4096").
#
# What comes back in $OUT (8 files at most): project.json, windowed_einsum.json,
# torch_symm_mem.json, pallas_mgpu.json (one per part; each written after every
# shape, so a killed part leaves what it measured), run.log (all logs, glog
# noise removed), profiles.txt (trace summaries), table.md, traces.tar.gz (the
# perfetto traces and torch_profiles/*.trace.json.gz, if under 15 MiB). Then, on any machine:
#   python3 benchmarks/summarize.py $OUT --out-dir benchmarks/results/<date>_<machine>
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
T0=$SECONDS
budget=510
quick=""
parts="project,windowed_einsum,torch_symm_mem,pallas_mgpu"
build=auto
profiles=1
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) budget=$2; shift ;;
    --quick) quick=--quick ;;
    --parts) parts=$2; shift ;;
    --build) build=1 ;;
    --no-build) build=0 ;;
    --no-profiles) profiles=0 ;;
    *) echo "unknown option $1"; exit 2 ;;
  esac
  shift
done
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Every GPU of the machine, as the project's part uses them all (or NGPU).
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c "^GPU ")}
work=/tmp/jcg_bench
rm -rf "$work"; mkdir -p "$work/logs" "$work/profiles" "$work/torch_profiles" "$work/pallas_profiles" "$OUT"
LOG=$OUT/run.log
: > "$LOG"
summary=()
note() { echo "$*" | tee -a "$LOG"; }
left() { echo $(( budget - (SECONDS - T0) )); }

# NVLink multicast must stay off: it can take a shared host's GPUs out of service
# (docs/gpu-testing.md, "The machine"). Never unset these.
if [ "${NCCL_NVLS_ENABLE:-}" != 0 ] || [ "${TORCH_SYMM_MEM_DISABLE_MULTICAST:-}" != 1 ]; then
  note "refusing to run: NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 must be set" \
       "(docs/gpu-testing.md, \"The machine\")"
  exit 2
fi

{
  echo "==== machine ($(date -u +%FT%TZ))"
  nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -4
  python3 -c "import sys, jax, jaxlib; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__)"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1 | tail -1
  echo "budget ${budget}s parts $parts ${quick:-full} GPUs $NGPU"
} >> "$LOG" 2>&1

if [ "$build" = auto ]; then  # only the project part needs the package
  build=0
  if [[ ",$parts," == *",project,"* ]] && ! (cd / && python3 -c "import jax_comm_gemm" > /dev/null 2>&1); then
    build=1
  fi
fi
if [ "$build" = 1 ]; then
  start=$SECONDS
  if python3 -m pip install --no-build-isolation --no-deps -e . > "$work/logs/build.log" 2>&1; then
    summary+=("build: ok ($((SECONDS - start)) s)")
  else
    summary+=("build: FAILED ($((SECONDS - start)) s); the project part will fail")
    { echo "==== build"; tail -40 "$work/logs/build.log"; } >> "$LOG"
  fi
  note "${summary[-1]}"
fi

declare -A weight=([project]=60 [windowed_einsum]=12 [torch_symm_mem]=13 [pallas_mgpu]=15)
IFS=, read -r -a todo <<< "$parts"
reserve=15  # the summary at the end

share_of() {  # share_of PART: seconds for PART, from what is left and the parts still to run
  local p=$1 total=0 q started=0
  for q in "${todo[@]}"; do
    [ "$q" = "$p" ] && started=1
    [ $started = 1 ] && total=$(( total + ${weight[$q]:-10} ))
  done
  local avail=$(( $(left) - reserve ))
  echo $(( avail * ${weight[$p]:-10} / (total > 0 ? total : 1) ))
}

run_part() {  # run_part NAME BUDGET CMD...: runs under a hard timeout, logs into run.log
  local name=$1 b=$2; shift 2
  local start=$SECONDS
  if [ "$b" -lt 20 ]; then
    summary+=("$name: skipped (only ${b} s left)")
    note "${summary[-1]}"
    return 0
  fi
  # The hard limit: 30 s of grace past the part's budget, but never past the whole budget.
  local hard=$(( b + 30 )) cap=$(( $(left) - 5 ))
  [ $hard -gt $cap ] && hard=$(( cap > b ? cap : b ))
  echo "==== $name (budget ${b}s, killed after ${hard}s): $*" >> "$LOG"
  timeout --kill-after=10 $hard "$@" > "$work/logs/$name.log" 2>&1
  local rc=$?
  grep -v -E '^[IW][0-9]{4} |^WARNING: All log messages before absl' "$work/logs/$name.log" >> "$LOG"
  echo "==== $name: rc=$rc, $((SECONDS - start)) s" >> "$LOG"
  summary+=("$name: rc=$rc ($((SECONDS - start)) s of ${b} s)")
  return $rc
}

prof_args=()
torch_prof_args=()
pallas_prof_args=()
if [ $profiles = 1 ]; then
  prof_args=(--profile all_gather_matmul:4096x4096x4096:auto
             --profile mlp_fwd_bwd:8192x8192x7168:auto)
  [ -z "$quick" ] && prof_args+=(--profile all_gather_matmul:4096x4096x4096:xla
                                 --profile mlp_fwd_bwd:8192x8192x7168:pure_jax)
  # The torch peer's traces (within its budget: it weighs them against its shapes).
  torch_prof_args=(--profile all_gather_matmul:16384x8192x8192
                   --profile all_gather_matmul:4096x4096x4096 --profile-dir "$work/torch_profiles")
  # The Pallas kernel's, where it leads (4096^3: docs/performance.md).
  pallas_prof_args=(--profile 4096x4096x4096 --profile-dir "$work/pallas_profiles")
  # AG_PROFILE_SHAPES="S1 S2 ...": AllGather+GEMM shapes to profile on every side,
  # the project's auto, cuBLASMp default and pipelined_ce beside the two peers.
  for shape in ${AG_PROFILE_SHAPES:-}; do
    for v in auto cublasmp_default pipelined_ce; do
      prof_args+=(--profile "all_gather_matmul:$shape:$v")
    done
    torch_prof_args+=(--profile "all_gather_matmul:$shape")
    pallas_prof_args+=(--profile "$shape")
  done
  prof_args+=(--profile-dir "$work/profiles" --profile-out "$OUT/profiles.txt")
fi
mem_args=()
for kv in ${MEMORY_ENV:-}; do mem_args+=(--memory-env "$kv"); done

for part in "${todo[@]}"; do
  b=$(share_of "$part")
  case "$part" in
    project)
      # The same command, first and on the resume after a hang.
      project_args=($quick --transformer ${prof_args[@]+"${prof_args[@]}"}
                    ${mem_args[@]+"${mem_args[@]}"} ${BENCH_ARGS:-})
      run_part project "$b" python3 "$here/bench.py" --out "$OUT/project.json" --budget "$b" \
        "${project_args[@]}"
      rc=$?
      # A hang (the watchdog exits 3) or a kill: once more, keeping what was measured
      # and leaving out the variant that hung.
      if [ $rc -ne 0 ] && [ -s "$OUT/project.json" ] && [ "$(share_of project)" -gt 60 ]; then
        b=$(( $(share_of project) ))
        run_part project_resume "$b" python3 "$here/bench.py" --out "$OUT/project.json" \
          --budget "$b" --resume "${project_args[@]}"
      fi
      ;;
    windowed_einsum)
      run_part windowed_einsum "$b" python3 "$here/bench.py" --peer windowed_einsum \
        --out "$OUT/windowed_einsum.json" --budget "$b" $quick \
        --ops all_gather_matmul,mlp_fwd_bwd,matmul_reduce_scatter,all_gather_matmul_sweep,row_parallel_fwd_bwd \
        ${WINDOWED_ARGS:-}
      ;;
    torch_symm_mem)
      run_part torch_symm_mem "$b" python3 -m torch.distributed.run --standalone \
        --nproc-per-node "$NGPU" "$here/peers/torch_symm_mem.py" --out "$OUT/torch_symm_mem.json" \
        --budget "$(( b - 10 ))" $quick ${torch_prof_args[@]+"${torch_prof_args[@]}"} ${TORCH_ARGS:-}
      # After a hang: once more, without the shape that hung.
      if [ $? -ne 0 ] && grep -q '"hangs"' "$OUT/torch_symm_mem.json" 2>/dev/null \
          && [ "$(share_of torch_symm_mem)" -gt 45 ]; then
        b=$(share_of torch_symm_mem)
        run_part torch_symm_mem_resume "$b" python3 -m torch.distributed.run --standalone \
          --nproc-per-node "$NGPU" "$here/peers/torch_symm_mem.py" --out "$OUT/torch_symm_mem.json" \
          --budget "$(( b - 10 ))" $quick --resume ${torch_prof_args[@]+"${torch_prof_args[@]}"} \
          ${TORCH_ARGS:-}
      fi
      # Their summaries, as bench.py --profile-out writes the project's: the span of
      # the steps waited for one by one, then of those run back to back.
      if [ $profiles = 1 ]; then
        for t in "$work"/torch_profiles/*.trace.json.gz; do
          [ -e "$t" ] || continue
          for w in all_steps:bench_step_ back_to_back:bench_back_to_back; do
            { echo "== torch_symm_mem $(basename "$t" .trace.json.gz) [${w%%:*}: ${w#*:}]"
              timeout 60 python3 "$here/trace_summary.py" "$t" --window "${w#*:}" 2>&1
              echo; } >> "$OUT/profiles.txt"
          done
        done
      fi
      ;;
    pallas_mgpu)
      run_part pallas_mgpu "$b" python3 "$here/peers/pallas_mgpu.py" \
        --out "$OUT/pallas_mgpu.json" --budget "$b" --processes "$NGPU" $quick \
        ${pallas_prof_args[@]+"${pallas_prof_args[@]}"}
      for t in "$work"/pallas_profiles/*/plugins/profile/*/perfetto_trace.json.gz; do
        [ -e "$t" ] || continue
        name=${t#"$work"/pallas_profiles/}
        { echo "== pallas_mgpu ${name%%/*} [back_to_back: bench_back_to_back]"
          timeout 60 python3 "$here/trace_summary.py" "$t" --window bench_back_to_back 2>&1
          echo; } >> "$OUT/profiles.txt"
      done
      ;;
    *) note "unknown part $part" ;;
  esac
  # A part that could not even start still leaves a JSON, so the summary shows it.
  f="$OUT/$part.json"
  if [ ! -s "$f" ]; then
    python3 - "$f" "$part" "$work/logs/$part.log" <<'EOF'
import json, sys
path, part, log = sys.argv[1:4]
try:
    tail = open(log).read()[-1500:]
except OSError:
    tail = ""
json.dump({"part": part, "schema": 1, "records": [], "finished": False,
           "error": "no output from the part; log tail: " + tail}, open(path, "w"), indent=1)
EOF
  fi
done

# The traces, if small enough to come back.
tar_args=()
jax_traces=$(cd "$work/profiles" && ls */plugins/profile/*/perfetto_trace.json.gz 2> /dev/null)
[ -n "$jax_traces" ] && tar_args+=(-C "$work/profiles" $jax_traces)
peer_traces=$(cd "$work" && ls torch_profiles/*.trace.json.gz \
  pallas_profiles/*/plugins/profile/*/perfetto_trace.json.gz 2> /dev/null)
[ -n "$peer_traces" ] && tar_args+=(-C "$work" $peer_traces)
if [ ${#tar_args[@]} -gt 0 ]; then
  tar czf "$work/traces.tar.gz" "${tar_args[@]}"
  if [ "$(stat -c %s "$work/traces.tar.gz")" -lt $((15 * 1024 * 1024)) ]; then
    cp "$work/traces.tar.gz" "$OUT/"
  else
    note "traces.tar.gz is over 15 MiB: not copied"
  fi
fi

echo "==== summary ($((SECONDS - T0)) s)" | tee -a "$LOG"
python3 "$here/summarize.py" "$OUT" --out-dir "$work/summary" --no-plot --brief 2>&1 \
  | tail -60 | tee -a "$LOG"
[ -s "$work/summary/table.md" ] && cp "$work/summary/table.md" "$OUT/"
printf '%s\n' "${summary[@]}" | tee -a "$LOG"
echo "total $((SECONDS - T0)) s; files in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
