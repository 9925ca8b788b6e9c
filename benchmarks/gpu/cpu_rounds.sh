#!/usr/bin/env bash
# The CPU figures of BENCHMARKS.md's "GPU step vs PyTorch (issue 29)": bench_step against
# torch_step.py (eager) on the CPU, one thread each (RAYON_NUM_THREADS=1, torch.set_num_threads(1)),
# gpt2 and smollm shapes at a small size, f32, in ROUNDS interleaved rounds (the order of ours and
# PyTorch alternates from round to round); prints the medians and the per-round ratios.
#
#   benchmarks/gpu/cpu_rounds.sh [ROUNDS]
#
# Environment: BENCH_STEP (the bench_step binary, default $CARGO_TARGET_DIR/release/bench_step),
# PY (default target/torch-venv/bin/python, as `run.sh selftest` installs it), SIZE (default
# "--layers 4 --width 256 --heads 4 --vocab 4096"), BATCH (8), CONTEXT (256), WARMUP (1),
# STEPS (3), RESULTS (where the JSON lines go, default a temporary file).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
rounds=${1:-3}
bench_step=${BENCH_STEP:-${CARGO_TARGET_DIR:-target}/release/bench_step}
py=${PY:-target/torch-venv/bin/python}
results=${RESULTS:-$(mktemp)}
read -ra size <<<"${SIZE:---layers 4 --width 256 --heads 4 --vocab 4096}"
common=(--device cpu --mixed-precision no --batch-size "${BATCH:-8}" --context "${CONTEXT:-256}"
  --warmup "${WARMUP:-1}" --steps "${STEPS:-3}" "${size[@]}")
run() { # run ROUND NAME CMD...
  local round=$1 name=$2 log
  shift 2
  log=$(mktemp)
  if "$@" >"$log" 2>&1; then
    "$py" benchmarks/gpu/report.py record --results "$results" --name "$name-round$round" \
      --rc 0 --wall 0 --log "$log"
  else
    echo "cpu_rounds: $name failed in round $round:" >&2
    tail -5 "$log" >&2
  fi
  rm -f "$log"
}
for round in $(seq 1 "$rounds"); do
  for model in gpt2 smollm; do
    kv=()
    [ "$model" = smollm ] && kv=(--kv-heads 2)
    ours=(env RAYON_NUM_THREADS=1 "$bench_step" --model "$model" "${common[@]}" "${kv[@]}")
    theirs=("$py" benchmarks/torch_step.py --threads 1 --model "$model" "${common[@]}" "${kv[@]}")
    if [ $((round % 2)) = 1 ]; then
      run "$round" "ours-$model" "${ours[@]}"
      run "$round" "torch-$model" "${theirs[@]}"
    else
      run "$round" "torch-$model" "${theirs[@]}"
      run "$round" "ours-$model" "${ours[@]}"
    fi
  done
  echo "cpu_rounds: round $round of $rounds done" >&2
done
"$py" benchmarks/gpu/report.py compare --results "$results"
echo "cpu_rounds: JSON lines in $results" >&2
