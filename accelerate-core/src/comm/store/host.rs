//! Where rank 0 hosts the store when no `accelerate-launch` did (torchrun, SLURM, MPI), which
//! token protects it, and the checks on `MASTER_ADDR` that every rank makes before joining.
//!
//! - The token is the one the user gave every rank in `ACCELERATE_JOB_TOKEN`. Without one:
//!   - a job on one machine gets a random token that rank 0 writes to a file only this user can
//!     read (`token_file`), where every rank of the job finds it: nothing to set, and no other
//!     user of the machine can join;
//!   - a job on several machines is refused before anything listens, naming
//!     `ACCELERATE_JOB_TOKEN`, unless `ACCELERATE_ALLOW_OPEN_STORE=1` says the network is closed
//!     (then the store admits anyone who reaches it, with a warning).
//! - A job on one machine binds its `MASTER_ADDR` (loopback by default); a job on several
//!   machines binds every interface (0.0.0.0), so the other machines reach it.
//! - A `MASTER_ADDR` that resolves to a loopback address while the job spans machines (Debian's
//!   `/etc/hosts` maps the host's own name to 127.0.1.1) would make rank 0 bind loopback and the
//!   other machines time out: refused at once, with the fix.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use super::token_file::{self, PrivateDir, TokenFile};
use super::StoreServer;
use crate::env::{ALLOW_OPEN_STORE, JOB_TOKEN};
use crate::error::{Error, Result};
use crate::process::ProcessState;

/// How the store of a job that no `accelerate-launch` started is protected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Protection {
    /// By the token every rank was given in `ACCELERATE_JOB_TOKEN`.
    Given(String),
    /// By a random token that rank 0 keeps in a file only this user can read (one machine).
    TokenFile,
    /// By nothing: `ACCELERATE_ALLOW_OPEN_STORE` is set.
    Open,
}

/// How rank 0 hosts the store for the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPlan {
    /// The address to bind.
    pub bind: SocketAddr,
    /// The token that protects it.
    pub protection: Protection,
    /// What to tell the user before serving, if anything.
    pub warning: Option<String>,
}

/// Whether the job's processes span several machines.
fn spans_machines(state: &ProcessState) -> bool {
    state.local_world_size < state.world_size
}

/// Whether the user opted out of the token (`ACCELERATE_ALLOW_OPEN_STORE`).
fn open_store_allowed() -> Result<bool> {
    Ok(crate::env::read(
        ALLOW_OPEN_STORE,
        crate::env::SWITCH_VALUES,
        crate::env::switch,
    )?
    .unwrap_or(false))
}

/// Which token protects the store of the job `state` describes (see the module's
/// documentation); `allow_open` is the value of `ACCELERATE_ALLOW_OPEN_STORE`. Every rank asks,
/// so that on several machines without a token every rank stops with the fix, not only rank 0.
pub fn protection(state: &ProcessState, allow_open: bool) -> Result<Protection> {
    if !state.job_token.is_empty() {
        return Ok(Protection::Given(state.job_token.clone()));
    }
    if allow_open {
        return Ok(Protection::Open);
    }
    if spans_machines(state) {
        return Err(Error::Env {
            name: JOB_TOKEN.into(),
            value: String::new(),
            problem: format!(
                "unset, but the job's {} processes span several machines ({} on this one), and \
                 without a token anyone who reaches rank 0's store could join the job, read the \
                 ranks' addresses and take a rank's place in the ring. Set {JOB_TOKEN} to the \
                 same random string for every rank (e.g. `export {JOB_TOKEN}=$(openssl rand -hex \
                 16)` before torchrun or srun, and `-x {JOB_TOKEN}` for mpirun), or, on a closed \
                 network where everyone who can reach the machines may join the job, set \
                 {ALLOW_OPEN_STORE}=1 for every rank",
                state.world_size, state.local_world_size
            ),
        });
    }
    Ok(Protection::TokenFile)
}

/// Refuses a `MASTER_ADDR` host name that resolved (to `store`) to a loopback address while the
/// job spans several machines: the other machines could not reach the store there. A literal
/// loopback address is taken as meant: "machines" that share one host (network namespaces,
/// tests of a multi-machine job on one computer) do reach it.
pub fn check_master_addr(state: &ProcessState, store: SocketAddr) -> Result<()> {
    let named = state.master_addr.trim().parse::<IpAddr>().is_err();
    if named && store.ip().is_loopback() && spans_machines(state) {
        return Err(Error::Env {
            name: "MASTER_ADDR".into(),
            value: state.master_addr.clone(),
            problem: format!(
                "it resolves to the loopback address {} on this machine, but the job's {} \
                 processes span several machines ({} on this one), which cannot reach a \
                 loopback address; set MASTER_ADDR to the first machine's IP address on the \
                 network the machines share (e.g. the first address `hostname -I` prints there), \
                 or map its host name to that address in /etc/hosts instead of 127.0.1.1",
                store.ip(),
                state.world_size,
                state.local_world_size
            ),
        });
    }
    Ok(())
}

