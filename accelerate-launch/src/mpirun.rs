//! `--mpirun-hostfile F`: a multi-CPU job started by Open MPI's `mpirun` instead of by the
//! launcher's own supervisor, for clusters where MPI is how processes reach the machines (Accelerate's
//! `--mpirun_hostfile`).
//!
//! The launcher checks the flags and the hostfile, then becomes
//! `mpirun --hostfile F -np N [--map-by ppr:N/M:node] --bind-to none [--allow-run-as-root]
//! -x MASTER_ADDR -x MASTER_PORT -x ACCELERATE_JOB_TOKEN -x ACCELERATE_USE_CPU ... PROGRAM ARGS`
//! (it `exec`s it: signals reach
//! mpirun directly, which forwards them to the ranks, and mpirun's exit status is the job's). The
//! workers see Open MPI's rank variables, so rank 0 hosts the rendezvous store on `MASTER_PORT` of
//! the hostfile's first host (or `--main-process-ip`) and sizes its CPU pools itself. Values are
//! passed through mpirun's environment with `-x NAME`, so the job token never shows in `ps`.
//!
//! `--num-machines M` is Accelerate's meaning with a hostfile: the number of hosts, each running
//! `N / M` ranks (Accelerate passes Open MPI `--npernode N/M`, Intel MPI and MVAPICH `-ppn N/M`;
//! `--map-by ppr:K:node` is Open MPI's current spelling of `--npernode K`). Without it, `-np N`
//! fills the hosts' slots in order.
//!
//! `--bind-to none`: Open MPI binds each rank to one core when it starts two or fewer, and to a
//! socket above that, which would confine a rank's compute threads to one core (or make ranks of
//! a socket share it); unbound, each rank takes its share of the machine's cores.

use std::ffi::OsString;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use accelerate_core::env;
use rand::Rng;

use crate::cli::Args;

/// A host line of an Open MPI hostfile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// The host name or address.
    pub name: String,
    /// Its `slots=N`, if given.
    pub slots: Option<usize>,
}

/// Parses an Open MPI hostfile: one host per line, `name [slots=N] [max_slots=M]`, `#` starting a
/// comment. The error names the line.
pub fn parse_hostfile(text: &str) -> Result<Vec<Host>, String> {
    let mut hosts = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        let mut words = line.split_whitespace();
        let Some(name) = words.next() else {
            continue;
        };
        let mut slots = None;
        for word in words {
            if let Some(n) = word.strip_prefix("slots=") {
                slots = Some(n.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| {
                    format!(
                        "line {}: slots={n} is not a positive number of slots",
                        number + 1
                    )
                })?);
            }
        }
        hosts.push(Host {
            name: name.to_string(),
            slots,
        });
    }
    Ok(hosts)
}

/// Everything the mpirun command is built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpirunJob {
    /// The hostfile, passed on as given.
    pub hostfile: PathBuf,
    /// Processes over all hosts (`-np`).
    pub num_processes: usize,
    /// Ranks on each host (`--map-by ppr:K:node`) when `--num-machines` spreads them evenly;
    /// `None` fills the slots in order.
    pub ranks_per_host: Option<usize>,
    /// Where rank 0 hosts the store.
    pub master_addr: String,
    /// The store's port.
    pub master_port: u16,
    /// Whether to pass `--allow-run-as-root` (the launcher runs as root).
    pub as_root: bool,
    /// Variables every rank gets (exported through mpirun's environment and `-x NAME`).
    pub env: Vec<(String, String)>,
    /// Notes for the user about choices made for them (printed before mpirun starts).
    pub notes: Vec<String>,
    /// The training program and its arguments.
    pub program: PathBuf,
    /// Arguments of the program.
    pub program_args: Vec<String>,
}

