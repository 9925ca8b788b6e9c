//! Choosing the transport of a job and, for shared memory, creating and joining the mapping.
//!
//! Rank 0 decides for everyone, so that all ranks make the same choice:
//!
//! 1. Every rank publishes its transport choice and host identity (`cpu_comm/<i>/host<r>`).
//!    A rank that chose `tcp` then connects the TCP ring at once and reads the plan afterwards,
//!    so TCP ranks do not wait for rank 0 before publishing their ring addresses. (If rank 0
//!    chose otherwise, rank 0 fails with the reason at once; such a rank fails when its ring
//!    setup times out.)
//! 2. Rank 0 reads them all. Disagreeing choices are refused; `tcp` gives TCP; ranks on several
//!    machines give TCP under `auto` and an error under `shm`. Otherwise rank 0 creates the
//!    mapping under a name no earlier job can have used (a random nonce) and publishes the plan
//!    (`cpu_comm/<i>/plan`).
//! 3. Every rank maps the file, checks it, records its pid there and reports
//!    (`cpu_comm/<i>/mapped<r>`). Rank 0 unlinks the file once all have reported (or on any
//!    failure), so it disappears whatever happens next, and publishes the outcome
//!    (`cpu_comm/<i>/final`). A rank that could not map it makes everybody fall back to TCP
//!    under `auto`, and fail under `shm`.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde::{de::DeserializeOwned, Deserialize, Serialize};

use super::region::{self, Layout, Region};
use super::session::ShmLinks;
use crate::comm::cpu::options::{CpuCommOptions, TransportChoice};
use crate::comm::host_identity::{self, HostIdentity};
use crate::comm::keys::{KeySpace, CPU_COMM};
use crate::comm::store::Store;
use crate::env::CPU_TRANSPORT;
use crate::error::{Error, Result};

/// Where mappings are created: the tmpfs every Linux system mounts for POSIX shared memory.
const SHM_DIR: &str = "/dev/shm";
/// Most staging memory per rank (two halves), whatever the world size and chunk size: the
/// default 512 KiB pieces up to 4 ranks, smaller pieces beyond, so that 8 ranks take 32 MiB of
/// `/dev/shm` in all.
pub(crate) const MAX_SLOT_BYTES: usize = 4 << 20;

/// What a rank publishes in step 1.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HostCard {
    /// The transport the rank was asked to use.
    pub choice: TransportChoice,
    /// Its view of the world size.
    pub world_size: u64,
    /// `None` where this system does not identify itself: never matches anybody.
    pub host: Option<HostIdentity>,
}

/// Rank 0's decision in step 2.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Plan {
    /// Connect the TCP ring; the reason is logged.
    Tcp(String),
    /// Map the file at `path`, whose header holds `nonce`.
    Shm {
        /// The file in /dev/shm.
        path: PathBuf,
        /// Proves that a file is this job's mapping.
        nonce: u128,
    },
    /// Every rank fails with this configuration error.
    Refuse(String),
}

/// What the job uses.
#[derive(Debug)]
pub(crate) enum Joined {
    /// The shared mapping.
    Shm(ShmLinks),
    /// The TCP ring, still to be connected.
    Tcp,
}

