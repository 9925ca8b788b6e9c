//! Workloads shared by the example programs, the benchmarks and the integration tests.
//!
//! Everything random here comes from explicitly seeded ChaCha generators, so every process of a
//! job (and every test reference run) builds the same data and the same initial weights.

pub mod frozen_linear;
pub mod gpt;
pub mod layers;
pub mod llama;
pub mod lora;
pub mod mlp;
pub mod run;
