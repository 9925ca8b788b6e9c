//! A test that needs process-wide variables runs in a child process of its own test binary:
//! setting them in the test process would change what every test running beside it reads.

use std::process::Command;
use std::time::Duration;

use crate::{output_text, remove_job_env, run_bounded};

/// Set in the child to the name of the test it reruns.
const CHILD: &str = "ACCELERATE_TEST_RERUN";

/// Runs the calling test again, alone, in a child process of this test binary with the job
/// variables removed and `env` set. Returns `true` in that child, where the caller goes on with
/// its body; in the calling test it returns `false` once the child has passed, and fails the
/// test with the child's output otherwise.
///
/// ```ignore
/// if !rerun_with_env(&[("ACCELERATE_MIXED_PRECISION", "bf16")]) {
///     return;
/// }
/// // Here, in the child: ACCELERATE_MIXED_PRECISION=bf16.
/// ```
pub fn rerun_with_env(env: &[(&str, &str)]) -> bool {
    // libtest runs each test on a thread named after it (its full name, as `--list` prints it).
    let thread = std::thread::current();
    let test = thread
        .name()
        .filter(|n| *n != "main")
        .expect("rerun_with_env is called from a test, on the thread libtest names after it");
    if std::env::var(CHILD).is_ok_and(|name| name == test) {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new(exe);
    cmd.args([test, "--exact", "--test-threads=1"]);
    remove_job_env(&mut cmd);
    cmd.env(CHILD, test).envs(env.iter().copied());
    let o = run_bounded(&mut cmd, Duration::from_secs(300));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && stdout.contains("test result: ok. 1 passed"),
        "{test} in a child process with {env:?}:\n{}",
        output_text(&o)
    );
    false
}
