#!/usr/bin/env bash
# The GPU step benchmark, ours against PyTorch on the same GPU, in one command (issue 29).
#
#   benchmarks/gpu/run.sh prepare    here, without a GPU: builds the CUDA binaries
#                                    (scripts/gpu-build.sh build) and packs those the GPU machine
#                                    runs into target/gpu-pack/bins.tar.xz (one xz dictionary,
#                                    ~15 MiB), the folder to name in the device tool's `carry`
#   benchmarks/gpu/run.sh device     on the GPU machine, in the repository root, with $OUT set:
#                                    unpacks, records the machine, runs the correctness suite, the
#                                    benchmark matrix, ncu and torch.profiler, and writes the
#                                    report, all within BUDGET_S seconds (default 450)
#   benchmarks/gpu/run.sh selftest   here, without a GPU: the device phase end to end on the CPU
#                                    with tiny models, nvidia-smi and ncu stubbed, then checks the
#                                    report and $OUT's limits
#   benchmarks/gpu/run.sh selftest-quick   the parts of selftest that take seconds: the
#                                    core-cuda step's script against stand-in test binaries,
#                                    and the pack's provenance check
#
# See benchmarks/gpu/README.md for the exact device-tool call and the time each step takes.
#
# Files under $OUT (at most 8, 16 MiB each, the device tool's limits): machine.txt, suite.log,
# bench.log, profile.txt, results.jsonl, results.md, status.tsv.
#
# Environment (device phase): BUDGET_S (450), PY (/opt/torch/.venv/bin/python3), NCU
# (/usr/local/cuda/bin/ncu), PACK (target/gpu-pack/bins.tar.xz), WORK (/tmp/bench-gpu), SKIP
# (names of steps not to run, space-separated; see results.md's step list for the names),
# BATCH (8), CONTEXT (1024), WARMUP_BF16/STEPS_BF16 (5/20), WARMUP_F32/STEPS_F32 (3/10),
# OPTIONAL_MIN_S (the least time left for an optional step to start, 100), CAP_SCALE (1; each
# step's own time limit is multiplied by it). The selftest sets BENCH_DEVICE=cpu, the tiny sizes
# and a CAP_SCALE of 10 (SELFTEST_CAP_SCALE: a shared 2-core machine compiles slowly) itself.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
PACK=${PACK:-$ROOT/target/gpu-pack/bins.tar.xz}

log() { echo "run.sh: $*" >&2; }

# The binaries the GPU machine runs: the benchmark, the launcher, and everything the GPU
# correctness suite runs (the integration tests' gpu:: tests launch the test worker and the
# examples from the folder above their binary's own; fused-kernels' cuda:: tests; the conformance
# suite; accelerate-core's lib tests, whose CUDA ones check the optimizer and gradient kernels).
BINARIES=(bench_step accelerate-launch accelerate accelerate-test-worker examples/mlp
  examples/gpt examples/llama)
# Test binaries, as NAME or NAME=SOURCE: the newest build of deps/NAME-<hash>. Every crate's
# integration tests are one binary named `integration`, so SOURCE (the root file of one crate's,
# relative to the repository) picks that crate's by the sources its dep-info file (the .d beside
# it) names, and it is staged as deps/NAME-<SOURCE's first folder>: deps/integration-tests
# (accelerate-tests') and deps/integration-fused-kernels.
TEST_BINARIES=(integration=tests/integration/main.rs
  integration=fused-kernels/tests/integration/main.rs accelerate_core)
# accelerate-core's GPU tests (ignored without a GPU), selected by these name filters, and how
# many of them there are: the multi-tensor conformance test of AdamW, SGD and Lion, the compute
# copies' rounding, the gradient kernel. Fewer passing means the filters missed some.
CORE_CUDA_FILTERS=(cuda gpu)
CORE_CUDA_TESTS=5

