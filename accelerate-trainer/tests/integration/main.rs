//! The Trainer's integration tests, one test binary with a module per area (ripgrep's layout):
//! one link instead of one per file, and one place that lists the areas. The shared pieces (a
//! tiny classifier, seeded data, ranks that are threads, the reference loop) are in `common`,
//! on the workspace's shared harness (`accelerate-test-support`).
//!
//! Run one area with a filter: `cargo test --release -p accelerate-trainer --test integration
//! robustness::`.

// TrainingArguments against Hugging Face's: names, defaults, flags, files, refusals.
mod args;
// The tiny classifier, seeded data, ranks as threads and the reference Accelerator loop.
mod common;
// The Trainer on 2 thread-ranks against the equivalent Accelerator loop, bit for bit.
mod distributed;
// The launcher's environment reaches the Trainer (in a child process: it sets a process-wide
// variable).
mod environment;
// The evaluation loop on 1, 2 and 3 ranks against a single-process evaluation.
mod evaluation;
// Item-weighted losses through the Trainer against an Accelerator loop with windows.
mod item_weighted;
// Where real runs go wrong: best checkpoints, cut checkpoints, one-rank callbacks, resumes.
mod robustness;
// The loop against an Accelerator loop, exact resume, checkpoints, callbacks, logging.
mod training;
