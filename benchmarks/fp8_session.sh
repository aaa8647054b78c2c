#!/bin/bash
# The FP8 measurements on one GPU, leaving logs in $OUT: builds the extension,
# runs the one-GPU checks, times the preset's blocks (benchmarks/fp8_step.py,
# bf16 parameters with a profile of one variant, then float32 parameters as the
# example keeps them) and the example over 200 steps in bf16 and in FP8.
# Usage: benchmarks/fp8_session.sh [build] [checks] [step] [step-f32] [example]
# Knobs: CHECK_WORDS (one_gpu.py's selection), VARIANTS (fp8_step.py --only),
# PROFILE (the variant to profile; empty: none), FP8 (the example's --fp8),
# STEPS (the example's steps), EXAMPLE_PROFILE (1: profile the example's steps too),
# ARCH (gpt or llama: the block fp8_step.py and the example run; default gpt),
# PRECISIONS (the example's runs: bf16 and/or FP8 recipes; default "bf16 $FP8").
set -uo pipefail
: "${OUT:?set OUT to the folder for the logs}"
steps=${*:-build checks step step-f32 example}
has() { [[ " $steps " == *" $1 "* ]]; }
quiet() { grep -v -E "^[IWE][0-9]{4} "; }  # absl's log lines
summary=()
variants=${VARIANTS:-project_fp8_tensor project_fp8_delayed plain_xla_fp8}
arch=(--arch "${ARCH:-gpt}")
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
  python3 -c "import sys, jax; print(sys.version.split()[0], 'jax', jax.__version__)"
  git rev-parse --short HEAD 2>/dev/null
} > "$OUT/machine.txt" 2>&1

if has build; then
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; echo "build: FAILED"; exit 1; }
  summary+=("build: ok")
fi
if has checks; then
  timeout 240 python3 tests/gpu/one_gpu.py ${CHECK_WORDS:-} 2>&1 | quiet > "$OUT/one_gpu.log"
  summary+=("$(tail -1 "$OUT/one_gpu.log")")
fi
if has step; then
  profile=()
  [ -n "${PROFILE-project_fp8_delayed}" ] && profile=(--profile /tmp/fp8_prof
      --profile-variants "${PROFILE-project_fp8_delayed}")
  timeout 300 python3 benchmarks/fp8_step.py "$OUT/fp8_step.json" "${arch[@]}" --only $variants \
    "${profile[@]}" 2>&1 | quiet > "$OUT/fp8_step.log"
  summary+=("$(grep -A12 '^| variant' "$OUT/fp8_step.log")")
  for dir in /tmp/fp8_prof/*/; do
    [ -d "$dir" ] || continue
    name=$(basename "$dir")
    python3 benchmarks/producers.py "$dir" "$dir/step.hlo.txt" --window step --fusions 25 \
      > "$OUT/producers_$name.md" 2>&1
    python3 benchmarks/trace_summary.py "$dir" --window batch --top 60 > "$OUT/trace_$name.txt" 2>&1
  done
fi
if has step-f32; then
  timeout 240 python3 benchmarks/fp8_step.py "$OUT/fp8_step_f32.json" "${arch[@]}" --master-f32 \
    --only $variants 2>&1 | quiet > "$OUT/fp8_step_f32.log"
  summary+=("$(grep -A12 '^| variant' "$OUT/fp8_step_f32.log")")
fi
if has example; then
  for precision in ${PRECISIONS:-bf16 ${FP8:-delayed}}; do
    fp8=${precision#bf16}
    name=example_${ARCH:-gpt}_${STEPS:-200}_${precision}
    # EXAMPLE_PROFILE=1: 3 more steps traced, their kernels classified by what produced them
    trace=()
    [ -n "${EXAMPLE_PROFILE:-}" ] && trace=(--profile "/tmp/$name")
    # --out-dir: the run's loss plot (loss.png) and text sample (sample.txt)
    timeout 200 python3 examples/train_byte_gpt.py "${arch[@]}" --steps "${STEPS:-200}" \
      --ab-steps 0 --no-checkpoint --out-dir "$OUT/$name" --log-every 10 --eval-every 1000 \
      ${fp8:+--fp8 "$fp8"} "${trace[@]}" --json-out "$OUT/$name.json" 2>&1 | quiet > "$OUT/$name.log"
    summary+=("$name: $(grep 'tokens/s' "$OUT/$name.log" | tail -1)")
    if [ -n "${EXAMPLE_PROFILE:-}" ]; then
      python3 benchmarks/producers.py "/tmp/$name" "/tmp/$name/step.hlo.txt" \
        --window train_step --fusions 25 > "$OUT/producers_$name.md" 2>&1
      python3 benchmarks/trace_summary.py "/tmp/$name" --window train_step --top 60 > "$OUT/trace_$name.txt" 2>&1
      summary+=("$(head -12 "$OUT/producers_$name.md")")
    fi
  done
fi
echo "==== summary"
printf '%s\n' "${summary[@]}"
