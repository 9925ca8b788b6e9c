//! Runs the workers of one machine as a group: starts them, prefixes their output with their rank,
//! forwards signals, and stops the whole group as soon as one worker fails.
//!
//! Each worker leads its own process group (so a terminal's Ctrl-C reaches only the launcher, which
//! forwards it once) and is told by the kernel to die with the launcher (`PR_SET_PDEATHSIG`), so no
//! worker outlives a launcher that was killed outright.
//!
//! The processes a worker started (data loader helpers, a compiler, a tool it ran in the
//! background) stay in its group. Every group of the attempt is signalled when the group is
//! stopped, whether or not its worker has already exited, and once every worker has exited the
//! launcher ends what is left in their groups (SIGTERM, SIGKILL after the grace period) before it
//! returns: nothing a worker spawned keeps GPU memory or ports through a restart, or after the
//! job. The launcher is the child subreaper of what it starts, so those orphans are its children
//! and it reaps them.

use std::collections::{BTreeMap, VecDeque};
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::Command;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::signals::SignalWatch;

/// Lines of a hidden rank's stderr kept to show when it fails (`--quiet`).
const FAILED_RANK_TAIL_LINES: usize = 40;

/// One worker to start.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    /// Global rank (used in prefixes and messages).
    pub rank: usize,
    /// Variables added to the inherited environment.
    pub env: BTreeMap<String, String>,
}

/// How the group is run.
#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// The training program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// The workers of this machine.
    pub workers: Vec<WorkerSpec>,
    /// Show only rank 0's output (and the last lines of a failed rank's stderr).
    pub quiet: bool,
    /// Also write each rank's output to `DIR/rank_<r>.log`.
    pub tee_dir: Option<PathBuf>,
    /// The attempt this group is (0 first, then one per restart): attempt 0 starts each log
    /// afresh, later attempts append to it after a header line, so every attempt's log is kept.
    pub attempt: u32,
    /// Time between SIGTERM and SIGKILL when stopping workers.
    pub grace: Duration,
    /// Let rank 0 write to the launcher's stderr directly (its progress bar needs a terminal).
    pub rank0_stderr_direct: bool,
}

/// How a worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Exited with this code.
    Code(i32),
    /// Killed by this signal.
    Signal(i32),
}

impl Exit {
    fn from_status(status: ExitStatus) -> Self {
        match (status.code(), status.signal()) {
            (Some(c), _) => Exit::Code(c),
            (None, Some(s)) => Exit::Signal(s),
            (None, None) => Exit::Code(-1),
        }
    }

    fn success(self) -> bool {
        self == Exit::Code(0)
    }
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exit::Code(c) => write!(f, "exited with code {c}"),
            Exit::Signal(s) => write!(f, "was killed by signal {s} ({})", signal_name(*s)),
        }
    }
}

/// Name of a signal number, for messages.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => "signal",
    }
}

/// How the group ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every worker exited with code 0.
    Success,
    /// This worker failed first; the others were stopped.
    Failed(Failure),
    /// The group was stopped from outside (another machine's group ended badly), for this
    /// reason.
    Stopped(String),
    /// The launcher received this signal and forwarded it; the group was stopped. It wins over a
    /// failure: a signal during the teardown of a failed group must not lead to a restart.
    Interrupted {
        /// The signal.
        signal: i32,
        /// The rank that had failed before the signal came, if one had.
        failure: Option<Failure>,
    },
}

/// The worker that failed first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Its global rank.
    pub rank: usize,
    /// Its process id.
    pub pid: u32,
    /// How it ended.
    pub exit: Exit,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} (pid {}) {}", self.rank, self.pid, self.exit)
    }
}

/// The last lines a hidden rank wrote to stderr.
type Tail = Arc<Mutex<VecDeque<Vec<u8>>>>;