# source_hash [DIR]: one SHA-256 over the files the binaries are built from (Rust, CUDA C,
# headers, manifests, the lock file) under DIR (default .), in a fixed order: computable where
# there is no git, as on the GPU machine, whose working tree is a copy without .git.
source_hash() {
  (cd "${1:-.}" && find . \( -name target -o -name .git -o -name shared -o -name fuzz \) -prune \
    -o -type f \( -name '*.rs' -o -name '*.cu' -o -name '*.cuh' -o -name '*.h' \
    -o -name Cargo.toml -o -name Cargo.lock \) -print0 | LC_ALL=C sort -z \
    | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
}

# source_info: what the pack was built from, for source.txt in the pack: the commit, whether the
# tree differed from it (and a hash of that difference), and source_hash of the tree.
source_info() {
  local dirty=no
  [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && dirty=yes
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "dirty: $dirty"
  echo "diff-sha256: $(git diff HEAD 2>/dev/null | sha256sum | cut -d' ' -f1)"
  echo "untracked: $(git status --porcelain 2>/dev/null | grep -c '^??')"
  echo "source-sha256: $(source_hash)"
  echo "packed: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
}

# check_provenance SOURCE_TXT: lines for machine.txt comparing the pack's source.txt with this
# working tree; the last one starts with "pack matches", "PACK MISMATCH" or "PACK UNKNOWN".
# Returns 0, 1 or 2 accordingly.
check_provenance() {
  local src=$1 here_hash here_commit pack_hash pack_commit
  if [ ! -f "$src" ]; then
    echo "PACK UNKNOWN: no source.txt in the pack (built by an older run.sh?): nothing says which source its binaries are"
    return 2
  fi
  sed 's/^/pack source: /' "$src"
  here_hash=$(source_hash)
  here_commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
  echo "working tree: commit $here_commit, source-sha256 $here_hash"
  pack_hash=$(sed -n 's/^source-sha256: //p' "$src")
  pack_commit=$(sed -n 's/^commit: //p' "$src")
  if [ "$pack_hash" != "$here_hash" ]; then
    echo "PACK MISMATCH: the binaries were built from other sources (source-sha256 $pack_hash, commit $pack_commit) than this working tree's ($here_hash, commit $here_commit): run benchmarks/gpu/run.sh prepare again"
    return 1
  fi
  if [ "$here_commit" != unknown ] && [ "$pack_commit" != unknown ] && [ "$pack_commit" != "$here_commit" ]; then
    echo "PACK MISMATCH: same sources, but packed at commit $pack_commit and run at $here_commit"
    return 1
  fi
  echo "pack matches the working tree (source-sha256 $here_hash)"
}

# pack RELEASE_DIR OUT_FILE strict|lenient: stages the binaries (debug info stripped) under
# release/ and what they were built from in source.txt, and compresses them with one xz
# dictionary; `lenient` skips missing ones (selftest).
pack() {
  local release=$1 out=$2 mode=$3 stage missing=0
  stage=$(mktemp -d)
  mkdir -p "$stage/release/examples" "$stage/release/deps"
  source_info >"$stage/source.txt"
  for b in "${BINARIES[@]}"; do
    if [ -x "$release/$b" ]; then
      cp "$release/$b" "$stage/release/$b"
    else
      log "pack: $release/$b is missing"
      missing=1
    fi
  done
  for t in "${TEST_BINARIES[@]}"; do
    # The newest build of each test binary (older hashes may linger); no .d files.
    local p=${t%%=*} src="" newest
    [ "$t" = "$p" ] || src=${t#*=}
    newest=$(find "$release/deps" -maxdepth 1 -type f -executable -regextype posix-extended \
      -regex ".*/$p-[0-9a-f]{16}" -printf '%T@ %p\n' 2>/dev/null | sort -n \
      | while read -r time path; do
          # cargo names a workspace member's sources relative to the workspace root.
          [ -z "$src" ] || grep -qF -e " $src" -e " $ROOT/$src" "$path.d" 2>/dev/null \
            && echo "$time $path"
        done | tail -1 | cut -d' ' -f2-)
    if [ -n "$newest" ] && [ -n "$src" ]; then
      cp "$newest" "$stage/release/deps/$p-${src%%/*}"
    elif [ -n "$newest" ]; then
      cp "$newest" "$stage/release/deps/"
    else
      log "pack: no $release/deps/$p-<hash> test binary${src:+ built from $src}"
      missing=1
    fi
  done
  if [ "$missing" = 1 ] && [ "$mode" = strict ]; then
    rm -rf "$stage"
    log "pack: binaries missing; run scripts/gpu-build.sh build first"
    return 1
  fi
  find "$stage/release" -type f -exec strip --strip-debug {} + 2>/dev/null || true
  mkdir -p "$(dirname "$out")"
  # One dictionary over all of them: each embeds the same PTX of candle's kernels.
  tar -C "$stage" -cf - source.txt release | xz -T1 "--lzma2=preset=6,dict=${XZ_DICT:-512MiB}" > "$out.tmp" \
    && mv "$out.tmp" "$out"
  local rc=$?
  du -sh "$stage/release" | sed 's/^/pack: staged /' >&2
  rm -rf "$stage"
  [ "$rc" = 0 ] || return "$rc"
  local size
  size=$(stat -c %s "$out")
  log "pack: $out, $((size / 1024 / 1024)) MiB"
  if [ "$size" -gt $((48 * 1024 * 1024)) ]; then
    log "pack: over 48 MiB; the device tool carries 64 MiB with the working tree"
    return 1
  fi
}

prepare() {
  local target=${CUDA_TARGET_DIR:-$ROOT/target/cuda} before
  before=$(source_hash)
  CUDA_TARGET_DIR=$target scripts/gpu-build.sh build || return 1
  pack "$target/release" "$PACK" strict || return 1
  # source.txt describes the tree as it was when packing: it must be the one that was built.
  if [ "$(source_hash)" != "$before" ]; then
    log "prepare: the sources changed while building or packing; run prepare again"
    return 1
  fi
  source_info | sed 's/^/prepare: pack source: /' >&2
  git check-ignore -q "$PACK" || { log "$PACK is not ignored by git"; return 1; }
  log "prepare: done; carry $(dirname "${PACK#"$ROOT"/}") in the device tool's call"
}

# ---------------------------------------------------------------------------------------------
# The device phase.

# step NAME CAP_S MIN_S LOG CMD...: runs CMD under `timeout` (CAP_S, or what the budget leaves)
# with its output in $WORK/NAME.log, appended to LOG; one status line in $STATUS. Skipped when
# less than MIN_S seconds of the budget are left. Returns CMD's exit status (99 when skipped).
step() {
  local name=$1 cap=$2 min=$3 logf=$4
  shift 4
  local left=$((DEADLINE - $(date +%s) - RESERVE_S))
  if [[ " ${SKIP:-} " == *" $name "* ]]; then
    printf '%s\tskipped\t-\t0\tnamed in SKIP\n' "$name" >>"$STATUS"
    echo "== $name: skipped (SKIP)" >>"$logf"
    return 99
  fi
  if [ "$left" -lt "$min" ]; then
    printf '%s\tskipped\t-\t0\t%s s of the budget left, %s needed\n' "$name" "$left" "$min" >>"$STATUS"
    echo "== $name: skipped ($left s left, $min needed)" >>"$logf"
    return 99
  fi
  cap=$((cap * CAP_SCALE))
  local limit=$((cap < left ? cap : left))
  echo "== $name (limit ${limit} s): $*" >>"$logf"
  local t0 t1 rc status note
  t0=$(date +%s.%N)
  timeout -k 10 "$limit" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  cat "$WORK/$name.log" >>"$logf"
  case $rc in
    0) status=passed ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  # cargo test's summary lines, if any, say how many tests passed.
  note=$(grep -E '^test result:' "$WORK/$name.log" | sed 's/test result: //' | paste -sd ';' -)
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" \
    "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')" "$note" >>"$STATUS"
  echo "== $name: $status (exit $rc)" >>"$logf"
  return "$rc"
}

# bench NAME CAP_S MIN_S CMD...: one benchmark run under step, with nvidia-smi polling the
# device memory in use meanwhile; its JSON line goes to results.jsonl and the table is rewritten.
bench() {
  local name=$1 cap=$2 min=$3
  shift 3
  local smi=$WORK/$name.smi smi_pid=
  : >"$smi"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --id=0 --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 \
      >"$smi" 2>/dev/null &
    smi_pid=$!
    sleep 0.3
  fi
  local t0 rc
  t0=$(date +%s)
  step "$name" "$cap" "$min" "$OUT/bench.log" "$@"
  rc=$?
  if [ -n "$smi_pid" ]; then
    kill "$smi_pid" 2>/dev/null
    wait "$smi_pid" 2>/dev/null
  fi
  if [ "$rc" != 99 ]; then
    "$PY" benchmarks/gpu/report.py record --results "$OUT/results.jsonl" --name "$name" \
      --rc "$rc" --wall "$(($(date +%s) - t0))" --log "$WORK/$name.log" --smi "$smi"
  fi
  tabulate
  return "$rc"
}

tabulate() {
  cp "$STATUS" "$OUT/status.tsv"
  "$PY" benchmarks/gpu/report.py table --results "$OUT/results.jsonl" --status "$STATUS" \
    --machine "$OUT/machine.txt" --out "$OUT/results.md" || log "the report failed"
  # accelerate-core's runtime-compiled kernels fall back to candle's tensor ops, with a warning,
  # when NVRTC cannot compile them on the machine: then "ours" timed the fallback. Say so first.
  local fallbacks
  fallbacks=$(cat "$OUT/bench.log" "$OUT/suite.log" 2>/dev/null \
    | grep -c "using candle's tensor ops instead")
  if [ "$fallbacks" -gt 0 ] && [ -f "$OUT/results.md" ]; then
    { printf '**WARNING: %s run(s) used the tensor-op fallback of the fused optimizer or ' "$fallbacks"
      printf 'gradient kernels (NVRTC failed; see bench.log): their times are not the kernels'"'"'.**\n\n'
      cat "$OUT/results.md"; } >"$OUT/results.md.new" && mv "$OUT/results.md.new" "$OUT/results.md"
  fi
}

machine_info() {
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "kernel: $(uname -srm)"
    echo "cpus: $(nproc), memory: $(free -g | awk '/Mem:/ {print $2 " GiB"}')"
    echo "candle PTX cache before the run: $(du -sh ~/.nv/ComputeCache 2>/dev/null | cut -f1 || echo none)"
    if command -v nvidia-smi >/dev/null; then
      timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm \
        --format=csv 2>&1
      timeout 20 nvidia-smi 2>&1
    else
      echo "nvidia-smi: not found"
    fi
    timeout 60 "$PY" -c 'import torch, accelerate, transformers, sys
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "accelerate", accelerate.__version__, "transformers", transformers.__version__)' 2>&1
    [ -x "$NCU" ] && timeout 20 "$NCU" --version 2>&1 | tail -1
  } >"$OUT/machine.txt"
}

device() {
  : "${OUT:?the device tool sets OUT; run this on the GPU machine (or use selftest)}"
  BUDGET_S=${BUDGET_S:-450}
  RESERVE_S=${RESERVE_S:-10}
  DEADLINE=$(($(date +%s) + BUDGET_S))
  DEV=${BENCH_DEVICE:-cuda}
  PY=${PY:-/opt/torch/.venv/bin/python3}
  NCU=${NCU:-/usr/local/cuda/bin/ncu}
  WORK=${WORK:-/tmp/bench-gpu}
  OPTIONAL_MIN_S=${OPTIONAL_MIN_S:-100}
  CAP_SCALE=${CAP_SCALE:-1}
  rm -rf "$WORK"
  mkdir -p "$WORK" "$OUT"
  STATUS=$WORK/status.tsv
  : >"$STATUS"
  : >"$OUT/results.jsonl"
  : >"$OUT/suite.log"
  : >"$OUT/bench.log"
  : >"$OUT/profile.txt"
  BIN=$WORK/release
  machine_info
  tabulate

  # Our binaries load CUDA's and NCCL's libraries from the torch venv's wheels and the driver's
  # libcuda (shared/gpu/PROFILE.md).
  local site ours_env
  site=$(echo "$(dirname "$PY")"/../lib/python3*/site-packages)
  ours_env=(env "LD_LIBRARY_PATH=$site/nvidia/cu13/lib:$site/nvidia/nccl/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
  [ "$DEV" = cpu ] && ours_env=(env RAYON_NUM_THREADS=1)

  step unpack 60 5 "$OUT/suite.log" bash -c "xz -dc '$PACK' | tar -x -C '$WORK'" || {
    tabulate
    return 1
  }
  # Which source the binaries were built from, against this working tree (results.md warns at
  # its top when they differ).
  check_provenance "$WORK/source.txt" >>"$OUT/machine.txt" || log "$(tail -1 "$OUT/machine.txt")"
  tabulate

  # Sizes: GPT-2 124M and SmolLM-135M, or the selftest's tiny ones.
  local batch=${BATCH:-8} context=${CONTEXT:-1024}
  local gpt smol
  read -ra gpt <<<"--model gpt2 ${GPT_SIZE:-}"
  read -ra smol <<<"--model smollm ${SMOL_SIZE:-}"
  local common=(--device "$DEV" --batch-size "$batch" --context "$context")
  local bf16=(--mixed-precision bf16 --warmup "${WARMUP_BF16:-5}" --steps "${STEPS_BF16:-20}")
  local f32=(--mixed-precision no --warmup "${WARMUP_F32:-3}" --steps "${STEPS_F32:-10}")
  local torch_cpu=()
  [ "$DEV" = cpu ] && torch_cpu=(--threads 1)
  local ours=("${ours_env[@]}" "$BIN/bench_step")
  local torch=("$PY" benchmarks/torch_step.py "${torch_cpu[@]}")

  # (1) The first launch of our binaries on a fresh machine JIT-compiles candle's PTX (~14 s,
  # cached in ~/.nv/ComputeCache afterwards): one short run of each model warms the cache, so
  # that neither the suite's timeouts nor the timings pay it.
  step jit-warmup 120 30 "$OUT/suite.log" bash -c "$(printf '%q ' "${ours[@]}") --model gpt2 \
    --layers 1 --width 64 --heads 2 --vocab 256 --context 64 --batch-size 2 --warmup 1 --steps 1 \
    --peak-size 256 --device $DEV && $(printf '%q ' "${ours[@]}") --model smollm --layers 1 \
    --width 64 --heads 2 --kv-heads 1 --vocab 256 --context 64 --batch-size 2 --warmup 1 \
    --steps 1 --peak-size 256 --device $DEV --mixed-precision no"

  # (2) The correctness suite, first; a failure is recorded and the benchmark runs anyway.
  if [ "$DEV" = cpu ]; then
    # Stand-ins that pass, fail and overrun, to exercise the recording.
    step suite-pass 30 5 "$OUT/suite.log" "$BIN/bench_step" --help
    step suite-fail 30 5 "$OUT/suite.log" "$BIN/bench_step" --model nope
    step suite-timeout 1 1 "$OUT/suite.log" sleep 300
  else
    step fused-kernels-cuda 90 20 "$OUT/suite.log" "${ours_env[@]}" \
      "$BIN/deps/integration-fused-kernels" cuda:: --ignored --test-threads=1
    step core-cuda 60 15 "$OUT/suite.log" "${ours_env[@]}" bash -c "$(core_cuda_script)"
    step gpu-suite 150 40 "$OUT/suite.log" "${ours_env[@]}" \
      "$BIN/deps/integration-tests" gpu:: --test-threads=1 --nocapture
    step nccl-conformance 90 20 "$OUT/suite.log" "${ours_env[@]}" \
      "$BIN/deps/integration-tests" conformance:: --test-threads=1 --nocapture
  fi

  # (3) The matrix, one process: ours, then PyTorch eager (with torch.profiler over 2 steps).
  local p=$WORK/torch-profile
  bench ours-gpt2-bf16 90 20 "${ours[@]}" "${gpt[@]}" "${common[@]}" "${bf16[@]}"
  bench torch-eager-gpt2-bf16 120 30 "${torch[@]}" "${gpt[@]}" "${common[@]}" "${bf16[@]}" \
    --mode eager --profile-steps 2 --profile-out "$p-eager-gpt2-bf16.txt"
  bench ours-smollm-bf16 90 20 "${ours[@]}" "${smol[@]}" "${common[@]}" "${bf16[@]}"
  bench torch-eager-smollm-bf16 120 30 "${torch[@]}" "${smol[@]}" "${common[@]}" "${bf16[@]}" \
    --mode eager --profile-steps 2 --profile-out "$p-eager-smollm-bf16.txt"
  bench ours-gpt2-f32 90 20 "${ours[@]}" "${gpt[@]}" "${common[@]}" "${f32[@]}"
  bench torch-eager-gpt2-f32 120 30 "${torch[@]}" "${gpt[@]}" "${common[@]}" "${f32[@]}" \
    --mode eager
  bench ours-smollm-f32 90 20 "${ours[@]}" "${smol[@]}" "${common[@]}" "${f32[@]}"
  bench torch-eager-smollm-f32 120 30 "${torch[@]}" "${smol[@]}" "${common[@]}" "${f32[@]}" \
    --mode eager
  # Two ranks on the one GPU (NCCL; on the CPU, two CPU processes).
  local launch=("${ours_env[@]}" "$BIN/accelerate-launch" --num-gpus 1 --ranks-per-gpu 2)
  [ "$DEV" = cpu ] && launch=("${ours_env[@]}" "$BIN/accelerate-launch" --cpu --num-processes 2)
  # Stage 0 named, so that no ACCELERATE_ZERO_STAGE in the environment changes it: this row and
  # the next (DDP) are also the stage-0 rows of the sharded comparison in (6).
  bench ours-gpt2-bf16-2ranks 120 30 "${launch[@]}" "$BIN/bench_step" "${gpt[@]}" \
    "${common[@]}" "${bf16[@]}" --zero-stage 0
  bench torch-eager-gpt2-bf16-2ranks 150 40 "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node 2 benchmarks/torch_step.py "${torch_cpu[@]}" "${gpt[@]}" "${common[@]}" \
    "${bf16[@]}" --mode eager

  # PyTorch's own fused AdamW (one kernel per step, as ours) beside its default foreach one.
  bench torch-eager-gpt2-bf16-fused-adamw 120 30 "${torch[@]}" "${gpt[@]}" "${common[@]}" \
    "${bf16[@]}" --mode eager --fused-adamw

  # (4) ncu over 2 steady-state steps of ours (kernel launches per step, the per-kernel table).
  ncu_profile ncu-ours-gpt2-bf16 150 40 "${gpt[@]}" --mixed-precision bf16

  # (5) torch.compile last: compiling takes longest (bf16 first; f32 only if time is left).
  bench torch-compile-gpt2-bf16 240 90 "${torch[@]}" "${gpt[@]}" "${common[@]}" "${bf16[@]}" \
    --mode compile --profile-steps 2 --profile-out "$p-compile-gpt2-bf16.txt"
  bench torch-compile-smollm-bf16 240 90 "${torch[@]}" "${smol[@]}" "${common[@]}" "${bf16[@]}" \
    --mode compile --profile-steps 2 --profile-out "$p-compile-smollm-bf16.txt"

  # (6) Sharded, after every required step above so that a short budget gets those first (the
  # optional ones below take what is left): ours at ZeRO stages 3 and 2 and PyTorch's FSDP2 on
  # the 2 ranks of (3), with its arguments; ours-gpt2-bf16-2ranks (stage 0) and
  # torch-eager-gpt2-bf16-2ranks (DDP) are their stage-0 rows. Stage 3 and FSDP2 first.
  bench ours-gpt2-bf16-2ranks-zero3 150 40 "${launch[@]}" "$BIN/bench_step" "${gpt[@]}" \
    "${common[@]}" "${bf16[@]}" --zero-stage 3
  bench torch-fsdp2-gpt2-bf16-2ranks 150 40 "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node 2 benchmarks/torch_step.py "${torch_cpu[@]}" "${gpt[@]}" "${common[@]}" \
    "${bf16[@]}" --mode eager --fsdp2
  bench ours-gpt2-bf16-2ranks-zero2 120 30 "${launch[@]}" "$BIN/bench_step" "${gpt[@]}" \
    "${common[@]}" "${bf16[@]}" --zero-stage 2

  bench torch-compile-gpt2-f32 200 "$OPTIONAL_MIN_S" "${torch[@]}" "${gpt[@]}" "${common[@]}" \
    "${f32[@]}" --mode compile
  bench torch-compile-smollm-f32 200 "$OPTIONAL_MIN_S" "${torch[@]}" "${smol[@]}" \
    "${common[@]}" "${f32[@]}" --mode compile
  ncu_profile ncu-ours-smollm-bf16 150 "$OPTIONAL_MIN_S" "${smol[@]}" --mixed-precision bf16

  for f in "$p"-*.txt; do
    [ -f "$f" ] || continue
    { echo; echo "## torch.profiler: $(basename "$f" .txt)"; echo; cat "$f"; } >>"$OUT/profile.txt"
  done
  tabulate
  limit_out
  log "device: done in $(($(date +%s) - DEADLINE + BUDGET_S)) s; $OUT/results.md"
  cat "$OUT/results.md"
}

# The core-cuda step's script: accelerate-core's lib test binary, its ignored (GPU) tests of the
# CUDA kernels one at a time, failing also when fewer than CORE_CUDA_TESTS of them passed (a
# filter that matches nothing passes 0 tests and exits 0).
core_cuda_script() {
  local bin
  bin=$(find "$BIN/deps" -maxdepth 1 -name 'accelerate_core-*' -type f | head -1)
  cat <<EOF
set -o pipefail
[ -x '$bin' ] || { echo "core-cuda: no accelerate_core-<hash> test binary in the pack"; exit 2; }
'$bin' --ignored --test-threads=1 ${CORE_CUDA_FILTERS[*]} 2>&1 | tee '$WORK/core-cuda.out' || exit \$?
passed=\$(sed -nE 's/^test result: ok\. ([0-9]+) passed.*/\1/p' '$WORK/core-cuda.out' | tail -1)
[ "\${passed:-0}" -ge $CORE_CUDA_TESTS ] || {
  echo "core-cuda: \${passed:-0} tests passed, $CORE_CUDA_TESTS expected (the filters ${CORE_CUDA_FILTERS[*]} missed some)"
  exit 3
}
EOF
}

# ncu_profile NAME CAP MIN MODEL_ARGS...: ours under ncu, --profile-steps 2 after 2 warm-up
# steps and 1 timed one; the parsed per-kernel table and ncu's raw output go to profile.txt.
ncu_profile() {
  local name=$1 cap=$2 min=$3
  shift 3
  local batch=${BATCH:-8} context=${CONTEXT:-1024} steps=2
  step "$name" "$cap" "$min" "$OUT/bench.log" "${ours_env[@]}" "$NCU" --clock-control none \
    --metrics gpu__time_duration.sum --print-summary per-kernel --profile-from-start off \
    "$BIN/bench_step" "$@" --device "$DEV" --batch-size "$batch" --context "$context" \
    --warmup 2 --steps 1 --profile-steps "$steps"
  local rc=$?
  [ "$rc" = 99 ] && { tabulate; return 99; }
  "$PY" benchmarks/gpu/report.py record-ncu --results "$OUT/results.jsonl" --name "$name" \
    --raw "$WORK/$name.log" --steps "$steps"
  {
    echo "## ours under ncu: $name ($*), $steps profiled steps"
    echo
    "$PY" benchmarks/gpu/ncu_summary.py "$WORK/$name.log" "$steps" 2>&1
    echo
    echo "### ncu's raw output"
    echo
    cat "$WORK/$name.log"
    echo
  } >>"$OUT/profile.txt"
  tabulate
}

# The device tool brings back at most 8 files of at most 16 MiB, 2 folders deep, named in
# letters, digits, '.', '_' and '-': keep the logs' ends if one grew too large, and say so if
# anything else breaks the rule.
limit_out() {
  local f size
  for f in "$OUT"/*; do
    size=$(stat -c %s "$f")
    if [ "$size" -gt $((15 * 1024 * 1024)) ]; then
      tail -c $((15 * 1024 * 1024)) "$f" >"$f.tail" && mv "$f.tail" "$f"
      log "$f was $size bytes; kept its last 15 MiB"
    fi
  done
  local count
  count=$(find "$OUT" -type f | wc -l)
  [ "$count" -le 8 ] || log "OUT holds $count files; the device tool brings back 8"
  find "$OUT" -mindepth 1 | grep -vE "^$OUT(/[A-Za-z0-9._-]+){1,3}$" | sed 's/^/bad name: /' >&2
}

# ---------------------------------------------------------------------------------------------
# The selftest: the device phase on the CPU.

# The core-cuda step's script against stand-ins of the test binary: all tests passing, a filter
# that matched nothing (0 passed, exit 0), a failing test, no binary.
selftest_core_cuda() {
  local tmp rc want name out
  tmp=$(mktemp -d)
  mkdir -p "$tmp/deps"
  for want in "5 0" "0 3" "fail 101" "none 2"; do
    read -r name rc <<<"$want"
    rm -f "$tmp/deps/"*
    case $name in
      fail) printf '#!/bin/sh\necho "test x ... FAILED"; echo "test result: FAILED. 4 passed; 1 failed"; exit 101\n' ;;
      none) ;;
      *) printf '#!/bin/sh\necho "args: $*"; echo "test result: ok. %s passed; 0 failed; 0 ignored"\n' "$name" ;;
    esac >"$tmp/script"
    [ "$name" = none ] || install -m 755 "$tmp/script" "$tmp/deps/accelerate_core-0123456789abcdef"
    out=$(BIN=$tmp WORK=$tmp bash -c "$(BIN=$tmp WORK=$tmp core_cuda_script)" 2>&1)
    local got=$?
    if [ "$got" != "$rc" ]; then
      log "selftest: core-cuda with a binary passing '$name' exited $got, expected $rc: $out"
      rm -rf "$tmp"
      return 1
    fi
    if [ "$name" = 5 ] && ! grep -qF -- "args: --ignored --test-threads=1 ${CORE_CUDA_FILTERS[*]}" <<<"$out"; then
      log "selftest: core-cuda ran the binary with other arguments: $out"
      rm -rf "$tmp"
      return 1
    fi
  done
  rm -rf "$tmp"
  log "selftest: the core-cuda step passes 5 tests, fails on 0, a failure or no binary: ok"
}

# check_provenance against source.txt files: this tree's own, one of other sources, and none.
selftest_provenance() {
  local tmp out rc
  tmp=$(mktemp -d)
  source_info >"$tmp/same.txt"
  sed 's/^source-sha256: .*/source-sha256: 0000/' "$tmp/same.txt" >"$tmp/other.txt"
  for want in "same 0 pack matches" "other 1 PACK MISMATCH" "none 2 PACK UNKNOWN"; do
    read -r name rc verdict <<<"$want"
    out=$(check_provenance "$tmp/$name.txt")
    local got=$?
    if [ "$got" != "$rc" ] || [[ "$(tail -1 <<<"$out")" != "$verdict"* ]]; then
      log "selftest: check_provenance of the '$name' source.txt exited $got, expected $rc ($verdict): $out"
      rm -rf "$tmp"
      return 1
    fi
  done
  rm -rf "$tmp"
  log "selftest: check_provenance tells this tree's pack, another's, and none: ok"
}

selftest() {
  selftest_core_cuda && selftest_provenance || return 1
  local target=${CARGO_TARGET_DIR:-$ROOT/target}
  # Both binaries named: `--bin bench_step` alone would leave the launcher's unbuilt.
  cargo build --release -p accelerate-benchmarks -p accelerate-launch --bin bench_step \
    --bin accelerate-launch || return 1
  local venv=$ROOT/target/torch-venv
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import torch, accelerate, transformers' 2>/dev/null; then
    log "selftest: installing torch 2.11, accelerate 1.15, transformers 5.17 into $venv (the GPU machine's versions)"
    python3 -m venv "$venv" && "$venv/bin/pip" install -q torch==2.11.0 accelerate==1.15.0 \
      transformers==5.17.0 numpy || return 1
  fi
  local tmp
  tmp=$(mktemp -d)
  mkdir -p "$tmp/stubs" "$tmp/out" "$tmp/pack"
  # nvidia-smi: a GPU whose memory in use climbs by 10 MiB per sample (no -L list, so that
  # nothing takes this machine for a GPU one).
  cat >"$tmp/stubs/nvidia-smi" <<'EOF'
#!/usr/bin/env bash
case "$*" in
  *-lms*) i=0; while true; do echo $((500 + 10 * i)); i=$((i + 1)); sleep 0.1; done ;;
  *--query-gpu=name*) echo "name, driver_version, memory.total [MiB], compute_cap, clocks.max.sm [MHz]"
                      echo "Stub GPU, 0.0, 1000 MiB, 0.0, 0 MHz" ;;
  *-L*) ;;
  *) echo "stub nvidia-smi (selftest)" ;;
