//! The integration tests of accelerate-rs, one test binary with a module per area (ripgrep's
//! layout): one link instead of one per file, and one place that lists the areas. Each module
//! compares the runtime against an independent reference; the shared pieces (reference
//! optimizers, workload flags, ranks as threads) are the `accelerate_tests` library
//! (`support.rs`), on the harness every crate's tests share (`accelerate-test-support`: the
//! [`Job`] that starts processes without the job environment, ports, skips, the tiny model).
//!
//! The GPU tests are the module `gpu`, ignored without the `nccl` feature. On a GPU machine:
//! `cargo test --release -p accelerate-tests --features nccl --test integration gpu:: --
//! --test-threads=1` (the binary can be copied there; README, "GPU tests").
//!
//! Run one area with a filter: `cargo test --release -p accelerate-tests --test integration
//! checkpoint::`.
//!
//! [`Job`]: accelerate_tests::Job

// Gradient accumulation against one large batch, in process.
mod accumulation;
// Bad input through the real binaries: refused with the problem named, nothing left behind.
mod bad_input;
// Exact resume from checkpoints, restarts, and `save_model` read back by Python.
mod checkpoint;
// The `Communicator` contract against every backend.
mod conformance;
// The launcher and its workers: N ranks against one process, collectives, failures.
mod distributed;
// The examples' held-out evaluation against a single-process one, their trackers and flags.
mod evaluation;
// ZeRO stage 3 (fully sharded) against stage 0 and one process, in process.
mod fsdp;
// ZeRO stage 3 checkpoints: resumed, re-cut for other ranks and stages, damage refused.
mod fsdp_checkpoint;
// ZeRO stage 3's memory under a heap budget, and the `mlp` example fully sharded, via the launcher.
mod fsdp_memory;
// The `gpt` example end to end.
mod gpt;
// On the GPU (with `nccl`): NCCL collectives, training against the CPU, restarts, the watchdog.
mod gpu;
// Activation checkpointing in `gpt` and `llama` against the same models without it.
mod gradient_checkpointing;
// The `llama` model and example against Hugging Face transformers.
mod llama;
// The Kubernetes manifests parse, and run what the Docker image ships.
mod kubernetes;
// The book's three levels of one job (plain candle, Accelerator loop) give the same parameters.
mod levels;
// The `lora` example: adapters over a frozen base, PEFT's files, N ranks against one process.
mod lora;
// Loops that leave a loader early: windows, gathers and resume positions stay those of the loop.
mod loops;
// Two machines over a real link (network namespaces): equivalence, TCP, a killed launcher, a
// wrong token, restarts across machines.
mod machines;
// Mixed precision: loss scaling, bf16 buffers and reductions, against hand-computed values.
mod mixed_precision;
// Workers started by Open MPI's mpirun, directly and through `accelerate-launch --mpirun-hostfile`.
mod mpi;
// Overlap of gradient reduction with bucket preparation.
mod overlap;
// The rendezvous store of workers started without our launcher: its token, who may join.
mod security;
// Two models with their own optimizers and accumulation, and frozen parameters.
mod several_models;
// srun and the book's sbatch script on a real one-node SLURM cluster, against one process.
mod slurm;
// Streaming data (JSONL shards) against a single-process reading of the stream.
mod streaming;
// Fine-tuning a Hugging Face model directory on a text corpus (tokenizer, packing, token files).
mod text;
// The `trainer` example under the launcher: its eval loss, checkpoints, YAML arguments, resume.
mod trainer;
// Trackers under the launcher: only the main process writes.
mod tracking;
// A user's own optimizer through `prepare()`, against hand-computed window means.
mod user_optimizer;
// no_sync, sync_each_batch, clip_grad_value, object collectives, split_between_processes,
// on_main_process, set_seed, register_for_checkpointing: against hand-computed values.
mod utilities;
// ZeRO stages 1 and 2 against stage 0 and one process on the global batch.
mod zero;