/// Starts the workers and waits for the group to end. Returns only when every worker has exited.
/// When `stop` resolves first (with a reason), the group is stopped as after a failure.
pub async fn run_group(
    config: &GroupConfig,
    signals: &mut SignalWatch,
    stop: impl std::future::Future<Output = String>,
) -> Result<Outcome, String> {
    tokio::pin!(stop);
    if let Some(dir) = &config.tee_dir {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("--tee {}: cannot create the directory: {e}", dir.display()))?;
    }
    let (exit_tx, mut exit_rx) = mpsc::unbounded_channel::<(usize, Exit)>();
    become_subreaper();
    // The live workers (None once exited) and every worker's process group, exited or not.
    let mut pids: Vec<Option<u32>> = Vec::new();
    let mut groups = ProcessGroups::default();
    let mut forwarders = Vec::new();
    let mut tails: Vec<Option<Tail>> = Vec::new();
    let launcher_pid = std::process::id();
    for (index, worker) in config.workers.iter().enumerate() {
        let mut cmd = Command::new(&config.program);
        cmd.args(&config.args)
            .envs(&worker.env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(if worker.rank == 0 && config.rank0_stderr_direct {
                Stdio::inherit()
            } else {
                Stdio::piped()
            })
            .kill_on_drop(true);
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                libc::setpgid(0, 0);
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                // The launcher may have died before prctl took effect.
                if libc::getppid() as u32 != launcher_pid {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                groups.signal(libc::SIGKILL);
                return Err(format!(
                    "cannot start {} for rank {}: {e}; check that the path is right and the file \
                     is executable",
                    config.program.display(),
                    worker.rank
                ));
            }
        };
        let pid = child.id().unwrap_or(0);
        pids.push(Some(pid));
        groups.add(pid);
        let show = !config.quiet || worker.rank == 0;
        let tee = match &config.tee_dir {
            Some(dir) => match open_log(dir, worker.rank, config.attempt) {
                Ok(file) => Some(Arc::new(Mutex::new(file))),
                Err(e) => {
                    // Workers already started must not run on unsupervised.
                    groups.signal(libc::SIGKILL);
                    return Err(e);
                }
            },
            None => None,
        };
        let tail = (!show).then(Tail::default);
        tails.push(tail.clone());
        if let Some(out) = child.stdout.take() {
            forwarders.push(tokio::spawn(forward(
                out,
                worker.rank,
                false,
                show,
                tee.clone(),
                None,
            )));
        }
        if let Some(err) = child.stderr.take() {
            forwarders.push(tokio::spawn(forward(
                err,
                worker.rank,
                true,
                show,
                tee.clone(),
                tail,
            )));
        }
        let tx = exit_tx.clone();
        tokio::spawn(async move {
            let exit = match child.wait().await {
                Ok(status) => Exit::from_status(status),
                Err(_) => Exit::Code(-1),
            };
            let _ = tx.send((index, exit));
        });
    }
    drop(exit_tx);

    let mut failure: Option<Failure> = None;
    let mut interrupted: Option<i32> = None;
    let mut stopped: Option<String> = None;
    let mut kill_deadline: Option<Instant> = None;
    let mut remaining = pids.len();
    while remaining > 0 {
        let deadline = kill_deadline;
        tokio::select! {
            got = exit_rx.recv() => {
                let Some((index, exit)) = got else { break };
                let pid = pids[index].take().unwrap_or(0);
                groups.exited(pid);
                remaining -= 1;
                if !exit.success() && failure.is_none() && interrupted.is_none() && stopped.is_none() {
                    failure = Some(Failure { rank: config.workers[index].rank, pid, exit });
                    groups.signal(libc::SIGTERM);
                    kill_deadline = Some(Instant::now() + config.grace);
                }
            }
            Some(sig) = signals.next() => {
                interrupted.get_or_insert(sig);
                groups.signal(sig);
                kill_deadline.get_or_insert(Instant::now() + config.grace);
            }
            reason = &mut stop, if stopped.is_none() && failure.is_none() && interrupted.is_none() => {
                stopped = Some(reason);
                groups.signal(libc::SIGTERM);
                kill_deadline = Some(Instant::now() + config.grace);
            }
            _ = sleep_until(deadline), if deadline.is_some() => {
                groups.signal(libc::SIGKILL);
                kill_deadline = None;
            }
        }
    }
    // What the workers left behind goes before the next attempt (or the launcher's exit), so it
    // cannot hold the memory and ports the next workers need. A signal meanwhile only hurries it.
    groups.end_leftovers(config.grace, signals).await;
    // Let the output of the last lines through; a grandchild holding a pipe must not block us.
    for f in forwarders {
        let _ = tokio::time::timeout(Duration::from_secs(2), f).await;
    }
    if let Some(failure) = &failure {
        let index = config.workers.iter().position(|w| w.rank == failure.rank);
        if let Some(tail) = index.and_then(|i| tails[i].as_ref()) {
            show_tail(failure.rank, tail);
        }
    }
    Ok(match (interrupted, failure, stopped) {
        (Some(signal), failure, _) => Outcome::Interrupted { signal, failure },
        (None, Some(failure), _) => Outcome::Failed(failure),
        (None, None, Some(reason)) => Outcome::Stopped(reason),
        (None, None, None) => Outcome::Success,
    })
}

