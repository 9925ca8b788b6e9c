//! Who runs a rank: the machine (to decide whether shared memory can connect the ranks) and the
//! process (to tell a crashed peer from a slow one).

use serde::{Deserialize, Serialize};

/// What makes two processes able to share memory and signal each other: the same kernel boot
/// (hostname and boot id) and the same pid namespace (so that published pids mean the same).
///
/// The network namespace is part of it too. Processes in two network namespaces of one kernel
/// could share `/dev/shm`, but they were put in separate networks on purpose (containers, two
/// "machines" of a test): they are separate machines to the job, and talk over the network.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HostIdentity {
    /// `/proc/sys/kernel/hostname`.
    pub hostname: String,
    /// `/proc/sys/kernel/random/boot_id`, different on every machine and every boot.
    pub boot_id: String,
    /// The target of `/proc/self/ns/pid`.
    pub pid_namespace: String,
    /// The target of `/proc/self/ns/net`.
    pub net_namespace: String,
}

impl HostIdentity {
    /// This process's identity; `None` where the system does not tell (then shared memory is
    /// not used automatically).
    pub fn of_this_process() -> Option<Self> {
        let read = |path: &str| {
            std::fs::read_to_string(path)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        };
        Some(Self {
            hostname: read("/proc/sys/kernel/hostname")?,
            boot_id: read("/proc/sys/kernel/random/boot_id")?,
            pid_namespace: namespace("pid")?,
            net_namespace: namespace("net")?,
        })
    }
}

/// The target of `/proc/self/ns/<kind>`, e.g. `net:[4026531840]`.
fn namespace(kind: &str) -> Option<String> {
    std::fs::read_link(format!("/proc/self/ns/{kind}"))
        .ok()
        .map(|target| target.to_string_lossy().into_owned())
}

impl std::fmt::Display for HostIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "host {} (boot {}, {}, {})",
            self.hostname, self.boot_id, self.pid_namespace, self.net_namespace
        )
    }
}

/// Start time of process `pid` in clock ticks since boot (field 22 of `/proc/<pid>/stat`), with
/// its state letter; `None` when the process does not exist or the file cannot be read.
fn stat_of(pid: u32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses; fields after it follow
    // the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 3 was the state; field 22 is 19 further on.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// Start time of this process, 0 if unknown.
pub(crate) fn own_start_time() -> u64 {
    stat_of(std::process::id()).map_or(0, |(_, start)| start)
}

/// Whether process `pid`, started at `start_time` (0: unknown), still runs. A zombie (exited,
/// not yet reaped) or a pid reused by a later process counts as gone.
pub(crate) fn is_alive(pid: u32, start_time: u64) -> bool {
    if pid == std::process::id() {
        return true;
    }
    match stat_of(pid) {
        Some((state, _)) if state == 'Z' || state == 'X' => false,
        Some((_, start)) => start_time == 0 || start == start_time,
        None => {
            if std::path::Path::new(&format!("/proc/{pid}")).exists() {
                // Readable neither way (a restricted /proc): assume alive rather than fail a
                // healthy job; the collective timeout still bounds the wait.
                return true;
            }
            // No /proc entry: gone, or a system without /proc, where kill(pid, 0) tells.
            kill_probe(pid)
        }
    }
}

#[cfg(unix)]
fn kill_probe(pid: u32) -> bool {
    if !std::path::Path::new("/proc/self").exists() {
        // SAFETY: signal 0 performs only the existence and permission checks.
        let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
        return r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    }
    false
}

#[cfg(not(unix))]
fn kill_probe(_pid: u32) -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_an_exited_child_is_not() {
        let me = std::process::id();
        assert!(own_start_time() > 0);
        assert!(is_alive(me, own_start_time()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start = stat_of(pid).map_or(0, |(_, s)| s);
        // Wait for the exit without reaping: the child stays a zombie, which counts as dead.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while stat_of(pid).is_some_and(|(state, _)| state != 'Z')
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!is_alive(pid, start), "a zombie is not alive");
        child.wait().unwrap();
        assert!(!is_alive(pid, start), "a reaped process is not alive");
    }

    #[test]
    fn a_pid_with_another_start_time_belongs_to_another_process() {
        let parent = std::os::unix::process::parent_id();
        let (_, start) = stat_of(parent).expect("the parent (test harness) runs");
        assert!(is_alive(parent, start));
        assert!(is_alive(parent, 0), "unknown start time: trust the pid");
        assert!(!is_alive(parent, start + 1));
    }

    #[test]
    fn the_identity_of_this_process_is_known_and_stable() {
        let a = HostIdentity::of_this_process().expect("Linux exposes /proc");
        assert_eq!(Some(a.clone()), HostIdentity::of_this_process());
        assert!(!a.boot_id.is_empty() && a.pid_namespace.starts_with("pid:"));
    }
}
