//! One job on this machine: checks the flags, hosts the rendezvous store on machine rank 0, and
//! runs the group of workers, restarting it when asked.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::process::ExitCode;
use std::time::Duration;

use accelerate_core::comm::StoreServer;
use accelerate_core::env::{COLLECTIVE_TIMEOUT, JOB_TOKEN};
use rand::Rng;

use crate::cli;
use crate::gpus;
use crate::machines::{LocalEnd, MachineLink, Next};
use crate::program;
use crate::signals::SignalWatch;
use crate::supervise::{self, GroupConfig, Outcome, WorkerSpec};
use crate::worker_env::JobLayout;

/// Runs `accelerate-launch` (or `accelerate launch`) with parsed flags and returns the process's
/// exit code: the job's outcome, or 2 with the reason on stderr when the flags are refused.
pub fn run(args: cli::Args) -> ExitCode {
    raise_open_file_limit();
    match launch(args) {
        Ok(code) => code,
        Err(msg) => {
            eprintln!("accelerate-launch: error: {msg}");
            ExitCode::from(2)
        }
    }
}

/// The job, step by step: the flags checked, the world sized, the store hosted (or found), the
/// machines joined, then the attempts run until one ends the job.
fn launch(args: cli::Args) -> Result<ExitCode, String> {
    args.validate()?;
    program::check_program(&args.program)?;
    let gpus = gpus::visible_gpu_count();
    if let Some(hostfile) = &args.mpirun_hostfile {
        // mpirun starts and supervises the workers (this process becomes mpirun).
        return crate::mpirun::run(&args, hostfile, gpus);
    }
    let (world_size, cpu) = world_size(&args, gpus)?;
    let local_world_size = world_size / args.num_machines;
    let multi_machine = args.num_machines > 1;
    let job_token = job_token(multi_machine)?;
    let (master_addr, master_port, store) = host_store(&args, &job_token)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let host_name = host_name();
    let layout = JobLayout {
        world_size,
        local_world_size,
        machine_rank: args.machine_rank,
        master_addr,
        master_port,
        job_token,
        restart_count: 0,
        gradient_accumulation_steps: args.gradient_accumulation_steps,
        mixed_precision: args.mixed_precision,
        zero_stage: args.zero_stage,
        fsdp_layer_classes: args.fsdp_transformer_layer_cls_to_wrap.clone(),
        fsdp_state_dict_type: args.fsdp_state_dict_type,
        fsdp_forward_prefetch: args.fsdp_forward_prefetch,
        fsdp_backward_prefetch: args.fsdp_backward_prefetch,
        fsdp_keep_gathered: args.fsdp_keep_gathered,
        cpu,
        threads_per_worker: (cores / local_world_size).max(1),
        ranks_per_gpu: args.ranks_per_gpu,
        host_name,
    };
    let link = join_machines(&args, &layout, store.as_ref())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    // From here on a termination signal stops the launcher at whatever point it comes: forwarded
    // to running workers, and never followed by another attempt.
    let signals = runtime.block_on(async { SignalWatch::install() })?;
    Job {
        grace: Duration::from_secs_f64(args.grace_period),
        args,
        layout,
        store,
        link,
        runtime,
        signals,
    }
    .run()
}

/// The number of processes of the whole job and whether they train on the CPU, from
/// `--num-gpus`, `--num-processes`, `--cpu` and the GPUs this machine sees.
fn world_size(args: &cli::Args, gpus: usize) -> Result<(usize, bool), String> {
    let (world_size, cpu) = match (args.num_gpus, args.num_processes) {
        (Some(n), _) if args.cpu => {
            return Err(format!(
                "--num-gpus {n} together with --cpu; use --cpu --num-processes {n} for CPU workers"
            ))
        }
        (Some(n), Some(p)) if n * args.ranks_per_gpu != p => {
            return Err(format!(
                "--num-gpus {n} (with --ranks-per-gpu {}) and --num-processes {p} disagree; give \
                 one of them",
                args.ranks_per_gpu
            ))
        }
        // --num-gpus counts over every machine, as --num-processes does; each machine needs
        // its share.
        (Some(n), _) if n.div_ceil(args.num_machines) > gpus => {
            let share = if args.num_machines > 1 {
                format!(
                    " over {} machines asks for {} on each;",
                    args.num_machines,
                    n.div_ceil(args.num_machines)
                )
            } else {
                ":".to_string()
            };
            return Err(format!(
                "--num-gpus {n}{share} this machine has {gpus} visible GPU(s) \
                 (CUDA_VISIBLE_DEVICES={}); ask for at most {}, or use --cpu --num-processes {n} \
                 to train on the CPU",
                std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into()),
                gpus * args.num_machines
            ));
        }
        (Some(n), _) => (n * args.ranks_per_gpu, false),
        (None, Some(p)) => (p, args.cpu || gpus == 0),
        // Without a count: every GPU of every machine, or one CPU process per machine.
        (None, None) => {
            if args.cpu || gpus == 0 {
                (args.num_machines, true)
            } else {
                (gpus * args.num_machines, false)
            }
        }
    };
    if world_size % args.num_machines != 0 {
        return Err(format!(
            "--num-processes {world_size} is not divisible by --num-machines {}; every machine \
             runs the same number of processes",
            args.num_machines
        ));
    }
    Ok((world_size, cpu))
}

