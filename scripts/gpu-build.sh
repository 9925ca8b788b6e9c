#!/usr/bin/env bash
# Compiles the GPU code (`--features nccl`: candle's CUDA backend and NCCL) on a machine without a
# GPU or a CUDA installation, with NVIDIA's toolchain from Python wheels.
#
#   scripts/gpu-build.sh check   type-checks (clippy, -D warnings) every target with `--features nccl`
#                                (what CI runs; it turns on fused-kernels/cuda, whose build script
#                                compiles the CUDA C of fused-kernels/src/cuda with nvcc)
#   scripts/gpu-build.sh build   also links release binaries (examples, benchmarks, GPU tests:
#                                tests/integration/gpu.rs, the integration suite, fused-kernels' and
#                                accelerate-core's; the launcher) against a stub libcuda; copy them
#                                to a GPU machine and run them there (see docs/src/gpus.md, "GPU tests")
#
# Environment: CUDA_VENV (default target/cuda-venv) holds the wheels; CUDA_TARGET_DIR (default
# target/cuda) keeps the CUDA build apart from the CPU one; CUDA_COMPUTE_CAP (default 90, Hopper);
# CHECK_RELEASE=1 type-checks with --release, which reuses the dependencies (and candle's nvcc
# build of its kernels) of a target dir that only `build` has filled.
#
# The wheel versions must agree with each other (a newer nvvm than nvcc fails with "Unsupported
# .version"), and the toolkit must not be newer than the driver of the machine that runs the
# binaries: PTX from a newer nvcc does not load on an older driver. 13.0 runs on driver 580.
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-check}"
CUDA_VERSION_PIN="${CUDA_VERSION_PIN:-13.0.88}"
venv="${CUDA_VENV:-$PWD/target/cuda-venv}"
export CARGO_TARGET_DIR="${CUDA_TARGET_DIR:-$PWD/target/cuda}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"

if [ ! -x "$venv/bin/nvcc-ok" ]; then
  echo "gpu-build: installing NVIDIA's CUDA $CUDA_VERSION_PIN wheels into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check \
    "nvidia-cuda-nvcc==$CUDA_VERSION_PIN" "nvidia-nvvm==$CUDA_VERSION_PIN" \
    "nvidia-cuda-crt==$CUDA_VERSION_PIN" "nvidia-cuda-runtime==$CUDA_VERSION_PIN" \
    "nvidia-cuda-nvrtc==$CUDA_VERSION_PIN" "nvidia-cuda-cccl==13.0.85" \
    "nvidia-cublas<13.1" "nvidia-curand<10.4.1" "nvidia-nccl-cu13==2.27.7"
  touch "$venv/bin/nvcc-ok" && chmod +x "$venv/bin/nvcc-ok"
fi
site="$(echo "$venv"/lib/python3*/site-packages/nvidia)"
cuda="$site/cu13"
export PATH="$cuda/bin:$PATH" CUDA_ROOT="$cuda" CUDA_PATH="$cuda"
nvcc --version | tail -2

case "$mode" in
  check)
    profile=()
    [ "${CHECK_RELEASE:-0}" = 1 ] && profile=(--release)
    cargo clippy "${profile[@]}" --workspace --all-targets --features nccl -- -D warnings
    # accelerate-core's kernels are compiled at run time by NVRTC, which nothing above runs:
    # compile them here as NVRTC does (device code only, no host headers, contraction off), so an
    # error in their source fails CI instead of the first GPU run.
    for source in accelerate-core/src/cuda/accumulate.cu accelerate-core/src/optim/cuda/multi_tensor.cu; do
      nvcc --ptx -arch=compute_75 --fmad=false -o /dev/null "$source"
    done
    echo "gpu-build: --features nccl type-checks, clippy clean, NVRTC's sources compile"
    ;;
  build)
    # The linker needs unversioned names (the wheels ship libcublas.so.13 and the like) and a
    # libcuda, which only a GPU driver installs: a stub holding every driver symbol cudarc binds
    # stands in for it at link time; the real one is loaded at run time.
    links="$CARGO_TARGET_DIR/cuda-link"
    mkdir -p "$links"
    for lib in "$cuda"/lib/lib{cublas,cublasLt,cudart,curand,nvrtc}.so.* "$site"/nccl/lib/libnccl.so.2; do
      ln -sf "$lib" "$links/$(basename "$lib" | sed 's/\.so\..*/.so/')"
    done
    cudarc="$(cargo metadata --format-version 1 --features nccl \
      | python3 -c 'import json,sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"]=="cudarc"))')"
    grep -oE "fn cu[A-Z][A-Za-z0-9_]*" "$(dirname "$cudarc")/src/driver/sys/mod.rs" | sort -u \
      | sed 's/^fn \(.*\)/void \1(void) {}/' > "$links/libcuda_stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$links/libcuda.so" "$links/libcuda_stub.c"
    export RUSTFLAGS="${RUSTFLAGS:-} -L native=$links"
    cargo build --release -p accelerate-examples --features nccl --examples
    cargo build --release -p accelerate-benchmarks --features nccl --bins
    # fused-kernels' GPU tests (tests/integration/cuda.rs) and accelerate-core's (its lib tests: the optimizer
    # and gradient kernels) come with the suite's; one feature set for all three, so candle and
    # cudarc are built once.
    cargo build --release -p accelerate-tests -p fused-kernels -p accelerate-core \
      --features accelerate-tests/nccl,fused-kernels/cuda,accelerate-core/nccl --tests --bins
    # With nccl, `accelerate env` and `accelerate test` see the GPUs.
    cargo build --release -p accelerate-launch --features nccl
    echo "gpu-build: binaries in $CARGO_TARGET_DIR/release"
    # They load CUDA's and NCCL's libraries at run time; without a CUDA 13 installation on the
    # GPU machine, copy these two folders along and point LD_LIBRARY_PATH at the copies.
    echo "gpu-build: at run time, LD_LIBRARY_PATH=$cuda/lib:$site/nccl/lib (driver >= 580)"
    ;;
  *)
    echo "usage: scripts/gpu-build.sh [check|build]" >&2
    exit 2
    ;;
esac