impl MpirunJob {
    /// mpirun's arguments (the program name `mpirun` not included).
    pub fn args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = vec![
            "--hostfile".into(),
            self.hostfile.clone().into(),
            "-np".into(),
            self.num_processes.to_string().into(),
        ];
        if let Some(k) = self.ranks_per_host {
            args.push("--map-by".into());
            args.push(format!("ppr:{k}:node").into());
        }
        args.push("--bind-to".into());
        args.push("none".into());
        if self.as_root {
            args.push("--allow-run-as-root".into());
        }
        for (name, _) in &self.env {
            args.push("-x".into());
            args.push(name.into());
        }
        args.push(self.program.clone().into());
        args.extend(self.program_args.iter().map(OsString::from));
        args
    }

    /// The variables of mpirun's own environment that `-x NAME` forwards.
    pub fn exported(&self) -> impl Iterator<Item = (&str, &str)> {
        self.env.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

/// Checks the flags that a hostfile job cannot take, reads the hostfile, and builds the job.
/// `gpus` is the number of GPUs visible here; `token` the job token from the environment, if any.
pub fn plan(
    args: &Args,
    hostfile: &Path,
    gpus: usize,
    token: Option<String>,
) -> Result<MpirunJob, String> {
    let flag = "--mpirun-hostfile";
    if args.machine_rank != 0 {
        return Err(format!(
            "{flag} with --machine-rank {}: mpirun starts the ranks on every host of the \
             hostfile itself; run the launcher once, on one machine, without --machine-rank",
            args.machine_rank
        ));
    }
    if args.max_restarts > 0 {
        return Err(format!(
            "{flag} with --max-restarts: mpirun supervises the ranks and cannot restart the \
             group; drop --max-restarts, or start the job with the launcher on each machine \
             (--num-machines) to restart it"
        ));
    }
    if args.tee.is_some() || args.quiet {
        return Err(format!(
            "{flag} with --tee or --quiet: mpirun handles the ranks' output; use its own \
             --output-filename DIR or --tag-output instead"
        ));
    }
    if args.num_gpus.is_some() || (!args.cpu && gpus > 0) {
        return Err(format!(
            "{flag} starts CPU workers, but this job would use GPUs ({gpus} visible here); pass \
             --cpu to train on the CPU, or run accelerate-launch on each machine \
             (--num-machines, --machine-rank, --main-process-ip) for GPU workers"
        ));
    }
    let text = std::fs::read_to_string(hostfile).map_err(|e| {
        format!(
            "{flag} {}: cannot read it ({e}); give the path of an Open MPI hostfile (lines like \
             `node1 slots=4`)",
            hostfile.display()
        )
    })?;
    let hosts = parse_hostfile(&text).map_err(|e| format!("{flag} {}: {e}", hostfile.display()))?;
    let Some(first) = hosts.first() else {
        return Err(format!(
            "{flag} {}: it names no host; write one host per line, e.g. `node1 slots=4`",
            hostfile.display()
        ));
    };
    let num_processes = match args.num_processes {
        Some(n) => n,
        None => hosts
            .iter()
            .map(|h| h.slots)
            .sum::<Option<usize>>()
            .ok_or_else(|| {
                format!(
                    "{flag} {}: give --num-processes N, or slots=N on every host line",
                    hostfile.display()
                )
            })?,
    };
    let ranks_per_host = match args.num_machines {
        0 | 1 => None,
        machines => {
            if num_processes % machines != 0 {
                return Err(format!(
                    "{flag} with --num-processes {num_processes} and --num-machines {machines}: \
                     every host runs the same number of ranks (N / M, as Accelerate's -ppn), so \
                     give a process count divisible by {machines}"
                ));
            }
            if hosts.len() < machines {
                return Err(format!(
                    "{flag} {}: --num-machines {machines}, but it names {} host(s); list one \
                     host per machine, or lower --num-machines",
                    hostfile.display(),
                    hosts.len()
                ));
            }
            Some(num_processes / machines)
        }
    };
    let master_addr = args
        .main_process_ip
        .clone()
        .unwrap_or_else(|| first.name.clone());
    let mut notes = Vec::new();
    let master_port = match args.main_process_port {
        0 if is_this_machine(&master_addr) => free_port()?,
        0 => {
            // A port free here says nothing about the store's host.
            notes.push(format!(
                "--main-process-port 0 finds a free port on this machine, but rank 0's store \
                 runs on {master_addr}; using {DEFAULT_PORT} (give --main-process-port to choose)"
            ));
            DEFAULT_PORT
        }
        port => port,
    };
    let token = token.filter(|t| !t.is_empty()).unwrap_or_else(|| {
        let bytes: [u8; 16] = rand::rng().random();
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    });
    let mut env_vars = vec![
        ("MASTER_ADDR".to_string(), master_addr.clone()),
        ("MASTER_PORT".to_string(), master_port.to_string()),
        (env::JOB_TOKEN.to_string(), token),
        (env::USE_CPU.to_string(), "1".to_string()),
    ];
    if let Some(k) = args.gradient_accumulation_steps {
        env_vars.push((env::GRADIENT_ACCUMULATION_STEPS.into(), k.to_string()));
    }
    if let Some(mode) = args.mixed_precision {
        env_vars.push((env::MIXED_PRECISION.into(), mode.as_str().into()));
    }
    if let Some(stage) = args.zero_stage {
        env_vars.push((env::ZERO_STAGE.into(), stage.to_string()));
    }
    if let Some(classes) = &args.fsdp_transformer_layer_cls_to_wrap {
        env_vars.push((env::FSDP_LAYER_CLASSES.into(), classes.clone()));
    }
    if let Some(kind) = args.fsdp_state_dict_type {
        env_vars.push((env::FSDP_STATE_DICT_TYPE.into(), kind.as_str().into()));
    }
    if let Some(units) = args.fsdp_forward_prefetch {
        env_vars.push((env::FSDP_FORWARD_PREFETCH.into(), units.to_string()));
    }
    if let Some(units) = args.fsdp_backward_prefetch {
        env_vars.push((env::FSDP_BACKWARD_PREFETCH.into(), units.to_string()));
    }
    if args.fsdp_keep_gathered {
        env_vars.push((env::FSDP_KEEP_GATHERED.into(), "1".into()));
    }
    Ok(MpirunJob {
        hostfile: hostfile.to_path_buf(),
        num_processes,
        ranks_per_host,
        master_addr,
        master_port,
        notes,
        // SAFETY: geteuid has no preconditions and cannot fail.
        as_root: unsafe { libc::geteuid() } == 0,
        env: env_vars,
        program: args.program.clone(),
        program_args: args.program_args.clone(),
    })
}

/// The store's port when `--main-process-port 0` cannot be probed (the first host is another
/// machine): torchrun's and Accelerate's default.
const DEFAULT_PORT: u16 = 29500;

/// Whether `host` names this machine: `localhost`, a loopback address, an address of one of this
/// machine's interfaces (one it can bind), or its host name (full or short). No DNS lookup: a name
/// not recognised is taken as another machine's, which only costs the probe of a free port.
fn is_this_machine(host: &str) -> bool {
    let host = host.trim().trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return ip.is_loopback() || TcpListener::bind((ip, 0)).is_ok();
    }
    let mut name = [0u8; 256];
    // SAFETY: gethostname writes at most `name.len()` bytes into the buffer.
    if unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) } != 0 {
        return false;
    }
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    let ours = String::from_utf8_lossy(&name[..end]).to_ascii_lowercase();
    let host = host.to_ascii_lowercase();
    let short = |n: &str| n.split('.').next().unwrap_or("").to_string();
    host == ours || (!host.contains('.') && host == short(&ours))
}

