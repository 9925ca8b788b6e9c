//! Sleeping on a 32-bit word of the shared mapping until another process changes it.
//!
//! On Linux this is the futex system call without `FUTEX_PRIVATE_FLAG`, which keys waiters by
//! the physical page, so it works between processes (and between threads with separate mappings
//! of the same file). Elsewhere the waiter simply naps; the callers re-check in a loop anyway.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps while `word` holds `expected`, at most `timeout`. May return early (spuriously, or
/// because the value already differed): callers re-check their condition.
pub(crate) fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    #[cfg(target_os = "linux")]
    {
        let timeout = libc::timespec {
            tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `word` is a valid, aligned 32-bit word for the duration of the call; the
        // kernel only reads it and the timespec.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT,
                expected,
                &timeout as *const libc::timespec,
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (word, expected);
        std::thread::sleep(timeout.min(Duration::from_micros(200)));
    }
}

/// Wakes every process sleeping in [`wait`] on `word`.
pub(crate) fn wake_all(word: &AtomicU32) {
    #[cfg(target_os = "linux")]
    // SAFETY: as in `wait`; FUTEX_WAKE does not even read the word.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
    #[cfg(not(target_os = "linux"))]
    let _ = word;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn a_sleeper_sees_the_change_of_its_word() {
        let word = Arc::new(AtomicU32::new(0));
        let sleeper = {
            let word = word.clone();
            std::thread::spawn(move || {
                // Bounded: even a lost wake-up ends with the 10 s timeouts.
                let start = Instant::now();
                while word.load(Ordering::SeqCst) == 0 && start.elapsed() < Duration::from_secs(10)
                {
                    wait(&word, 0, Duration::from_secs(1));
                }
                word.load(Ordering::SeqCst)
            })
        };
        word.store(5, Ordering::SeqCst);
        wake_all(&word);
        assert_eq!(sleeper.join().unwrap(), 5);
        // A value that already differs returns at once instead of sleeping.
        wait(&word, 4, Duration::from_secs(30));
    }
}
