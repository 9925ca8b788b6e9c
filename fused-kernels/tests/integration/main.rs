//! fused-kernels' integration tests, one test binary with a module per area (ripgrep's layout):
//! one link instead of one per file, and one place that lists the areas. Every op is checked
//! against an independent reference: finite differences, PyTorch's values, the CPU kernels.
//!
//! Run one area with a filter: `cargo test --release -p fused-kernels --test integration
//! finite_differences::`; the GPU tests: `cargo test --release -p fused-kernels --features cuda
//! --test integration cuda:: -- --ignored --test-threads=1`.

// Activation checkpointing: the same loss and, bit for bit, the same gradients as a plain run.
mod checkpoint;
// Seeded inputs, and gradients against central differences.
mod common;
// The CUDA kernels against the CPU kernels (with the `cuda` feature; the tests need a GPU).
mod cuda;
// bf16/f16 inputs, the row-parallel paths on large tensors, and the errors for wrong shapes.
mod dtypes_threads_errors;
// Every op's gradients against central finite differences in f64.
mod finite_differences;
// Every op's output and gradients against PyTorch's (and transformers') values.
mod pytorch;
