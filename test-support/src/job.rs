//! [`Job`]: how every integration test starts a process — the launcher, an example, the test
//! worker or a helper program — bounded in time and without the environment of any job the
//! tests themselves run in ([`crate::env`]).

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::process::{Command, Output};
use std::str::FromStr;
use std::time::Duration;

use crate::{built_binary, output_text, remove_job_env, run_bounded};

/// How long a job may run when the test sets no [`Job::limit`].
const DEFAULT_LIMIT: Duration = Duration::from_secs(300);

/// A process a test starts: a program with its arguments, alone or under the launcher, with the
/// inherited job environment removed, run to completion within a time limit.
///
/// ```ignore
/// let o = Job::example("mlp").ranks(2).args(["--grad-accum", "2"]).run();
/// assert!(o.status.success(), "{}", o.text());
/// assert_eq!(o.summary::<u64>("steps"), 10);
/// ```
#[derive(Debug)]
pub struct Job {
    program: OsString,
    args: Vec<OsString>,
    /// Launcher flags before the program; `None` runs the program alone.
    launcher_flags: Option<Vec<OsString>>,
    /// Variables set (`Some`) or removed (`None`) after the inherited job environment is cleared.
    env: Vec<(OsString, Option<OsString>)>,
    /// A command the whole job runs under (`ip netns exec NS`), if any.
    wrapper: Vec<OsString>,
    limit: Duration,
}

impl Job {
    /// `program` run alone (no launcher), with no arguments yet.
    pub fn new(program: impl AsRef<OsStr>) -> Self {
        Self {
            program: program.as_ref().to_owned(),
            args: Vec::new(),
            launcher_flags: None,
            env: Vec::new(),
            wrapper: Vec::new(),
            limit: DEFAULT_LIMIT,
        }
    }

    /// The example `name` built into `target/<profile>/examples`.
    pub fn example(name: &str) -> Self {
        Self::new(built_binary(&format!("examples/{name}")))
    }

    /// The `mlp` example on `ranks` processes: alone when 1, otherwise under the launcher on CPU
    /// ([`Job::ranks`]).
    pub fn mlp(ranks: usize) -> Self {
        let job = Self::example("mlp");
        if ranks == 1 {
            job
        } else {
            job.ranks(ranks)
        }
    }

    /// The launcher itself as the program (for tests of its own flags; add them with
    /// [`Job::arg`]).
    pub fn launcher() -> Self {
        Self::new(launcher_path())
    }

    /// The test worker (`tests/bin/worker.rs`); its first argument names the scenario.
    pub fn worker() -> Self {
        Self::new(built_binary("accelerate-test-worker"))
    }

    /// Runs the program on `ranks` CPU processes under the launcher, on a free port: the launcher
    /// gets `--cpu --num-processes <ranks> --main-process-port 0` before any
    /// [`Job::launcher_flags`].
    pub fn ranks(mut self, ranks: usize) -> Self {
        let flags = self.launcher_flags.get_or_insert_with(Vec::new);
        let cpu: [OsString; 5] = [
            "--cpu".into(),
            "--num-processes".into(),
            ranks.to_string().into(),
            "--main-process-port".into(),
            "0".into(),
        ];
        flags.splice(0..0, cpu);
        self
    }

    /// Runs the program under the launcher with these flags before it (after those of
    /// [`Job::ranks`], if given).
    pub fn launcher_flags<I, S>(mut self, flags: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.launcher_flags
            .get_or_insert_with(Vec::new)
            .extend(flags.into_iter().map(|f| f.as_ref().to_owned()));
        self
    }

    /// One argument of the program.
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    /// Arguments of the program.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// Sets a variable of the process (applied after the inherited job environment is removed).
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.env
            .push((key.as_ref().to_owned(), Some(value.as_ref().to_owned())));
        self
    }

    /// Removes a variable the process would otherwise inherit (one outside the job environment).
    pub fn env_remove(mut self, key: impl AsRef<OsStr>) -> Self {
        self.env.push((key.as_ref().to_owned(), None));
        self
    }

    /// Runs the whole job (the launcher, or the program alone) under this command, e.g.
    /// `["ip", "netns", "exec", "ns0"]`; it must exec what follows it.
    pub fn inside<I, S>(mut self, wrapper: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.wrapper = wrapper.into_iter().map(|w| w.as_ref().to_owned()).collect();
        self
    }

    /// The longest [`Job::run`] waits before it kills the job and fails the test (300 s unless
    /// set).
    pub fn limit(mut self, limit: Duration) -> Self {
        self.limit = limit;
        self
    }

    /// The command this job runs, for a test that spawns it itself (to signal or kill it while it
    /// runs): the launcher or the program, its arguments and the cleaned environment.
    pub fn command(&self) -> Command {
        let mut words: Vec<OsString> = self.wrapper.clone();
        if let Some(flags) = &self.launcher_flags {
            words.push(launcher_path().into());
            words.extend(flags.iter().cloned());
        }
        words.push(self.program.clone());
        let mut cmd = Command::new(&words[0]);
        cmd.args(&words[1..]);
        cmd.args(&self.args);
        remove_job_env(&mut cmd);
        for (key, value) in &self.env {
            match value {
                Some(value) => cmd.env(key, value),
                None => cmd.env_remove(key),
            };
        }
        cmd
    }

    /// Runs the job to completion; kills it and fails the test if it outlives its limit.
    pub fn run(&self) -> JobOutput {
        JobOutput(run_bounded(&mut self.command(), self.limit))
    }
}

fn launcher_path() -> PathBuf {
    built_binary("accelerate-launch")
}

/// A finished [`Job`]: its status, stdout and stderr (it dereferences to
/// [`std::process::Output`]), and the figures of an example's summary line.
#[derive(Debug)]
pub struct JobOutput(pub Output);

impl std::ops::Deref for JobOutput {
    type Target = Output;

    fn deref(&self) -> &Output {
        &self.0
    }
}

impl JobOutput {
    /// Status, stdout and stderr, for assertion messages.
    pub fn text(&self) -> String {
        output_text(self)
    }

    /// Standard output as text.
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// The `key=value` figure of the summary line; see [`summary_value`].
    pub fn summary<T: FromStr>(&self, key: &str) -> T {
        summary_value(self, key)
    }
}

/// A `key=value` figure from an example's summary line on stdout, parsed as `T` (a trailing `s`
/// unit is dropped); fails the test, showing the output, when it is missing or does not parse.
pub fn summary_value<T: FromStr>(o: &Output, key: &str) -> T {
    let out = String::from_utf8_lossy(&o.stdout);
    out.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.trim_end_matches('s').parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "no {key}= of type {} in the summary:\n{}",
                std::any::type_name::<T>(),
                output_text(o)
            )
        })
}