/// The job's secret: the environment's on several machines (each must know the same), else a
/// fresh random one.
fn job_token(multi_machine: bool) -> Result<String, String> {
    Ok(match std::env::var(JOB_TOKEN) {
        Ok(t) if !t.is_empty() => t,
        _ if multi_machine => {
            return Err(format!(
                "a job on several machines needs the same secret on every machine: set \
                 {JOB_TOKEN} to one random string (e.g. `openssl rand -hex 16`) before \
                 running accelerate-launch on each machine"
            ))
        }
        _ => {
            let bytes: [u8; 16] = rand::rng().random();
            bytes.iter().map(|b| format!("{b:02x}")).collect()
        }
    })
}

/// The store's address and port as workers dial it, and the store itself on machine rank 0. The
/// store lives on machine rank 0; single-machine jobs keep it on loopback.
fn host_store(
    args: &cli::Args,
    job_token: &str,
) -> Result<(String, u16, Option<StoreServer>), String> {
    if args.machine_rank != 0 {
        return Ok((
            args.main_process_ip.clone().unwrap_or_default(),
            args.main_process_port,
            None,
        ));
    }
    let multi_machine = args.num_machines > 1;
    let ip = if multi_machine {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    };
    let port = choose_port(ip, args.main_process_port, multi_machine)?;
    let server = StoreServer::start(SocketAddr::new(ip, port), job_token.to_string(), 0)
        .map_err(|e| format!("cannot start the rendezvous store on port {port}: {e}"))?;
    let addr = if multi_machine {
        args.main_process_ip.clone().unwrap_or_default()
    } else {
        "127.0.0.1".to_string()
    };
    Ok((addr, server.local_addr().port(), Some(server)))
}

/// Several machines: this launcher joins the others through the store on machine 0 before any
/// worker starts, so a wrong token or an unreachable machine 0 is an error right away. `None` on
/// one machine.
fn join_machines(
    args: &cli::Args,
    layout: &JobLayout,
    store: Option<&StoreServer>,
) -> Result<Option<MachineLink>, String> {
    if args.num_machines <= 1 {
        return Ok(None);
    }
    let store_addr = match store {
        Some(server) => {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), server.local_addr().port())
        }
        None => resolve(&layout.master_addr, layout.master_port)?,
    };
    Ok(Some(MachineLink::join(
        store_addr,
        &layout.job_token,
        args.machine_rank,
        args.num_machines,
        &layout.host_name,
        join_timeout()?,
    )?))
}

/// A job whose store is up and whose machines have joined: runs attempts of the group of workers
/// until one ends the job.
///
/// Fields drop in declaration order, which is the teardown order: the signal watch before the
/// runtime it was installed on, and this machine's link to the others (its farewell, its
/// heartbeat) before the store that the other machines reach it through.
struct Job {
    args: cli::Args,
    layout: JobLayout,
    grace: Duration,
    signals: SignalWatch,
    runtime: tokio::runtime::Runtime,
    /// The link to the other machines' launchers, on several machines.
    link: Option<MachineLink>,
    /// The rendezvous store, on machine rank 0.
    store: Option<StoreServer>,
}

impl Job {
    /// Runs attempts, each after the restart the previous one asked for, and returns the job's
    /// exit code.
    fn run(mut self) -> Result<ExitCode, String> {
        let mut attempt = 0u32;
        loop {
            if let Some(signal) = self.signals.received() {
                return Ok(self.refuse_to_start(attempt, signal));
            }
            if attempt > 0 && self.link.is_none() {
                self.open_restart(attempt);
            }
            let config = self.group_config(attempt);
            let ended = if self.link.is_none() {
                self.run_alone(&config, attempt)?
            } else {
                self.run_linked(&config, attempt)?
            };
            match ended {
                Some(code) => return Ok(code),
                None => attempt += 1,
            }
        }
    }