esac
EOF
  # ncu: runs the program (its options dropped), then prints a per-kernel summary in ncu's
  # format with 7 launches per profiled step (4 + 2 + 1 over --profile-steps K steps).
  cat >"$tmp/stubs/ncu" <<'EOF'
#!/usr/bin/env bash
[ "${1:-}" = --version ] && { echo "stub ncu"; exit 0; }
while [ $# -gt 0 ]; do
  case $1 in
    --clock-control|--metrics|--print-summary|--profile-from-start|--target-processes) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
k=0; prev=
for a in "$@"; do [ "$prev" = --profile-steps ] && k=$a; prev=$a; done
"$@" || exit $?
echo "==PROF== Disconnected from process $$"
entry() {
  printf '  %s (%s)x(256, 1, 1), Device 0, CC 9.0, Invocations %d\n' "$1" "$2" "$3"
  printf '    Section: Command line profiler metrics\n'
  printf '    ---------------------- ----------- ------- ------- -------\n'
  printf '    Metric Name            Metric Unit Minimum Maximum Average\n'
  printf '    ---------------------- ----------- ------- ------- -------\n'
  printf '    gpu__time_duration.sum          us    1.00    3.00    %s\n' "$4"
  printf '    ---------------------- ----------- ------- ------- -------\n\n'
}
entry badd_bf16 "4, 1, 1" $((3 * k)) 2.00
entry badd_bf16 "8, 1, 1" $((1 * k)) 4.00
entry "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(T1::Params)" "12, 1, 1" $((2 * k)) 10.00
entry adamw_f32 "3, 1, 1" $((1 * k)) 1.50
EOF
  chmod +x "$tmp/stubs/"*
  XZ_DICT=64MiB pack "$target/release" "$tmp/pack/bins.tar.xz" lenient || return 1
  local tiny="--layers 2 --width 64 --heads 4 --vocab 256"
  OUT=$tmp/out PACK=$tmp/pack/bins.tar.xz WORK=$tmp/work PATH="$tmp/stubs:$PATH" \
    NCU=$tmp/stubs/ncu BENCH_DEVICE=cpu PY="$venv/bin/python" BUDGET_S=${SELFTEST_BUDGET_S:-5400} \
    CAP_SCALE=${SELFTEST_CAP_SCALE:-10} OPTIONAL_MIN_S=1000000 BATCH=4 CONTEXT=32 GPT_SIZE="$tiny" SMOL_SIZE="$tiny --kv-heads 2" \
    WARMUP_BF16=1 STEPS_BF16=3 WARMUP_F32=1 STEPS_F32=3 device || return 1
  local expect="passed,passed,passed,failed,timeout"
  expect+=",passed,passed,passed,passed,passed,passed,passed,passed,passed,passed,passed"
  expect+=",passed,passed,passed,passed,passed,passed,skipped,skipped,skipped"
  # 16 runs; the sharded ones (stages 3 and 2, FSDP2) each agree on the loss with stage 0 (DDP).
  "$venv/bin/python" benchmarks/gpu/report.py check --results "$tmp/out/results.jsonl" \
    --status "$tmp/out/status.tsv" --expect-runs 16 --expect-statuses "$expect" \
    --expect-launches 7 --expect-loss-agreements 3 || return 1
  "$venv/bin/python" benchmarks/gpu/ncu_summary.py --self-test || return 1
  # The report's awkward rows (a non-finite loss, ...), which the tiny runs above do not produce.
  "$venv/bin/python" benchmarks/gpu/report.py self-test || return 1
  # The device tool's limits on what comes back.
  local files bad
  files=$(find "$tmp/out" -type f | wc -l)
  bad=$(find "$tmp/out" -type f -size +16M | wc -l)
  [ "$files" -le 8 ] && [ "$bad" = 0 ] || { log "selftest: $files files in OUT, $bad over 16 MiB"; return 1; }
  find "$tmp/out" -mindepth 1 | grep -vE "^$tmp/out(/[A-Za-z0-9._-]+){1,3}$" && {
    log "selftest: names the device tool would not bring back"
    return 1
  }
  grep -q "^Binaries built from this working tree" "$tmp/out/results.md" || {
    log "selftest: results.md does not say that the pack matches the working tree"
    return 1
  }
  local row
  for row in "gpt2 (2x64) bf16, 1 rank(s), batch 4 x 32 | ours" \
    "smollm (2x64) f32, 1 rank(s), batch 4 x 32 | torch eager" \
    "gpt2 (2x64) bf16, 2 rank(s), batch 4 x 32 | ours" \
    "smollm (2x64) bf16, 1 rank(s), batch 4 x 32 | torch compile" \
    "gpt2 (2x64) bf16, 1 rank(s), batch 4 x 32 | torch eager, fused AdamW" \
    "gpt2 (2x64) bf16, 2 rank(s), batch 4 x 32 | ours, ZeRO 3" \
    "gpt2 (2x64) bf16, 2 rank(s), batch 4 x 32 | torch eager, FSDP2" \
    "gpt2 (2x64) bf16, 2 rank(s), batch 4 x 32 | ours | ZeRO 0" \
    "gpt2 (2x64) bf16, 2 rank(s), batch 4 x 32 | ours | ZeRO 2" \
    "gpt2 (2x64) bf16, 2 rank(s), batch 4 x 32 | torch eager | DDP" \
    "gpt2 (2x64) bf16, 2 rank(s), batch 4 x 32 | ZeRO 3 / FSDP2"; do
    grep -qF "| $row |" "$tmp/out/results.md" || {
      log "selftest: results.md lacks the row '$row'"
      return 1
    }
  done
  log "selftest: passed ($files files in OUT: $(find "$tmp/out" -type f -printf '%f ')); report in $tmp/out/results.md"
}

case "${1:-}" in
  selftest-quick) selftest_core_cuda && selftest_provenance ;;
  prepare) prepare ;;
  device) device ;;
  selftest) selftest ;;
  *)
    echo "usage: benchmarks/gpu/run.sh prepare|device|selftest|selftest-quick" >&2
    exit 2
    ;;
esac
