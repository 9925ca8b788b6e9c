//! The shared-memory transport: collectives between the ranks of one machine through a mapping
//! they all share, instead of TCP over loopback.
//!
//! - `setup`: rank 0 decides the transport for everyone, creates the mapping, unlinks it once
//!   every rank has mapped it.
//! - `region`: the layout of the mapping (control words, staging slots).
//! - `session`: waiting on peers (spin, then futex), failure detection and abort, staging.
//! - `collectives`: the algorithms.
//! - `futex`, `process`: the operating-system pieces (sleeping on a shared word; host identity
//!   and process liveness).
//!
//! `CommStats::bytes_sent` counts, over shared memory, the payload bytes a rank copies into its
//! staging slot for the others to read: the whole tensor per all-reduce (the pieces it does not
//! own, then its reduced piece), the tensor on the root of a broadcast (nothing elsewhere), its
//! own block per all-gather, nothing for a barrier.

mod collectives;
mod futex;
pub(crate) mod region;
pub(crate) mod session;
pub(crate) mod setup;

#[cfg(test)]
mod tests;

pub(crate) use collectives::{all_gather, all_reduce, barrier, broadcast, reduce_scatter};
pub(crate) use session::{ShmLinks, ShmSession};
#[cfg(test)]
pub(crate) use setup::Plan;
pub(crate) use setup::{confirm_tcp, join, Joined};