    /// A signal came before attempt `attempt` started: none starts, and the other machines
    /// learn that this one gives up.
    fn refuse_to_start(&mut self, attempt: u32, signal: i32) -> ExitCode {
        eprintln!(
            "accelerate-launch: received {}; not starting {}",
            supervise::signal_name(signal),
            if attempt == 0 {
                "the workers".to_string()
            } else {
                format!("restart {attempt}")
            }
        );
        if let Some(link) = &mut self.link {
            // The others are waiting for this machine's workers of this attempt.
            self.runtime
                .block_on(link.abandon(attempt, LocalEnd::Interrupted(signal)));
        }
        ExitCode::from((128 + signal) as u8)
    }

    /// On one machine, before restart `attempt`: a fresh store generation, so that keys of the
    /// failed round are gone and a straggler of it is refused instead of joining the new round.
    /// (On several machines, machine 0 opens it before it announces the restart.)
    fn open_restart(&self, attempt: u32) {
        if let Some(server) = &self.store {
            server.service().set_generation(u64::from(attempt));
        }
        eprintln!(
            "accelerate-launch: restarting every rank (restart {attempt} of {})",
            self.args.max_restarts
        );
    }

    /// The workers of this machine for attempt `attempt`, and how they are supervised.
    fn group_config(&mut self, attempt: u32) -> GroupConfig {
        use std::io::IsTerminal;
        let inherited = |v: &str| std::env::var_os(v).is_some();
        self.layout.restart_count = attempt;
        let workers = (0..self.layout.local_world_size)
            .map(|local| WorkerSpec {
                rank: self.layout.global_rank(local),
                env: self.layout.worker_env(local, &inherited),
            })
            .collect();
        GroupConfig {
            program: self.args.program.clone(),
            args: self.args.program_args.clone(),
            workers,
            quiet: self.args.quiet,
            tee_dir: self.args.tee.clone(),
            attempt,
            grace: self.grace,
            rank0_stderr_direct: std::io::stderr().is_terminal(),
        }
    }

    /// One attempt on a single machine: its exit code, or `None` when a failure may be restarted.
    fn run_alone(
        &mut self,
        config: &GroupConfig,
        attempt: u32,
    ) -> Result<Option<ExitCode>, String> {
        let outcome = self.runtime.block_on(supervise::run_group(
            config,
            &mut self.signals,
            std::future::pending(),
        ))?;
        let max_restarts = self.args.max_restarts;
        match outcome {
            Outcome::Success => Ok(Some(ExitCode::SUCCESS)),
            Outcome::Failed(failure) => {
                eprintln!("accelerate-launch: {failure}; stopped the other ranks");
                if attempt == max_restarts {
                    if max_restarts > 0 {
                        eprintln!(
                            "accelerate-launch: giving up after {max_restarts} restart(s) \
                             (--max-restarts)"
                        );
                    }
                    return Ok(Some(ExitCode::from(1)));
                }
                Ok(None)
            }
            Outcome::Stopped(reason) => {
                // Only a link stops a group from outside; there is none here.
                eprintln!("accelerate-launch: {reason}");
                Ok(Some(ExitCode::from(1)))
            }
            Outcome::Interrupted { signal, failure } => {
                report_interrupted(signal, failure.as_ref());
                Ok(Some(ExitCode::from((128 + signal) as u8)))
            }
        }
    }

