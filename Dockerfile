# accelerate-rs for NVIDIA GPUs: `accelerate-launch`, `accelerate` and the examples, built with NCCL.
#
#   docker build -t accelerate-rs .
#   docker run --gpus all --rm accelerate-rs \
#       accelerate-launch --num-gpus 8 /opt/accelerate/examples/mlp --grad-accum 4
#
# The build stage compiles candle's CUDA kernels (PTX) for CUDA_COMPUTE_CAP (90 = Hopper; 80 =
# Ampere); fused-kernels' kernels also ship machine code for sm_80 and sm_90.
ARG CUDA_VERSION=13.0.0
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
ARG CUDA_COMPUTE_CAP=90
ENV CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP} \
    CUDA_ROOT=/usr/local/cuda \
    PATH=/root/.cargo/bin:/usr/local/cuda/bin:${PATH}
RUN apt-get update \
 && apt-get install -y --no-install-recommends curl ca-certificates build-essential pkg-config \
      libnccl-dev \
 && rm -rf /var/lib/apt/lists/* \
 && curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain 1.95.0
WORKDIR /src
COPY . .
# Everything is built with `--features nccl` (candle's CUDA backend and NCCL): the launcher
# crate's two binaries `accelerate-launch` and `accelerate`, the examples, the benchmarks and the
# GPU tests.
RUN cargo build --release -p accelerate-launch --features nccl \
 && cargo build --release -p accelerate-examples --features nccl --examples \
 && cargo build --release -p accelerate-benchmarks --features nccl --bins \
 && cargo build --release -p accelerate-tests --features nccl --tests --bins \
 && mkdir -p /out/examples /out/benchmarks /out/tests \
 && cp target/release/accelerate-launch target/release/accelerate /out/ \
 && cp target/release/examples/mlp target/release/examples/gpt /out/examples/ \
 && cp target/release/bench_mlp target/release/bench_allreduce /out/benchmarks/ \
 && cp target/release/accelerate-test-worker /out/ \
 && cp "$(ls -t target/release/deps/integration-* | grep -v '\.d$' | head -1)" /out/tests/integration

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnccl2 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out /opt/accelerate
# The driver compiles candle's PTX on the first launch (~14 s) and caches the result: keep the
# cache on a volume (-v cuda-jit-cache:/var/cache/cuda-jit) so that only the first container pays.
ENV PATH=/opt/accelerate:${PATH} \
    CUDA_CACHE_PATH=/var/cache/cuda-jit \
    CUDA_CACHE_MAXSIZE=4294967296
WORKDIR /workspace
CMD ["accelerate-launch", "--help"]
