//! Keeping freed memory in the process on the CPU.
//!
//! candle's CPU backend allocates a fresh tensor for every op, megabytes each for the weight
//! gradients of a training step. glibc's malloc serves such blocks with `mmap` (or trims them off
//! the heap) and hands them back to the kernel on free, so the next step faults every page in
//! again, thousands of page faults per micro-step. Raising the trim threshold and serving every
//! block from the heap instead of `mmap` keeps those blocks for reuse, as PyTorch's caching
//! allocator does. `mmap` is turned off rather than its threshold raised because glibc caps the
//! threshold at 32 MiB, below the attention scores of a transformer at a realistic batch. Peak
//! memory is unchanged; memory is returned at exit. BENCHMARKS.md has the figures.

/// Tells glibc's malloc to serve blocks of every size from the heap and to keep freed ones there
/// instead of returning them to the kernel. Process-wide; does nothing on other C libraries, or when
/// `ACCELERATE_KEEP_FREED_MEMORY=0`. Returns whether the setting was applied.
pub fn keep_freed_memory() -> bool {
    if crate::env::value(crate::env::KEEP_FREED_MEMORY).is_some_and(|v| v.trim() == "0") {
        return false;
    }
    apply()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn apply() -> bool {
    // 32 MiB is glibc's largest allowed mmap threshold on 64-bit targets; M_MMAP_MAX = 0 then
    // stops even larger blocks from being mapped (glibc still maps when the heap cannot grow).
    const MMAP_THRESHOLD: libc::c_int = 32 * 1024 * 1024;
    const TRIM_THRESHOLD: libc::c_int = 1 << 30;
    // SAFETY: mallopt only changes allocator parameters; it is safe to call at any time.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
            && libc::mallopt(libc::M_MMAP_MAX, 0) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn apply() -> bool {
    false
}

#[cfg(test)]
mod tests {
    #[test]
    fn glibc_accepts_the_settings() {
        if cfg!(all(target_os = "linux", target_env = "gnu")) {
            assert!(super::apply(), "mallopt refused the thresholds");
        }
    }
}