/// Opens rank `rank`'s log in `dir` for `attempt`: the first attempt starts it afresh (a log of an
/// earlier job in the same directory is replaced), a restart appends a header and its own lines,
/// so the log of the crash that caused the restart is kept.
fn open_log(dir: &std::path::Path, rank: usize, attempt: u32) -> Result<std::fs::File, String> {
    let path = dir.join(format!("rank_{rank}.log"));
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(attempt > 0)
        .truncate(attempt == 0)
        .open(&path)
        .map_err(|e| format!("--tee: cannot open {}: {e}", path.display()))?;
    if attempt > 0 {
        writeln!(file, "{}", restart_header(attempt))
            .map_err(|e| format!("--tee: cannot write {}: {e}", path.display()))?;
    }
    Ok(file)
}

/// The line that starts a restart's part of a `--tee` log.
pub fn restart_header(attempt: u32) -> String {
    format!("===== accelerate-launch: restart {attempt} (ACCELERATE_RESTART_COUNT={attempt}) =====")
}

/// Shows the last stderr lines of a failed rank whose output `--quiet` hid.
fn show_tail(rank: usize, tail: &Tail) {
    let lines = tail.lock().unwrap_or_else(|e| e.into_inner());
    let mut err = std::io::stderr().lock();
    if lines.is_empty() {
        let _ = writeln!(
            err,
            "accelerate-launch: rank {rank} wrote nothing to stderr"
        );
        return;
    }
    let _ = writeln!(
        err,
        "accelerate-launch: the last {} line(s) rank {rank} wrote to stderr (hidden by --quiet):",
        lines.len()
    );
    for line in lines.iter() {
        let _ = write!(err, "[rank {rank}] ");
        let _ = err.write_all(line);
    }
    let _ = err.flush();
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// The process groups of one attempt's workers: each worker leads one, whose id is its pid.
#[derive(Debug, Default)]
struct ProcessGroups {
    /// The groups the workers lead, in the order they started.
    groups: Vec<Group>,
}

/// One worker's process group.
#[derive(Debug)]
struct Group {
    /// The group id: the worker's pid.
    pid: u32,
    /// Whether the worker has exited (and been reaped).
    exited: bool,
    /// Whether the group was seen empty after its worker exited. Its id is then free for the
    /// kernel to hand out again (to a process that starts a session of its own), so it is never
    /// signalled again.
    gone: AtomicBool,
}

impl Group {
    /// Whether the group has no process left (checked only once its worker has exited, and
    /// remembered: an empty group never fills again under the same id).
    fn is_gone(&self) -> bool {
        if self.exited && !self.gone.load(Ordering::Relaxed) {
            // SAFETY: a plain syscall; signal 0 only checks that some process is in the group.
            let empty = unsafe { libc::kill(-(self.pid as i32), 0) } != 0
                && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
            self.gone.store(empty, Ordering::Relaxed);
        }
        self.gone.load(Ordering::Relaxed)
    }
}

impl ProcessGroups {
    fn add(&mut self, pid: u32) {
        if pid != 0 {
            self.groups.push(Group {
                pid,
                exited: false,
                gone: AtomicBool::new(false),
            });
        }
    }

    /// Notes that the worker leading group `pid` has exited: its group lives on as long as a
    /// process it started does (looked at now: a group already empty is gone for good).
    fn exited(&mut self, pid: u32) {
        if let Some(group) = self.groups.iter_mut().find(|g| g.pid == pid) {
            group.exited = true;
            group.is_gone();
        }
    }

    /// Sends `sig` to every group, those of exited workers included.
    fn signal(&self, sig: i32) {
        for group in &self.groups {
            if group.is_gone() {
                continue;
            }
            let (pid, exited) = (group.pid, group.exited);
            // SAFETY: plain syscalls on the groups this launcher's workers lead.
            unsafe {
                // A live worker that could not lead its own group still gets the signal. An
                // exited worker's pid may have been reused: only its group is signalled, while
                // it has members (the kernel does not hand out a pid still in use as a group
                // id, and the members are this launcher's descendants, kept as zombies until it
                // reaps them, so the group cannot empty unseen).
                if libc::kill(-(pid as i32), sig) != 0 && !exited {
                    libc::kill(pid as i32, sig);
                }
            }
        }
    }

    /// Whether any process is left in the groups, after reaping those that are this launcher's
    /// zombies (orphans it adopted as subreaper). Called once every worker has been reaped, so
    /// the reaping cannot take a worker's exit status from its own waiter.
    fn any_left(&self) -> bool {
        let mut left = false;
        for group in &self.groups {
            if group.gone.load(Ordering::Relaxed) {
                continue;
            }
            // SAFETY: plain syscalls; `status` is a local the kernel writes.
            unsafe {
                let mut status = 0;
                while libc::waitpid(-(group.pid as i32), &mut status, libc::WNOHANG) > 0 {}
            }
            if !group.is_gone() {
                // SAFETY: a plain syscall; signal 0 only checks.
                left |= unsafe { libc::kill(-(group.pid as i32), 0) } == 0;
            }
        }
        left
    }

    /// Ends what is left in the groups once every worker has exited: SIGTERM, then SIGKILL after
    /// `grace`, waiting (briefly, past the SIGKILL) until the groups are empty.
    async fn end_leftovers(&self, grace: Duration, signals: &mut SignalWatch) {
        if !self.any_left() {
            return;
        }
        self.signal(libc::SIGTERM);
        let killed = Instant::now() + grace;
        let give_up = killed + LEFTOVER_KILL_WAIT;
        let mut sent_kill = false;
        while self.any_left() {
            let now = Instant::now();
            if now >= give_up {
                eprintln!(
                    "accelerate-launch: warning: processes the workers started are still in their \
                     process groups {:?} {LEFTOVER_KILL_WAIT:?} after SIGKILL",
                    self.groups.iter().map(|g| g.pid).collect::<Vec<_>>()
                );
                return;
            }
            if !sent_kill && now >= killed {
                self.signal(libc::SIGKILL);
                sent_kill = true;
            }
            tokio::select! {
                () = tokio::time::sleep(LEFTOVER_POLL) => {}
                Some(sig) = signals.next() => {
                    self.signal(sig);
                    if !sent_kill {
                        self.signal(libc::SIGKILL);
                        sent_kill = true;
                    }
                }
            }
        }
    }
}

/// How often the launcher looks whether the processes the workers left have gone.
const LEFTOVER_POLL: Duration = Duration::from_millis(10);
/// How long the launcher waits for them after SIGKILL (they must first be scheduled to die).
const LEFTOVER_KILL_WAIT: Duration = Duration::from_secs(5);

/// Makes this process the child subreaper of its descendants: what a worker started and left
/// behind becomes the launcher's child when the worker exits (not init's), so the launcher can
/// reap it and see its group empty. A failure only costs that reaping (init reaps them instead).
fn become_subreaper() {
    // SAFETY: a plain prctl on this process.
    unsafe {
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1);
    }
}