    /// One attempt on several machines: this machine's outcome reported to the others, then
    /// machine 0's verdict awaited. The job's exit code, or `None` when every machine restarts.
    fn run_linked(
        &mut self,
        config: &GroupConfig,
        attempt: u32,
    ) -> Result<Option<ExitCode>, String> {
        let link = self.link.as_mut().expect("run_linked runs with a link");
        let outcome = self.runtime.block_on(supervise::run_group(
            config,
            &mut self.signals,
            link.stop_reason(attempt),
        ));
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(e) => {
                self.runtime
                    .block_on(link.abandon(attempt, LocalEnd::Failed(e.clone())));
                return Err(e);
            }
        };
        match &outcome {
            Outcome::Success => {}
            Outcome::Failed(failure) => {
                eprintln!("accelerate-launch: {failure}; stopped the other ranks of this machine")
            }
            Outcome::Stopped(reason) => {
                eprintln!("accelerate-launch: stopped the ranks of this machine: {reason}")
            }
            Outcome::Interrupted { signal, failure } => {
                report_interrupted(*signal, failure.as_ref())
            }
        }
        if let Err(e) = link.report_end(attempt, LocalEnd::from_outcome(&outcome)) {
            eprintln!("accelerate-launch: {e}");
        }
        if let (Outcome::Interrupted { signal, .. }, true) = (&outcome, self.args.machine_rank != 0)
        {
            return Ok(Some(ExitCode::from((128 + *signal) as u8)));
        }
        let next = self.runtime.block_on(link.settle(
            attempt,
            self.store.as_ref(),
            self.args.max_restarts,
            self.grace,
            &mut self.signals,
        ));
        match next {
            Next::Restart => {
                eprintln!(
                    "accelerate-launch: restarting every rank on every machine (restart \
                     {}, decided by machine 0)",
                    attempt + 1
                );
                Ok(None)
            }
            Next::Exit { code, reason } => {
                if !reason.is_empty() {
                    eprintln!("accelerate-launch: {reason}");
                }
                // A signal this launcher received, during the attempt or while it waited for
                // the verdict, decides its own exit status.
                if let Some(signal) = self.signals.received() {
                    return Ok(Some(ExitCode::from((128 + signal) as u8)));
                }
                Ok(Some(ExitCode::from(code)))
            }
        }
    }
}

/// Says that a signal stopped the workers (and which rank had failed before it, if one had).
fn report_interrupted(signal: i32, failure: Option<&supervise::Failure>) {
    if let Some(failure) = failure {
        eprintln!("accelerate-launch: {failure}");
    }
    eprintln!(
        "accelerate-launch: received {}; stopped every rank",
        supervise::signal_name(signal)
    );
}

/// The address of the store on machine 0, from `--main-process-ip` (an address or a host name).
fn resolve(host: &str, port: u16) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("--main-process-ip {host}: cannot resolve it ({e})"))?
        .next()
        .ok_or_else(|| format!("--main-process-ip {host}: the name has no address"))
}

/// How long a launcher waits for machine 0's store to accept it: the workers' connection
/// timeout (`ACCELERATE_COLLECTIVE_TIMEOUT`, 300 s by default), as machines start at
/// different times.
fn join_timeout() -> Result<Duration, String> {
    match std::env::var(COLLECTIVE_TIMEOUT) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| format!("{COLLECTIVE_TIMEOUT}={v}: give a positive number of seconds")),
        _ => Ok(Duration::from_secs(300)),
    }
}

/// The store's port: the requested one if free; 0 picks a free one; a taken port is an error on
/// several machines (the others expect that port) and falls back to a free one with a warning on
/// one machine.
fn choose_port(ip: IpAddr, requested: u16, multi_machine: bool) -> Result<u16, String> {
    if requested == 0 {
        return Ok(0);
    }
    match TcpListener::bind(SocketAddr::new(ip, requested)) {
        Ok(listener) => {
            drop(listener);
            Ok(requested)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && !multi_machine => {
            eprintln!(
                "accelerate-launch: warning: --main-process-port {requested} is in use; using a \
                 free port instead"
            );
            Ok(0)
        }
        Err(e) => Err(format!(
            "--main-process-port {requested}: cannot listen on it ({e}); pick another port, or 0 \
             for any free port"
        )),
    }
}

/// This machine's host name (`localhost` if the system will not say).
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match std::str::from_utf8(&buf[..end]) {
        Ok(name) if ok && !name.is_empty() => name.to_string(),
        _ => "localhost".to_string(),
    }
}

/// Raises the soft limit on open files to the hard limit, for the launcher and the workers it
/// starts: the store holds a connection per rank (and per stray client), each worker holds pipes,
/// sockets and data files, and distributions often default the soft limit to 1024. A failure only
/// costs a warning: the old limit may well suffice.
fn raise_open_file_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 || limit.rlim_cur >= limit.rlim_max
        {
            return;
        }
        let old = limit.rlim_cur;
        limit.rlim_cur = limit.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
            eprintln!(
                "accelerate-launch: warning: cannot raise the open-file limit from {old} to {} \
                 ({}); raise it with `ulimit -n` if ranks fail with \"too many open files\"",
                limit.rlim_max,
                std::io::Error::last_os_error()
            );
        }
    }
}