/// A port that was free on this machine a moment ago (for `--main-process-port 0`).
fn free_port() -> Result<u16, String> {
    TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| {
            format!("cannot find a free port for the store ({e}); give --main-process-port")
        })
}

/// Runs the job through Open MPI's `mpirun`: checks, then `exec`s it (returns only on failure).
pub fn run(args: &Args, hostfile: &Path, gpus: usize) -> Result<ExitCode, String> {
    let job = plan(args, hostfile, gpus, std::env::var(env::JOB_TOKEN).ok())?;
    match Command::new("mpirun").arg("--version").output() {
        Ok(o) if String::from_utf8_lossy(&o.stdout).contains("Open MPI") => {}
        Ok(_) => {
            return Err(
                "--mpirun-hostfile builds an Open MPI command line, but `mpirun` here is another \
                 MPI's; put Open MPI's mpirun first in PATH"
                    .into(),
            )
        }
        Err(e) => {
            return Err(format!(
                "--mpirun-hostfile needs Open MPI's `mpirun` in PATH ({e}); install Open MPI \
                 (e.g. `apt-get install openmpi-bin`)"
            ))
        }
    }
    for note in &job.notes {
        eprintln!("accelerate-launch: note: {note}");
    }
    let mut command = Command::new("mpirun");
    command.args(job.args());
    command.envs(job.exported());
    eprintln!(
        "accelerate-launch: starting {} ranks with mpirun (store on {}:{}): mpirun {}",
        job.num_processes,
        job.master_addr,
        job.master_port,
        job.args()
            .iter()
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let e = command.exec();
    Err(format!("cannot start mpirun: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn hostfile_lines_with_slots_and_comments() {
        let text =
            "# the cluster\n\nnode1 slots=4 max_slots=8\n  node2   # no slots\nnode3 slots=2\n";
        let hosts = parse_hostfile(text).unwrap();
        assert_eq!(
            hosts,
            [
                Host {
                    name: "node1".into(),
                    slots: Some(4)
                },
                Host {
                    name: "node2".into(),
                    slots: None
                },
                Host {
                    name: "node3".into(),
                    slots: Some(2)
                },
            ]
        );
        let e = parse_hostfile("node1 slots=x\n").unwrap_err();
        assert!(e.contains("line 1") && e.contains("slots=x"), "{e}");
        assert!(parse_hostfile("# nothing\n\n").unwrap().is_empty());
    }

    fn hostfile(dir: &Path, text: &str) -> PathBuf {
        let path = dir.join("hosts");
        std::fs::write(&path, text).unwrap();
        path
    }

    fn args(flags: &[&str]) -> Args {
        let mut v = vec!["accelerate-launch"];
        v.extend(flags);
        v.extend(["prog", "--lr", "0.1"]);
        Args::try_parse_from(v).unwrap()
    }

    #[test]
    fn the_command_names_the_first_host_as_master_and_forwards_settings_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let file = hostfile(dir.path(), "# comment\nnode7 slots=2\nnode8 slots=2\n");
        let job = plan(
            &args(&[
                "--cpu",
                "--gradient-accumulation-steps",
                "4",
                "--main-process-port",
                "1234",
            ]),
            &file,
            0,
            Some("t0k3n".into()),
        )
        .unwrap();
        assert_eq!(job.num_processes, 4, "the slots of every host");
        assert_eq!((job.master_addr.as_str(), job.master_port), ("node7", 1234));
        let exported: Vec<_> = job.exported().collect();
        assert!(exported.contains(&("MASTER_ADDR", "node7")));
        assert!(exported.contains(&("MASTER_PORT", "1234")));
        assert!(exported.contains(&("ACCELERATE_JOB_TOKEN", "t0k3n")));
        assert!(exported.contains(&("ACCELERATE_USE_CPU", "1")));
        assert!(exported.contains(&("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")));
        let argv: Vec<String> = job
            .args()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let text = argv.join(" ");
        assert!(
            text.starts_with(&format!(
                "--hostfile {} -np 4 --bind-to none",
                file.display()
            )),
            "{text}"
        );
        assert!(
            text.contains("-x MASTER_ADDR -x MASTER_PORT -x ACCELERATE_JOB_TOKEN"),
            "{text}"
        );
        assert!(text.ends_with("prog --lr 0.1"), "{text}");
        // The token stays out of the command line (visible in `ps`).
        assert!(!text.contains("t0k3n"), "{text}");
        // --num-processes and --main-process-ip win over the hostfile.
        let job = plan(
            &args(&["--num-processes", "3", "--main-process-ip", "10.0.0.9"]),
            &file,
            0,
            None,
        )
        .unwrap();
        assert_eq!(
            (job.num_processes, job.master_addr.as_str()),
            (3, "10.0.0.9")
        );
        assert_eq!(job.env[2].1.len(), 32, "a random token when none is set");
    }

    #[test]
    fn zero_stage_and_fsdp_settings_are_forwarded_only_when_given() {
        let dir = tempfile::tempdir().unwrap();
        let file = hostfile(dir.path(), "node1 slots=2\n");
        let job = plan(
            &args(&[
                "--cpu",
                "--zero-stage",
                "3",
                "--fsdp-transformer-layer-cls-to-wrap",
                "GPT2Block, GPT2MLP",
                "--fsdp-state-dict-type",
                "SHARDED_STATE_DICT",
            ]),
            &file,
            0,
            None,
        )
        .unwrap();
        let exported: Vec<_> = job.exported().collect();
        assert!(exported.contains(&("ACCELERATE_ZERO_STAGE", "3")));
        assert!(exported.contains(&("ACCELERATE_FSDP_LAYER_CLASSES", "GPT2Block,GPT2MLP")));
        assert!(exported.contains(&("ACCELERATE_FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT")));
        let text = argv(&job);
        assert!(
            text.contains("-x ACCELERATE_FSDP_LAYER_CLASSES")
                && text.contains("-x ACCELERATE_FSDP_STATE_DICT_TYPE"),
            "{text}"
        );
        let job = plan(&args(&["--cpu"]), &file, 0, None).unwrap();
        let names: Vec<_> = job.exported().map(|(k, _)| k).collect();
        for absent in [
            "ACCELERATE_ZERO_STAGE",
            "ACCELERATE_FSDP_LAYER_CLASSES",
            "ACCELERATE_FSDP_STATE_DICT_TYPE",
        ] {
            assert!(!names.contains(&absent), "{names:?}");
        }
    }

    #[test]
    fn prefetch_and_keep_gathered_are_forwarded_only_when_given() {
        let dir = tempfile::tempdir().unwrap();
        let file = hostfile(dir.path(), "node1 slots=2\n");
        let job = plan(
            &args(&[
                "--cpu",
                "--zero-stage",
                "3",
                "--fsdp-forward-prefetch",
                "true",
                "--fsdp-backward-prefetch",
                "NO_PREFETCH",
                "--fsdp-keep-gathered",
            ]),
            &file,
            0,
            None,
        )
        .unwrap();
        let exported: Vec<_> = job.exported().collect();
        for pair in [
            ("ACCELERATE_FSDP_FORWARD_PREFETCH", "1"),
            ("ACCELERATE_FSDP_BACKWARD_PREFETCH", "0"),
            ("ACCELERATE_FSDP_KEEP_GATHERED", "1"),
        ] {
            assert!(exported.contains(&pair), "{pair:?} not in {exported:?}");
            assert!(
                argv(&job).contains(&format!("-x {}", pair.0)),
                "{}",
                argv(&job)
            );
        }
        let job = plan(&args(&["--cpu"]), &file, 0, None).unwrap();
        let names: Vec<_> = job.exported().map(|(k, _)| k).collect();
        for absent in [
            "ACCELERATE_FSDP_FORWARD_PREFETCH",
            "ACCELERATE_FSDP_BACKWARD_PREFETCH",
            "ACCELERATE_FSDP_KEEP_GATHERED",
        ] {
            assert!(!names.contains(&absent), "{names:?}");
        }
    }

    fn argv(job: &MpirunJob) -> String {
        job.args()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn num_machines_spreads_the_ranks_evenly_as_accelerate_does() {
        // Accelerate 1.x (utils/launch.py, prepare_simple_launcher_cmd_env): ranks per node =
        // num_processes // num_machines, passed to Open MPI as `--npernode`; for 8 ranks on 2
        // hosts that is 4 per host, whatever the slots say.
        let dir = tempfile::tempdir().unwrap();
        let file = hostfile(dir.path(), "node1 slots=6\nnode2 slots=6\n");
        let job = plan(
            &args(&["--num-processes", "8", "--num-machines", "2"]),
            &file,
            0,
            None,
        )
        .unwrap();
        assert_eq!(job.ranks_per_host, Some(4));
        let text = argv(&job);
        assert!(
            text.starts_with(&format!(
                "--hostfile {} -np 8 --map-by ppr:4:node --bind-to none",
                file.display()
            )),
            "{text}"
        );
        // No --main-process-ip needed: the store is on the first host.
        assert!(args(&["--num-machines", "2", "--mpirun-hostfile", "h"])
            .validate()
            .is_ok());
        // Without --num-machines, Open MPI fills the slots (no mapping option).
        let job = plan(&args(&["--num-processes", "8"]), &file, 0, None).unwrap();
        assert_eq!(job.ranks_per_host, None);
        assert!(!argv(&job).contains("--map-by"), "{}", argv(&job));
        // Uneven counts and too few hosts are refused with the numbers.
        let e = plan(
            &args(&["--num-processes", "7", "--num-machines", "2"]),
            &file,
            0,
            None,
        )
        .unwrap_err();
        assert!(e.contains("divisible by 2") && e.contains("7"), "{e}");
        let e = plan(
            &args(&["--num-processes", "9", "--num-machines", "3"]),
            &file,
            0,
            None,
        )
        .unwrap_err();
        assert!(e.contains("names 2 host(s)"), "{e}");
    }

    #[test]
    fn port_zero_is_probed_only_where_the_store_runs() {
        let dir = tempfile::tempdir().unwrap();
        let local = hostfile(dir.path(), "localhost slots=2\n");
        let job = plan(&args(&["--main-process-port", "0"]), &local, 0, None).unwrap();
        assert_ne!(job.master_port, 0);
        assert!(job.notes.is_empty(), "{:?}", job.notes);
        // 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never an address of this machine.
        let remote = hostfile(dir.path(), "192.0.2.7 slots=2\n");
        let job = plan(&args(&["--main-process-port", "0"]), &remote, 0, None).unwrap();
        assert_eq!(job.master_port, 29500);
        assert!(job.notes[0].contains("192.0.2.7"), "{:?}", job.notes);
        assert!(is_this_machine("127.0.0.1") && is_this_machine("LOCALHOST"));
        assert!(!is_this_machine("node-that-is-not-this-one.invalid"));
    }

    /// The mapping option as this machine's Open MPI takes it: `--map-by ppr:K:node` with one
    /// host of 4 slots runs 4 ranks on it. Skips where Open MPI is absent.
    #[test]
    fn open_mpi_accepts_the_mapping_option() {
        let Ok(version) = Command::new("mpirun").arg("--version").output() else {
            eprintln!("skipped: no mpirun here");
            return;
        };
        if !String::from_utf8_lossy(&version.stdout).contains("Open MPI") {
            eprintln!("skipped: mpirun here is not Open MPI's");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let file = hostfile(dir.path(), "localhost slots=4\n");
        let mut flags = vec!["--cpu", "--num-processes", "4", "--num-machines", "1"];
        flags.extend(["--mpirun-hostfile", "unused"]);
        let mut job = plan(&args(&flags), &file, 0, None).unwrap();
        // --num-machines 1 maps nothing; ask for the spelling --num-machines M > 1 produces.
        job.ranks_per_host = Some(4);
        job.program = "sh".into();
        job.program_args = vec!["-c".into(), "echo rank=$OMPI_COMM_WORLD_RANK".into()];
        let mut command = Command::new("timeout");
        command.args(["120", "mpirun"]);
        let o = command
            .args(job.args())
            .envs(job.exported())
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{out}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let mut ranks: Vec<&str> = out.lines().filter(|l| l.starts_with("rank=")).collect();
        ranks.sort();
        assert_eq!(ranks, ["rank=0", "rank=1", "rank=2", "rank=3"]);
    }

    #[test]
    fn flags_a_hostfile_job_cannot_take_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let file = hostfile(dir.path(), "node1 slots=2\n");
        let refused =
            |flags: &[&str], gpus: usize| plan(&args(flags), &file, gpus, None).unwrap_err();
        assert!(refused(&["--max-restarts", "2"], 0).contains("--max-restarts"));
        let e = refused(&["--num-machines", "2", "--machine-rank", "1"], 0);
        assert!(e.contains("--machine-rank 1"), "{e}");
        let e = refused(&["--num-processes", "2"], 1);
        assert!(e.contains("GPUs") && e.contains("--cpu"), "{e}");
        assert!(plan(&args(&["--cpu"]), &file, 1, None).is_ok());
        let e = refused(&["--tee", "logs"], 0);
        assert!(e.contains("--output-filename"), "{e}");
        // A hostfile without slots needs the process count.
        let bare = hostfile(dir.path(), "node1\n");
        let e = plan(&args(&[]), &bare, 0, None).unwrap_err();
        assert!(e.contains("--num-processes"), "{e}");
        let e = plan(&args(&[]), &dir.path().join("missing"), 0, None).unwrap_err();
        assert!(
            e.contains("--mpirun-hostfile") && e.contains("missing"),
            "{e}"
        );
        let empty = hostfile(dir.path(), "# none\n");
        assert!(plan(&args(&[]), &empty, 0, None)
            .unwrap_err()
            .contains("names no host"));
    }
}
