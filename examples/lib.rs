//! Shared workloads.
