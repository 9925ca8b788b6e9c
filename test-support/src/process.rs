//! The processes a test starts and watches: run to completion within a time limit, their output
//! for assertion messages, and the signals and `/proc` reads of the tests that kill a rank.

/// Runs a command to completion, killing it (and failing the test) if it takes longer than
/// `limit`: a test must never hang.
pub fn run_bounded(
    cmd: &mut std::process::Command,
    limit: std::time::Duration,
) -> std::process::Output {
    use std::io::Read;
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let out_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let err_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} did not finish within {limit:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    std::process::Output {
        status,
        stdout: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
    }
}

/// A finished command's status, stdout and stderr, for assertion messages.
pub fn output_text(o: &std::process::Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Pids of a launcher's children, by the rank in their environment.
pub fn children_by_rank(launcher_pid: u32) -> Vec<(usize, u32)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Field 4 (after the parenthesised command) is the parent pid.
        let after = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
        let ppid: u32 = after
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        if ppid != launcher_pid {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let rank = env
            .split(|&b| b == 0)
            .find_map(|kv| kv.strip_prefix(b"RANK="))
            .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok());
        if let Some(rank) = rank {
            found.push((rank, pid));
        }
    }
    found
}

/// Sends `signal` (a name `kill` knows, as `TERM` or `KILL`) to process `pid`; fails the test if
/// `kill` cannot.
pub fn send_signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .expect("running kill");
    assert!(status.success(), "kill -{signal} {pid} failed: {status}");
}

/// Whether process `pid` exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit_once(')')
                .map(|x| x.1)
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}
