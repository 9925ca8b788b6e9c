//! The commands of the launcher crate's two binaries, as the tests start them: without the job
//! environment of any job the tests run in (the workspace's one list of variables,
//! `accelerate_test_support::env`), so that a developer's shell inside torchrun, SLURM or MPI
//! cannot change which ranks they start.

use std::ffi::OsStr;
use std::process::Command;

/// `program` as a command without the inherited job environment.
pub fn command(program: impl AsRef<OsStr>) -> Command {
    let mut cmd = Command::new(program);
    accelerate_test_support::remove_job_env(&mut cmd);
    cmd
}

/// The `accelerate-launch` binary of this crate, without the inherited job environment.
pub fn launcher() -> Command {
    command(env!("CARGO_BIN_EXE_accelerate-launch"))
}

/// The `accelerate` binary of this crate, without the inherited job environment.
pub fn accelerate() -> Command {
    command(env!("CARGO_BIN_EXE_accelerate"))
}
