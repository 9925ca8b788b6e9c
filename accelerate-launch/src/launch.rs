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

fn launch(args: cli::Args) -> Result<ExitCode, String> {
    args.validate()?;
    program::check_program(&args.program)?;
    let gpus = gpus::visible_gpu_count();
    if let Some(hostfile) = &args.mpirun_hostfile {
        // mpirun starts and supervises the workers (this process becomes mpirun).
        return crate::mpirun::run(&args, hostfile, gpus);
    }
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
    let local_world_size = world_size / args.num_machines;
    let multi_machine = args.num_machines > 1;

    let job_token = match std::env::var(JOB_TOKEN) {
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
    };

    // The store lives on machine rank 0; single-machine jobs keep it on loopback.
    let (master_addr, master_port, store) = if args.machine_rank == 0 {
        let ip = if multi_machine {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        } else {
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        };
        let port = choose_port(ip, args.main_process_port, multi_machine)?;
        let server = StoreServer::start(SocketAddr::new(ip, port), job_token.clone(), 0)
            .map_err(|e| format!("cannot start the rendezvous store on port {port}: {e}"))?;
        let addr = if multi_machine {
            args.main_process_ip.clone().unwrap_or_default()
        } else {
            "127.0.0.1".to_string()
        };
        (addr, server.local_addr().port(), Some(server))
    } else {
        (
            args.main_process_ip.clone().unwrap_or_default(),
            args.main_process_port,
            None,
        )
    };

    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let host_name = host_name();
    let mut layout = JobLayout {
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
        cpu,
        threads_per_worker: (cores / local_world_size).max(1),
        ranks_per_gpu: args.ranks_per_gpu,
        host_name: host_name.clone(),
    };
    // Several machines: this launcher joins the others through the store on machine 0 before
    // any worker starts, so a wrong token or an unreachable machine 0 is an error right away.
    let mut link = if multi_machine {
        let store_addr = match &store {
            Some(server) => {
                SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), server.local_addr().port())
            }
            None => resolve(&layout.master_addr, layout.master_port)?,
        };
        Some(MachineLink::join(
            store_addr,
            &layout.job_token,
            args.machine_rank,
            args.num_machines,
            &host_name,
            join_timeout()?,
        )?)
    } else {
        None
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    // From here on a termination signal stops the launcher at whatever point it comes: forwarded
    // to running workers, and never followed by another attempt.
    let mut signals = runtime.block_on(async { SignalWatch::install() })?;
    let inherited = |v: &str| std::env::var_os(v).is_some();
    let grace = Duration::from_secs_f64(args.grace_period);
    use std::io::IsTerminal;
    let mut attempt = 0u32;
    loop {
        if let Some(signal) = signals.received() {
            eprintln!(
                "accelerate-launch: received {}; not starting {}",
                supervise::signal_name(signal),
                if attempt == 0 {
                    "the workers".to_string()
                } else {
                    format!("restart {attempt}")
                }
            );
            if let Some(link) = &mut link {
                // The others are waiting for this machine's workers of this attempt.
                runtime.block_on(link.abandon(attempt, LocalEnd::Interrupted(signal)));
            }
            return Ok(ExitCode::from((128 + signal) as u8));
        }
        if attempt > 0 && link.is_none() {
            // A fresh store generation: keys of the failed round are gone, and a straggler of it
            // is refused instead of joining the new round. (On several machines, machine 0 opens
            // it before it announces the restart.)
            if let Some(server) = &store {
                server.service().set_generation(u64::from(attempt));
            }
            eprintln!(
                "accelerate-launch: restarting every rank (restart {attempt} of {})",
                args.max_restarts
            );
        }
        layout.restart_count = attempt;
        let workers = (0..local_world_size)
            .map(|local| WorkerSpec {
                rank: layout.global_rank(local),
                env: layout.worker_env(local, &inherited),
            })
            .collect();
        let config = GroupConfig {
            program: args.program.clone(),
            args: args.program_args.clone(),
            workers,
            quiet: args.quiet,
            tee_dir: args.tee.clone(),
            attempt,
            grace,
            rank0_stderr_direct: std::io::stderr().is_terminal(),
        };
        let Some(link) = &mut link else {
            let outcome = runtime.block_on(supervise::run_group(
                &config,
                &mut signals,
                std::future::pending(),
            ))?;
            match outcome {
                Outcome::Success => return Ok(ExitCode::SUCCESS),
                Outcome::Failed(failure) => {
                    eprintln!("accelerate-launch: {failure}; stopped the other ranks");
                    if attempt == args.max_restarts {
                        if args.max_restarts > 0 {
                            eprintln!(
                                "accelerate-launch: giving up after {} restart(s) (--max-restarts)",
                                args.max_restarts
                            );
                        }
                        return Ok(ExitCode::from(1));
                    }
                }
                Outcome::Stopped(reason) => {
                    // Only a link stops a group from outside; there is none here.
                    eprintln!("accelerate-launch: {reason}");
                    return Ok(ExitCode::from(1));
                }
                Outcome::Interrupted { signal, failure } => {
                    report_interrupted(signal, failure.as_ref());
                    return Ok(ExitCode::from((128 + signal) as u8));
                }
            }
            attempt += 1;
            continue;
        };
        let outcome = runtime.block_on(supervise::run_group(
            &config,
            &mut signals,
            link.stop_reason(attempt),
        ));
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(e) => {
                runtime.block_on(link.abandon(attempt, LocalEnd::Failed(e.clone())));
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
        if let (Outcome::Interrupted { signal, .. }, true) = (&outcome, args.machine_rank != 0) {
            return Ok(ExitCode::from((128 + *signal) as u8));
        }
        let next = runtime.block_on(link.settle(
            attempt,
            store.as_ref(),
            args.max_restarts,
            grace,
            &mut signals,
        ));
        match next {
            Next::Restart => {
                attempt += 1;
                eprintln!(
                    "accelerate-launch: restarting every rank on every machine (restart \
                     {attempt}, decided by machine 0)"
                );
            }
            Next::Exit { code, reason } => {
                if !reason.is_empty() {
                    eprintln!("accelerate-launch: {reason}");
                }
                // A signal this launcher received, during the attempt or while it waited for
                // the verdict, decides its own exit status.
                if let Some(signal) = signals.received() {
                    return Ok(ExitCode::from((128 + signal) as u8));
                }
                return Ok(ExitCode::from(code));
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