/// Decides the transport with the other ranks and joins the mapping when it is shared memory.
/// `instance` separates communicators created one after another on the same store.
pub(crate) fn join(
    store: &dyn Store,
    rank: usize,
    world_size: usize,
    instance: u64,
    options: &CpuCommOptions,
) -> Result<Joined> {
    let deadline = Instant::now() + options.timeout;
    let key = |name: &str| KeySpace::of(CPU_COMM, instance).key(name);
    let card = HostCard {
        choice: options.transport,
        world_size: world_size as u64,
        host: HostIdentity::of_this_process(),
    };
    store.set(&key(&format!("host{rank}")), &encode(&card)?)?;
    if rank != 0 && options.transport == TransportChoice::Tcp {
        // Connect the ring first and check rank 0's plan afterwards ([`confirm_tcp`]), so that
        // a TCP rank publishes its ring address without waiting for rank 0, as before shared
        // memory existed.
        return Ok(Joined::Tcp);
    }

    // Rank 0 keeps the file only until everybody reported: the guard unlinks it on every way
    // out of this function.
    let mut unlink_guard = None;
    let plan = if rank == 0 {
        let plan = make_plan(store, world_size, &card, options, deadline, &key)?;
        if let Plan::Shm { path, .. } = &plan {
            unlink_guard = Some(Unlink(path.clone()));
        }
        store.set(&key("plan"), &encode(&plan)?)?;
        plan
    } else {
        read(store, &key("plan"), 0, rank, deadline, options)?
    };
    let (path, nonce) = match plan {
        Plan::Tcp(reason) => {
            if options.transport != TransportChoice::Tcp {
                tracing::info!("rank {rank}: collectives over TCP: {reason}");
            }
            return Ok(Joined::Tcp);
        }
        Plan::Refuse(reason) => return Err(Error::Config(reason)),
        Plan::Shm { path, nonce } => (path, nonce),
    };

    // Step 3.
    let mapped = Region::open(&path, world_size, nonce);
    if let Ok(region) = &mapped {
        region
            .pid(rank)
            .store(std::process::id(), Ordering::Relaxed);
        region
            .start_time(rank)
            .store(host_identity::own_start_time(), Ordering::Relaxed);
    }
    let status: std::result::Result<(), String> = mapped.as_ref().map(|_| ()).map_err(Clone::clone);
    store.set(&key(&format!("mapped{rank}")), &encode(&status)?)?;

    let outcome: std::result::Result<(), String> = if rank == 0 {
        let mut outcome = Ok(());
        for q in 0..world_size {
            let theirs: std::result::Result<(), String> = read(
                store,
                &key(&format!("mapped{q}")),
                q,
                rank,
                deadline,
                options,
            )?;
            if let Err(problem) = theirs {
                outcome = Err(format!(
                    "rank {q} could not map {}: {problem}",
                    path.display()
                ));
                break;
            }
        }
        drop(unlink_guard);
        store.set(&key("final"), &encode(&outcome)?)?;
        outcome
    } else {
        read(store, &key("final"), 0, rank, deadline, options)?
    };
    match (outcome, mapped) {
        (Ok(()), Ok(region)) => Ok(Joined::Shm(ShmLinks::new(
            region,
            rank,
            options.busy_limit(),
            options.liveness.clone(),
        ))),
        (Err(problem), _) if options.transport == TransportChoice::Auto => {
            tracing::warn!("rank {rank}: shared memory unavailable ({problem}); using TCP");
            Ok(Joined::Tcp)
        }
        (Err(problem), _) => Err(Error::Config(format!(
            "{CPU_TRANSPORT}=shm, but {problem}; check that {SHM_DIR} is mounted and shared by \
             all ranks, or use {CPU_TRANSPORT}=auto or tcp"
        ))),
        (Ok(()), Err(problem)) => Err(Error::Config(format!(
            "internal: rank 0 reported that every rank mapped the shared memory, but this one \
             failed: {problem}"
        ))),
    }
}

/// After the TCP ring is connected: a rank that chose `tcp` (and so did not wait for rank 0's
/// plan) checks that rank 0 agreed.
pub(crate) fn confirm_tcp(
    store: &dyn Store,
    rank: usize,
    instance: u64,
    options: &CpuCommOptions,
) -> Result<()> {
    if rank == 0 || options.transport != TransportChoice::Tcp {
        return Ok(());
    }
    let deadline = Instant::now() + options.timeout;
    let key = KeySpace::of(CPU_COMM, instance).key("plan");
    match read(store, &key, 0, rank, deadline, options)? {
        Plan::Tcp(_) => Ok(()),
        Plan::Refuse(reason) => Err(Error::Config(reason)),
        Plan::Shm { .. } => Err(Error::Config(format!(
            "rank 0 chose shared memory although rank {rank} was started with \
             {CPU_TRANSPORT}=tcp; set the same value for every process of the job"
        ))),
    }
}

