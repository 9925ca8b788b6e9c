#!/usr/bin/env bash
# Memory and time per optimizer step of a LoRA fine-tune (the `lora` example: frozen base,
# adapters on q_proj and v_proj) against a full fine-tune (the `llama` example) of the same model
# on the same data, side by side: interleaved rounds, one process each, medians printed.
#
#   cargo build --release -p accelerate-examples --examples
#   benchmarks/lora_vs_full.sh [ROUNDS] [STEPS]        # defaults: 3 rounds of 10 steps
#
# Size and flags: SIZE (default "--layers 4 --width 512 --heads 8 --kv-heads 4 --context 128"),
# BATCH (8), LORA ("--lora-r 8 --lora-alpha 16 --lora-targets q_proj,v_proj"). Peak memory is
# the process's maximum resident set (GNU time's %M); time per step is the example's own wall
# time of the training loop over its optimizer steps (start-up and model building excluded).
set -euo pipefail

rounds=${1:-3}
steps=${2:-10}
size=${SIZE:---layers 4 --width 512 --heads 8 --kv-heads 4 --context 128}
batch=${BATCH:-8}
lora=${LORA:---lora-r 8 --lora-alpha 16 --lora-targets q_proj,v_proj}
bin=${BIN_DIR:-target/release/examples}
gnu_time=${GNU_TIME:-/usr/bin/time}

for program in llama lora; do
  [[ -x $bin/$program ]] || { echo "$bin/$program is missing: cargo build --release -p accelerate-examples --examples" >&2; exit 1; }
done
[[ -x $gnu_time ]] || { echo "GNU time is needed at $gnu_time (apt-get install time), or set GNU_TIME" >&2; exit 1; }

results=$(mktemp)
trap 'rm -f "$results"' EXIT

# One run: prints "<program> <peak KiB> <ms per step> <parameters line>".
one_run() {
  local program=$1 extra=$2 out
  # shellcheck disable=SC2086  # the size and LoRA flags are word lists on purpose
  out=$("$gnu_time" -f 'peak_kib=%M' "$bin/$program" $size --batch-size "$batch" \
    --max-steps "$steps" --seed 1 $extra 2>&1)
  local peak wall done_steps
  peak=$(grep -o 'peak_kib=[0-9]*' <<<"$out" | cut -d= -f2)
  wall=$(grep -o 'wall=[0-9.]*' <<<"$out" | cut -d= -f2)
  done_steps=$(grep -o ' steps=[0-9]*' <<<"$out" | cut -d= -f2)
  echo "$program $peak $(awk -v w="$wall" -v s="$done_steps" 'BEGIN { printf "%.1f", 1000 * w / s }')"
  if [[ $program == lora || ${printed_full:-} != yes ]]; then
    grep '^model:\|^\[rank 0\] model:' <<<"$out" >&2 || true
  fi
}

for ((round = 1; round <= rounds; round++)); do
  one_run llama "" >>"$results"
  printed_full=yes
  one_run lora "$lora" >>"$results"
  echo "round $round/$rounds done" >&2
done

median() { sort -n | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

echo
echo "size: $size, batch $batch, $steps optimizer steps, $rounds rounds (medians)"
printf '%-28s %14s %14s\n' "run" "peak RSS MiB" "ms per step"
for program in llama lora; do
  peak=$(awk -v p="$program" '$1 == p { print $2 }' "$results" | median)
  ms=$(awk -v p="$program" '$1 == p { print $3 }' "$results" | median)
  label=$([[ $program == llama ]] && echo "full fine-tune (llama)" || echo "LoRA, frozen base (lora)")
  printf '%-28s %14.0f %14.1f\n' "$label" "$(awk -v k="$peak" 'BEGIN { print k / 1024 }')" "$ms"
done
