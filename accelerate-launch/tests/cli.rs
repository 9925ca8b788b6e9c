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
    // More than any machine has, so the test holds on GPU machines too.
    let (code, err) = launch(&["--num-gpus", "4096", "true"]);
    assert_eq!(code, 2);
    assert!(err.contains("visible GPU(s)"), "{err}");
    assert!(err.contains("--cpu --num-processes 4096"), "{err}");
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

#[test]
fn a_taken_port_on_one_machine_falls_back_to_a_free_one_with_a_warning() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    // Each worker checks that it was given another port than the taken one.
    let check = format!("test \"$MASTER_PORT\" != {port} && test -n \"$MASTER_PORT\"");
    let (code, err) = launch(&[
        "--cpu",
        "--num-processes",
        "2",
        "--main-process-port",
        &port,
        "sh",
        "-c",
        &check,
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(&format!("--main-process-port {port} is in use")),
        "{err}"
    );
}
