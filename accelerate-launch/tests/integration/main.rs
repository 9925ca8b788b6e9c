//! The launcher's integration tests, one test binary with a module per area (ripgrep's layout),
//! all of them on the real binaries `accelerate-launch` and `accelerate`, started through
//! `common` without the job environment of any job the tests run in.
//!
//! Run one area with a filter: `cargo test --release -p accelerate-launch --test integration
//! cli::`.

// `accelerate`: `launch` with Accelerate's config files, `config`, `env` and `test`.
mod accelerate;
// `accelerate-launch`: bad command lines, failing ranks, restarts, signals, several machines.
mod cli;
// The commands of the two binaries, without the job environment.
mod common;
