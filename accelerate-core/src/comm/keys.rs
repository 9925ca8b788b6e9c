//! Namespaces of store keys: every communicator (CPU or NCCL) and every membership (what one
//! `Accelerator` agrees on through the store: parameter signatures, loader settings) writes its
//! keys under a prefix of its own, so that a second one built on the same store never reads a key
//! the first left behind (an NCCL unique id, an arrival, a verdict).
//!
//! The prefix is `<kind>/<n>`, where `n` numbers this rank's namespaces of that kind on the store
//! (1, 2, ...): every rank counts its own, and all ranks create them in the same order, so the
//! numbers agree without a round trip between the ranks. Restarts need no number of their own:
//! each store generation starts empty (the launcher clears it; rank 0 of a torchrun attempt hosts
//! a fresh store), and a client of another generation is refused at its hello.

use std::sync::Arc;
use std::time::Duration;

use super::store::Store;
use crate::error::Result;

/// The kind of the CPU communicators' namespaces (`cpu_comm/<n>/...`).
pub(crate) const CPU_COMM: &str = "cpu_comm";
/// The kind of the NCCL communicators' namespaces.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) const NCCL_COMM: &str = "accelerate/nccl";
/// The kind of the memberships' namespaces (what an `Accelerator` keeps in the store).
pub(crate) const MEMBERSHIP: &str = "accelerate/membership";

/// The keys of one communicator or membership: `<kind>/<instance>/<name>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeySpace {
    prefix: String,
    instance: u64,
}

impl KeySpace {
    /// The namespace of this rank's next communicator (or membership) of `kind` on `store`.
    pub(crate) fn next(store: &dyn Store, kind: &str, rank: usize) -> Result<Self> {
        let instance = store.add(&format!("{kind}/rank{rank}/instances"), 1)?;
        Ok(Self::of(kind, instance as u64))
    }

    /// The namespace number `instance` of `kind`.
    pub(crate) fn of(kind: &str, instance: u64) -> Self {
        Self {
            prefix: format!("{kind}/{instance}"),
            instance,
        }
    }

    /// Its number among this rank's namespaces of its kind.
    pub(crate) fn instance(&self) -> u64 {
        self.instance
    }

    /// The key `name` in this namespace.
    pub(crate) fn key(&self, name: &str) -> String {
        format!("{}/{name}", self.prefix)
    }
}

/// The store keys of one NCCL communicator's rendezvous.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) struct NcclKeys(KeySpace);

#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
impl NcclKeys {
    /// The keys of this rank's next NCCL communicator on `store`.
    pub(crate) fn next(store: &dyn Store, rank: usize) -> Result<Self> {
        KeySpace::next(store, NCCL_COMM, rank).map(Self)
    }

    /// Where rank 0 publishes NCCL's unique id.
    pub(crate) fn unique_id(&self) -> String {
        self.0.key("unique_id")
    }

    /// Where `rank` announces that it reached the rendezvous.
    pub(crate) fn arrived(&self, rank: usize) -> String {
        self.0.key(&format!("arrived/{rank}"))
    }

    /// The barrier every rank passes before NCCL is closed.
    pub(crate) fn finished(&self) -> String {
        self.0.key("finished")
    }
}

/// A store whose keys (and barrier names) all lie in one [`KeySpace`] of another store, as
/// PyTorch's `PrefixStore`.
pub(crate) struct PrefixStore {
    inner: Arc<dyn Store>,
    keys: KeySpace,
}

impl PrefixStore {
    /// `inner`, seen through the namespace `keys`.
    pub(crate) fn new(inner: Arc<dyn Store>, keys: KeySpace) -> Self {
        Self { inner, keys }
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.keys.key(key), value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(&self.keys.key(key), timeout)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.keys.key(key), delta)
    }

    fn barrier(&self, name: &str, world_size: usize, timeout: Duration) -> Result<()> {
        self.inner
            .barrier(&self.keys.key(name), world_size, timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::store::{StoreServer, TcpStoreClient};

    const WAIT: Duration = Duration::from_secs(10);

    fn two_ranks(server: &StoreServer) -> [TcpStoreClient; 2] {
        [0, 1].map(|rank| TcpStoreClient::connect(server.local_addr(), "t", 0, rank, WAIT).unwrap())
    }

    #[test]
    fn two_nccl_communicators_on_one_store_meet_under_keys_of_their_own() {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "t".into(), 0).unwrap();
        let ranks = two_ranks(&server);
        // Each rank creates two communicators, in the same order.
        let first: Vec<NcclKeys> = ranks
            .iter()
            .enumerate()
            .map(|(r, s)| NcclKeys::next(s, r).unwrap())
            .collect();
        let second: Vec<NcclKeys> = ranks
            .iter()
            .enumerate()
            .map(|(r, s)| NcclKeys::next(s, r).unwrap())
            .collect();
        // The ranks agree on each communicator's keys...
        assert_eq!(first[0], first[1]);
        assert_eq!(second[0], second[1]);
        // ...and no key of the second is a key of the first: its ranks cannot read the first's
        // unique id, arrivals or barrier.
        let keys = |k: &NcclKeys| [k.unique_id(), k.arrived(0), k.arrived(1), k.finished()];
        for key in keys(&second[0]) {
            assert!(!keys(&first[0]).contains(&key), "{key} is shared");
        }
        // The CPU communicators count apart from them.
        let cpu = KeySpace::next(&ranks[0], CPU_COMM, 0).unwrap();
        assert_eq!(cpu.instance(), 1);
        assert_eq!(cpu.key("plan"), "cpu_comm/1/plan");
    }

    #[test]
    fn a_prefix_store_reads_and_writes_only_its_own_namespace() {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "t".into(), 0).unwrap();
        let [a, b] = two_ranks(&server);
        let (a, b): (Arc<dyn Store>, Arc<dyn Store>) = (Arc::new(a), Arc::new(b));
        let first = PrefixStore::new(
            a.clone(),
            KeySpace::next(a.as_ref(), MEMBERSHIP, 0).unwrap(),
        );
        first.set("accelerate/parameters/verdict", b"=").unwrap();
        assert_eq!(first.add("count", 2).unwrap(), 2);
        let second = PrefixStore::new(b.clone(), KeySpace::of(MEMBERSHIP, 2));
        assert!(second
            .get("accelerate/parameters/verdict", Duration::ZERO)
            .is_err());
        assert_eq!(second.add("count", 1).unwrap(), 1);
        // The same namespace on another connection sees the same keys.
        let again = PrefixStore::new(b, KeySpace::of(MEMBERSHIP, 1));
        assert_eq!(
            again
                .get("accelerate/parameters/verdict", Duration::ZERO)
                .unwrap(),
            b"="
        );
        again.barrier("done", 1, WAIT).unwrap();
    }
}
