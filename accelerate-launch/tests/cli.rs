//! The launcher's answers to bad command lines, from the real binary.

use std::process::Command;

fn launch(args: &[&str]) -> (i32, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_accelerate-launch"))
        .args(args)
        .output()
        .expect("run accelerate-launch");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn zero_processes_is_refused() {
    let (code, err) = launch(&["--cpu", "--num-processes", "0", "true"]);
    assert_eq!(code, 2);
    assert!(err.contains("--num-processes 0"), "{err}");
}

#[test]
fn more_gpus_than_exist_suggests_the_cpu() {
    let (code, err) = launch(&["--num-gpus", "2", "true"]);
    assert_eq!(code, 2);
    assert!(err.contains("found 0 usable GPU"), "{err}");
    assert!(err.contains("--cpu --num-processes 2"), "{err}");
}

#[test]
fn a_missing_program_is_named() {
    let (code, err) = launch(&[
        "--cpu",
        "--num-processes",
        "2",
        "--main-process-port",
        "0",
        "/nonexistent/trainer",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("/nonexistent/trainer"), "{err}");
}

#[test]
fn a_failing_rank_is_reported_with_its_exit_code() {
    let (code, err) = launch(&[
        "--cpu",
        "--num-processes",
        "2",
        "--main-process-port",
        "0",
        "sh",
        "-c",
        "exit $((RANK * 3))",
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains("rank 1") && err.contains("exited with code 3"),
        "{err}"
    );
}