/// Rank 0's step 2.
fn make_plan(
    store: &dyn Store,
    world_size: usize,
    mine: &HostCard,
    options: &CpuCommOptions,
    deadline: Instant,
    key: &dyn Fn(&str) -> String,
) -> Result<Plan> {
    let mut cards = vec![mine.clone()];
    for q in 1..world_size {
        cards.push(read(
            store,
            &key(&format!("host{q}")),
            q,
            0,
            deadline,
            options,
        )?);
    }
    if let Some((q, other)) = cards
        .iter()
        .enumerate()
        .find(|(_, c)| c.world_size != mine.world_size)
    {
        return Ok(Plan::Refuse(format!(
            "rank {q} was started with world size {} but rank 0 with {}; all processes of a \
             job must agree (check WORLD_SIZE / --num-processes)",
            other.world_size, mine.world_size
        )));
    }
    if let Some((q, other)) = cards
        .iter()
        .enumerate()
        .find(|(_, c)| c.choice != mine.choice)
    {
        return Ok(Plan::Refuse(format!(
            "rank 0 was started with {CPU_TRANSPORT}={} but rank {q} with {}; set the same \
             value for every process of the job",
            mine.choice.name(),
            other.choice.name()
        )));
    }
    if mine.choice == TransportChoice::Tcp {
        return Ok(Plan::Tcp(format!("{CPU_TRANSPORT}=tcp")));
    }
    let elsewhere = cards
        .iter()
        .enumerate()
        .find(|(_, c)| c.host.is_none() || c.host != mine.host);
    if let Some((q, other)) = elsewhere {
        let describe = |h: &Option<HostIdentity>| match h {
            Some(h) => h.to_string(),
            None => "an unidentifiable host".to_string(),
        };
        let what = format!(
            "rank {q} runs on {} and rank 0 on {}",
            describe(&other.host),
            describe(&mine.host)
        );
        return Ok(match mine.choice {
            TransportChoice::Shm => Plan::Refuse(format!(
                "{CPU_TRANSPORT}=shm needs every rank on one machine, but {what}; use \
                 {CPU_TRANSPORT}=auto (shared memory only within one machine) or tcp"
            )),
            _ => Plan::Tcp(format!("the ranks are on several machines: {what}")),
        });
    }
    let nonce: u128 = rand::random();
    let path = Path::new(SHM_DIR).join(format!("accelerate-rs-{nonce:032x}"));
    let layout = Layout {
        world_size,
        piece_bytes: region::piece_bytes_for(options.chunk_bytes, world_size, MAX_SLOT_BYTES),
    };
    match Region::create(&path, layout, nonce) {
        // Rank 0 maps the file again in step 3, like everybody; this mapping only created it.
        Ok(_) => Ok(Plan::Shm { path, nonce }),
        Err(e) => {
            let problem = format!(
                "creating {} ({} bytes) failed: {e}",
                path.display(),
                layout.total_bytes()
            );
            let _ = std::fs::remove_file(&path);
            Ok(match mine.choice {
                TransportChoice::Shm => Plan::Refuse(format!(
                    "{CPU_TRANSPORT}=shm, but {problem}; check that {SHM_DIR} is mounted and \
                     has room, or use {CPU_TRANSPORT}=auto or tcp"
                )),
                _ => Plan::Tcp(format!("shared memory unavailable: {problem}")),
            })
        }
    }
}

/// Removes the mapping's file when dropped.
struct Unlink(PathBuf);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Decodes a record (a [`HostCard`] or [`Plan`]) read from the store; `Err` says what is
/// malformed.
pub(crate) fn decode_record<T: DeserializeOwned>(bytes: &[u8]) -> std::result::Result<T, String> {
    bincode::deserialize(bytes).map_err(|e| e.to_string())
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    bincode::serialize(value)
        .map_err(|e| Error::Store(format!("encoding the shared memory setup: {e}")))
}

