//! The harness every crate's integration tests share, so that it is written once: the one list
//! of job variables a test's processes run without ([`mod@env`]), the [`Job`] that starts a process
//! bounded in time, the paths of the binaries `cargo test` built, free loopback ports for ranks
//! that are threads, a test that reruns itself in a child process with other variables, skips
//! that say why, and a tiny seeded model.
//!
//! It depends on no other crate of the workspace, so each of them can take it as a
//! dev-dependency without a cycle. The pieces that need the runtime (ranks as threads with an
//! `Accelerator`, reference optimizers) stay in the crates that test it.

#![deny(missing_docs)]

mod binaries;
mod child;
pub mod env;
mod job;
mod ports;
mod process;
mod skip;
mod tiny;

pub use binaries::{built_binary, profile_dir};
pub use child::rerun_with_env;
pub use env::remove_job_env;
pub use job::{summary_value, Job, JobOutput};
pub use ports::{free_port, free_ports};
pub use process::{alive, children_by_rank, output_text, run_bounded, send_signal};
pub use skip::{skip, skip_unless_required};
pub use tiny::{named_vars, tiny_mlp, tiny_mlp_on, TinyMlp, TINY_CLASSES, TINY_IN};
