//! Where rank 0 hosts the store when no `accelerate-launch` did (torchrun, SLURM, MPI), and the
//! checks on `MASTER_ADDR` that every rank makes before joining.
//!
//! - A job on one machine binds loopback: nothing outside the machine can reach the store.
//! - A job on several machines binds every interface (0.0.0.0), so the other machines reach it.
//!   Clients must then present `ACCELERATE_JOB_TOKEN` (the same string on every rank); without
//!   one, anyone who can reach the port can join or disrupt the job, and rank 0 says so loudly.
//! - A `MASTER_ADDR` that resolves to a loopback address while the job spans machines (Debian's
//!   `/etc/hosts` maps the host's own name to 127.0.1.1) would make rank 0 bind loopback and the
//!   other machines time out: refused at once, with the fix.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use super::StoreServer;
use crate::error::{Error, Result};
use crate::state::ProcessState;

use crate::env::JOB_TOKEN;

/// How rank 0 hosts the store for the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPlan {
    /// The address to bind.
    pub bind: SocketAddr,
    /// What to tell the user before serving, if anything.
    pub warning: Option<String>,
}

/// Whether the job's processes span several machines.
fn spans_machines(state: &ProcessState) -> bool {
    state.local_world_size < state.world_size
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

/// Where rank 0 binds the store that `store` (the resolved `MASTER_ADDR` and port) names, and the
/// warning for a store open to the network without a token.
pub fn plan_hosting(state: &ProcessState, store: SocketAddr) -> Result<HostPlan> {
    check_master_addr(state, store)?;
    if store.ip().is_loopback() {
        return Ok(HostPlan {
            bind: store,
            warning: None,
        });
    }
    let bind = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), store.port());
    let warning = state.job_token.is_empty().then(|| {
        format!(
            "WARNING: rank 0 hosts the rendezvous store on {bind} (every interface) with no job \
             token: anyone who can reach port {} can join or disrupt this job. Set \
             {JOB_TOKEN} to the same random string for every rank before starting it (e.g. \
             `export {JOB_TOKEN}=$(openssl rand -hex 16)` before torchrun or srun, and \
             `-x {JOB_TOKEN}` for mpirun).",
            store.port()
        )
    });
    Ok(HostPlan { bind, warning })
}

/// Starts the store rank 0 hosts when no `accelerate-launch` did, after [`plan_hosting`] (its
/// warning printed to stderr). Clients must present the job token and restart generation.
pub fn host_for_job(state: &ProcessState, store: SocketAddr) -> Result<StoreServer> {
    let plan = plan_hosting(state, store)?;
    if let Some(warning) = &plan.warning {
        tracing::warn!("{warning}");
        eprintln!("accelerate: {warning}");
    }
    StoreServer::start(
        plan.bind,
        state.job_token.clone(),
        u64::from(state.restart_count),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::store::{Store, TcpStoreClient};
    use crate::state::Launcher;
    use std::time::Duration;

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
        let e = plan_hosting(&rank0(8, 4, ""), addr("127.0.1.1:29501"))
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
        let one_machine = plan_hosting(&rank0(4, 4, ""), addr("127.0.1.1:29501")).unwrap();
        assert_eq!(one_machine.bind, addr("127.0.1.1:29501"));
        assert_eq!(one_machine.warning, None);
    }

    #[test]
    fn a_store_open_to_the_network_warns_unless_the_job_has_a_token() {
        let open = plan_hosting(&rank0(8, 4, ""), addr("10.0.0.1:29501")).unwrap();
        assert_eq!(open.bind, addr("0.0.0.0:29501"));
        let warning = open
            .warning
            .expect("no warning for a store without a token");
        assert!(warning.contains(JOB_TOKEN), "{warning}");
        let with_token = plan_hosting(&rank0(8, 4, "s3cret"), addr("10.0.0.1:29501")).unwrap();
        assert_eq!(with_token.bind, addr("0.0.0.0:29501"));
        assert_eq!(with_token.warning, None);
    }

    #[test]
    fn a_job_on_several_machines_without_a_token_is_refused_naming_the_opt_out() {
        let e = plan_hosting(&rank0(8, 4, ""), addr("10.0.0.1:29501"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ACCELERATE_JOB_TOKEN") && e.contains("ACCELERATE_ALLOW_OPEN_STORE"),
            "{e}"
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
        let server = host_for_job(&local, SocketAddr::from(([127, 0, 0, 1], port))).unwrap();
        let intruder = TcpStoreClient::connect(server.local_addr(), "", 0, 1, Duration::from_secs(10));
        assert!(
            intruder.is_err(),
            "a client without a token joined a one-machine job's store"
        );
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