async fn forward(
    stream: impl AsyncRead + Unpin,
    rank: usize,
    is_stderr: bool,
    show: bool,
    tee: Option<Arc<Mutex<std::fs::File>>>,
    tail: Option<Tail>,
) {
    let mut reader = BufReader::new(stream);
    let prefix = format!("[rank {rank}] ");
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if !line.ends_with(b"\n") {
            line.push(b'\n');
        }
        if let Some(t) = &tee {
            let _ = t.lock().unwrap_or_else(|e| e.into_inner()).write_all(&line);
        }
        if let Some(tail) = &tail {
            let mut lines = tail.lock().unwrap_or_else(|e| e.into_inner());
            if lines.len() == FAILED_RANK_TAIL_LINES {
                lines.pop_front();
            }
            lines.push_back(line.clone());
        }
        if show {
            let mut out: Box<dyn Write> = if is_stderr {
                Box::new(std::io::stderr().lock())
            } else {
                Box::new(std::io::stdout().lock())
            };
            let _ = out.write_all(prefix.as_bytes());
            let _ = out.write_all(&line);
            let _ = out.flush();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    /// A `sleep` in process group `group` (0: a group of its own).
    fn sleep_in(group: i32) -> std::process::Child {
        std::process::Command::new("sleep")
            .arg("30")
            .process_group(group)
            .spawn()
            .unwrap()
    }

    /// A group seen empty after its worker exited is gone for good: its id may be handed out
    /// again, so it is never signalled again; a group whose worker left a process behind is not
    /// gone until that process is.
    #[test]
    fn an_exited_workers_group_is_gone_once_seen_empty() {
        let mut groups = ProcessGroups::default();
        // A worker that exited alone.
        let mut alone = sleep_in(0);
        let empty = alone.id();
        alone.kill().unwrap();
        alone.wait().unwrap();
        groups.add(empty);
        groups.exited(empty);
        assert!(groups.groups[0].is_gone(), "an empty group is gone");

        // A worker that left a process in its group (this test's child, so that it is reaped
        // here, whatever init does).
        let mut leader = sleep_in(0);
        let left = leader.id();
        let mut member = sleep_in(left as i32);
        leader.kill().unwrap();
        leader.wait().unwrap();
        groups.add(left);
        groups.exited(left);
        assert!(
            !groups.groups[1].is_gone(),
            "its member is still in the group"
        );
        assert!(groups.any_left());
        groups.signal(libc::SIGKILL);
        // `any_left` may reap the member itself.
        let _ = member.wait();
        assert!(!groups.any_left());
        assert!(groups.groups[1].is_gone());
        // Once gone, a group stays gone (it is not looked at again).
        assert!(groups.groups.iter().all(|g| g.gone.load(Ordering::Relaxed)));
    }
}