/// Reads what rank `peer` published under `key`, waiting until `deadline`.
fn read<T: DeserializeOwned>(
    store: &dyn Store,
    key: &str,
    peer: usize,
    rank: usize,
    deadline: Instant,
    options: &CpuCommOptions,
) -> Result<T> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(std::time::Duration::from_millis(1));
    let bytes = match store.get(key, left) {
        Ok(bytes) => bytes,
        Err(Error::Timeout { .. }) => {
            return Err(Error::Timeout {
                what: format!(
                    "rank {peer} to take part in choosing the transport (seen from rank {rank}, \
                     key {key:?})"
                ),
                after: options.timeout,
                hint: format!(
                    "rank {peer} may have failed to start or be stuck before creating its \
                     communicator; {}",
                    crate::comm::cpu::transport::timeout_hint()
                ),
            })
        }
        Err(e) => return Err(e),
    };
    decode_record(&bytes).map_err(|e| {
        Error::Store(format!(
            "rank {rank}: what rank {peer} published under {key:?} is unreadable ({e}); every \
             process of a job must run the same version, and no other program may use these \
             store keys"
        ))
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::comm::store::{StoreServer, TcpStoreClient};

    /// Rank 0's plan when the ranks publish `cards` (rank 0's first) and rank 0 chose `choice`.
    fn plan_for(cards: &[HostCard]) -> Plan {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "t".into(), 0).unwrap();
        let store = TcpStoreClient::connect(server.local_addr(), "t", 0, 0, Duration::from_secs(5))
            .unwrap();
        let key = |name: &str| format!("cpu_comm/1/{name}");
        for (q, card) in cards.iter().enumerate().skip(1) {
            store
                .set(&key(&format!("host{q}")), &encode(card).unwrap())
                .unwrap();
        }
        let options = CpuCommOptions {
            transport: cards[0].choice,
            timeout: Duration::from_secs(5),
            ..Default::default()
        };
        let deadline = Instant::now() + options.timeout;
        make_plan(&store, cards.len(), &cards[0], &options, deadline, &key).unwrap()
    }

    fn card(choice: TransportChoice, boot: &str) -> HostCard {
        HostCard {
            choice,
            world_size: 3,
            host: Some(HostIdentity {
                hostname: "node".into(),
                boot_id: boot.into(),
                pid_namespace: "pid:[1]".into(),
                net_namespace: "net:[1]".into(),
            }),
        }
    }

    #[test]
    fn ranks_of_one_machine_get_a_fresh_mapping() {
        use TransportChoice::*;
        for choice in [Auto, Shm] {
            let plan = plan_for(&[card(choice, "a"), card(choice, "a"), card(choice, "a")]);
            let Plan::Shm { path, nonce } = plan else {
                panic!("{choice:?}: {plan:?}");
            };
            assert!(path.starts_with(SHM_DIR));
            // The file exists, holds this nonce and is sized for three ranks.
            let region = Region::open(&path, 3, nonce).unwrap();
            assert_eq!(region.layout().world_size, 3);
            std::fs::remove_file(&path).unwrap();
        }
    }

    #[test]
    fn ranks_on_other_machines_get_tcp_under_auto_and_an_error_under_shm() {
        use TransportChoice::*;
        let plan = plan_for(&[card(Auto, "a"), card(Auto, "a"), card(Auto, "b")]);
        assert!(
            matches!(&plan, Plan::Tcp(why) if why.contains("rank 2")),
            "{plan:?}"
        );
        let plan = plan_for(&[card(Shm, "a"), card(Shm, "b"), card(Shm, "a")]);
        let Plan::Refuse(why) = plan else {
            panic!("{plan:?}")
        };
        assert!(
            why.contains(CPU_TRANSPORT) && why.contains("rank 1"),
            "{why}"
        );
        assert!(why.contains("one machine"), "{why}");
        // A rank in another network namespace of the same kernel is another machine.
        let mut other_network = card(Auto, "a");
        if let Some(host) = &mut other_network.host {
            host.net_namespace = "net:[2]".into();
        }
        let plan = plan_for(&[card(Auto, "a"), card(Auto, "a"), other_network]);
        assert!(
            matches!(&plan, Plan::Tcp(why) if why.contains("rank 2") && why.contains("net:[2]")),
            "{plan:?}"
        );
        // A rank that cannot identify its host is never assumed to share memory.
        let mut anonymous = card(Auto, "a");
        anonymous.host = None;
        let plan = plan_for(&[card(Auto, "a"), anonymous, card(Auto, "a")]);
        assert!(matches!(plan, Plan::Tcp(_)), "{plan:?}");
    }

    #[test]
    fn tcp_is_used_when_chosen_and_disagreements_are_refused() {
        use TransportChoice::*;
        let plan = plan_for(&[card(Tcp, "a"), card(Tcp, "a"), card(Tcp, "a")]);
        assert!(matches!(plan, Plan::Tcp(_)), "{plan:?}");
        let plan = plan_for(&[card(Auto, "a"), card(Auto, "a"), card(Tcp, "a")]);
        let Plan::Refuse(why) = plan else {
            panic!("{plan:?}")
        };
        assert!(why.contains("rank 2 with tcp"), "{why}");
        let mut bigger = card(Auto, "a");
        bigger.world_size = 4;
        let plan = plan_for(&[card(Auto, "a"), bigger, card(Auto, "a")]);
        let Plan::Refuse(why) = plan else {
            panic!("{plan:?}")
        };
        assert!(
            why.contains("rank 1 was started with world size 4"),
            "{why}"
        );
    }
}