/// Where rank 0 binds the store that `store` (the resolved `MASTER_ADDR` and port) names, which
/// token protects it (`allow_open`: `ACCELERATE_ALLOW_OPEN_STORE`), and the warning for a store
/// without one.
pub fn plan_hosting(state: &ProcessState, store: SocketAddr, allow_open: bool) -> Result<HostPlan> {
    check_master_addr(state, store)?;
    let protection = protection(state, allow_open)?;
    let bind = if store.ip().is_loopback() {
        store
    } else {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), store.port())
    };
    let warning = (protection == Protection::Open).then(|| {
        let reach = if bind.ip().is_loopback() {
            "every user of this machine".to_string()
        } else {
            format!("anyone who can reach port {} of this machine", bind.port())
        };
        format!(
            "WARNING: {ALLOW_OPEN_STORE} is set, so rank 0 hosts the rendezvous store on {bind} \
             with no job token: {reach} can join this job, read what its ranks publish and take \
             a rank's place. Unset it and set {JOB_TOKEN} to the same random string for every \
             rank unless the network is closed."
        )
    });
    Ok(HostPlan {
        bind,
        protection,
        warning,
    })
}

/// `e`, a failure to keep the job's token in its file, with the way to do without the file.
fn without_a_token_file(e: Error) -> Error {
    match e {
        Error::Config(_) => e, // already says what to do
        other => Error::Config(format!(
            "{other}: with no {JOB_TOKEN}, a job on one machine keeps its token in a file there \
             (every rank must see the same $XDG_RUNTIME_DIR or temporary folder: not so for ranks \
             in containers with private /tmp folders); set {JOB_TOKEN} to the same random string \
             for every rank (e.g. `export {JOB_TOKEN}=$(openssl rand -hex 16)`) to do without it"
        )),
    }
}

/// The name of this job's token file, for the store on `store`'s port.
fn token_file_name(state: &ProcessState, store: SocketAddr) -> String {
    let run = token_file::run_id(state.launcher, crate::env::value);
    token_file::file_name(store.port(), run.as_deref())
}

/// Starts the store rank 0 hosts when no `accelerate-launch` did, after [`plan_hosting`] (its
/// warning printed to stderr). On one machine without a given token it first writes the job's
/// token file, which goes when the store stops. Clients must prove they hold the token, and
/// belong to the restart generation.
pub fn host_for_job(state: &ProcessState, store: SocketAddr) -> Result<StoreServer> {
    let plan = plan_hosting(state, store, open_store_allowed()?)?;
    if let Some(warning) = &plan.warning {
        tracing::warn!("{warning}");
        eprintln!("accelerate: {warning}");
    }
    let generation = u64::from(state.restart_count);
    match plan.protection {
        Protection::Given(token) => StoreServer::start(plan.bind, token, generation),
        Protection::Open => StoreServer::start(plan.bind, String::new(), generation),
        Protection::TokenFile => {
            // Written before the port is bound: a rank that reaches the store finds this
            // job's token, never an earlier job's.
            let dir = PrivateDir::for_this_user().map_err(without_a_token_file)?;
            let file = TokenFile::create(dir, &token_file_name(state, store))
                .map_err(without_a_token_file)?;
            let mut server = StoreServer::start(plan.bind, file.token().to_string(), generation)?;
            server.keep_token_file(file);
            Ok(server)
        }
    }
}

/// The token this rank presents to the job's store at `store` when no `accelerate-launch`
/// started the job: the given one, none (opted out), or, on one machine, the one in the job's
/// token file, read once the store answers (rank 0 writes the file before it listens), waiting
/// for that up to `timeout`.
pub(crate) fn job_token(
    state: &ProcessState,
    store: SocketAddr,
    timeout: Duration,
) -> Result<String> {
    match protection(state, open_store_allowed()?)? {
        Protection::Given(token) => Ok(token),
        Protection::Open => Ok(String::new()),
        Protection::TokenFile => {
            let who = format!("rank {}", state.rank);
            drop(super::client::dial(
                store,
                &who,
                timeout,
                Instant::now() + timeout,
            )?);
            let dir = PrivateDir::for_this_user().map_err(without_a_token_file)?;
            let name = token_file_name(state, store);
            TokenFile::read(&dir, &name).map_err(|e| {
                Error::Config(format!(
                    "{who} found no job token for the store at {store}: {e}. With no \
                     {JOB_TOKEN}, rank 0 of a job on one machine writes a token to {} before \
                     its store listens, and every rank reads it there. If the job's ranks run on \
                     several machines (its launcher may not say how many run on each: set \
                     LOCAL_WORLD_SIZE), or as different users, set {JOB_TOKEN} to the same \
                     random string for every rank",
                    dir.path().join(&name).display()
                ))
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::store::{Store, TcpStoreClient};
    use crate::process::Launcher;

    /// Rank 0 of a torchrun job of `world` processes, `local` of them on this machine.
    fn rank0(world: usize, local: usize, token: &str) -> ProcessState {
        ProcessState {
            world_size: world,
            local_world_size: local,
            master_addr: "node001".into(),
            job_token: token.into(),
            launcher: Launcher::Torchrun,
            ..ProcessState::single()
        }
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_master_addr_on_loopback_is_refused_for_a_job_on_several_machines() {
        // Debian maps the host's own name to 127.0.1.1.
        let e = plan_hosting(&rank0(8, 4, ""), addr("127.0.1.1:29501"), false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("MASTER_ADDR") && e.contains("127.0.1.1") && e.contains("hostname -I"),
            "{e}"
        );
        // Every rank checks, not only the host.
        let other = ProcessState {
            rank: 5,
            ..rank0(8, 4, "")
        };
        assert!(check_master_addr(&other, addr("127.0.0.1:29501")).is_err());
        // An address given as loopback is meant: machines that share one host reach it.
        let literal = ProcessState {
            master_addr: "127.0.0.1".into(),
            ..other
        };
        assert!(check_master_addr(&literal, addr("127.0.0.1:29501")).is_ok());
        // On one machine loopback is right, and nothing else can reach the store.
        let one_machine = plan_hosting(&rank0(4, 4, ""), addr("127.0.1.1:29501"), false).unwrap();
        assert_eq!(one_machine.bind, addr("127.0.1.1:29501"));
        assert_eq!(one_machine.protection, Protection::TokenFile);
        assert_eq!(one_machine.warning, None);
    }

    #[test]
    fn a_job_on_several_machines_without_a_token_is_refused_naming_the_opt_out() {
        let e = plan_hosting(&rank0(8, 4, ""), addr("10.0.0.1:29501"), false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ACCELERATE_JOB_TOKEN") && e.contains("ACCELERATE_ALLOW_OPEN_STORE"),
            "{e}"
        );
        // Every rank refuses, not only the one that would host the store.
        let other = ProcessState {
            rank: 5,
            ..rank0(8, 4, "")
        };
        let e = protection(&other, false).unwrap_err().to_string();
        assert!(e.contains("ACCELERATE_JOB_TOKEN=\"\""), "{e}");
        // A given token protects it; so does nothing, when the user says the network is closed,
        // and then rank 0 warns.
        let with_token =
            plan_hosting(&rank0(8, 4, "s3cret"), addr("10.0.0.1:29501"), false).unwrap();
        assert_eq!(with_token.bind, addr("0.0.0.0:29501"));
        assert_eq!(with_token.protection, Protection::Given("s3cret".into()));
        assert_eq!(with_token.warning, None);
        let open = plan_hosting(&rank0(8, 4, ""), addr("10.0.0.1:29501"), true).unwrap();
        assert_eq!(open.protection, Protection::Open);
        let warning = open
            .warning
            .expect("no warning for a store without a token");
        assert!(
            warning.contains("ACCELERATE_ALLOW_OPEN_STORE") && warning.contains("port 29501"),
            "{warning}"
        );
    }

    #[test]
    fn a_one_machine_store_without_a_given_token_refuses_a_client_without_one() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let local = ProcessState {
            master_addr: "127.0.0.1".into(),
            ..rank0(2, 2, "")
        };
        let store = SocketAddr::from(([127, 0, 0, 1], port));
        let server = host_for_job(&local, store).unwrap();
        let wait = Duration::from_secs(10);
        let intruder = TcpStoreClient::connect(server.local_addr(), "", 0, 1, wait);
        assert!(
            intruder.is_err(),
            "a client without a token joined a one-machine job's store"
        );
        // The job's ranks find the token rank 0 wrote, and get in with it.
        let rank1 = ProcessState { rank: 1, ..local };
        let token = job_token(&rank1, store, wait).unwrap();
        assert_eq!(token.len(), 64);
        let joined = TcpStoreClient::connect(server.local_addr(), &token, 0, 1, wait).unwrap();
        joined.set("k", b"v").unwrap();
        // The token file goes with the store.
        let file = PrivateDir::for_this_user()
            .unwrap()
            .path()
            .join(token_file_name(&rank1, store));
        assert!(file.exists());
        drop(joined);
        drop(server);
        assert!(!file.exists(), "{} outlived the store", file.display());
    }

    #[test]
    fn the_hosted_store_requires_the_job_token() {
        let server = host_for_job(&rank0(2, 2, "s3cret"), addr("127.0.0.1:0")).unwrap();
        let wait = Duration::from_secs(10);
        let e = TcpStoreClient::connect(server.local_addr(), "", 0, 1, wait).unwrap_err();
        assert!(e.to_string().contains("wrong job token"), "{e}");
        let rank1 = TcpStoreClient::connect(server.local_addr(), "s3cret", 0, 1, wait).unwrap();
        rank1.set("k", b"v").unwrap();
    }
}
