//! Deleting directories that a committed save no longer needs: the copy a replace moved aside,
//! the oldest checkpoints beyond a keep limit. Their deletion can fail where the checkpoint itself
//! was written fine (on NFS a file still open somewhere becomes `.nfsXXXX` and makes
//! `remove_dir_all` fail until it is closed), so a failure here is a warning, never the save's
//! error: every rank has already agreed that the checkpoint is complete.

use std::path::Path;

/// Deletes the directory tree at `path` (the one place checkpoints delete directories, so tests
/// can make it fail; see `injected`).
pub(crate) fn remove_dir_all(path: &Path) -> std::io::Result<()> {
    #[cfg(test)]
    if injected::fails(path) {
        return Err(std::io::Error::other(
            "Directory not empty (injected by a test: a .nfs0000000000001234 file still open)",
        ));
    }
    std::fs::remove_dir_all(path)
}

/// Deletes `path` (what: why it is no longer needed); on failure warns (stderr and `tracing`),
/// naming it and the way out, and returns false.
pub(crate) fn remove_or_warn(path: &Path, what: &str) -> bool {
    match remove_dir_all(path) {
        Ok(()) => true,
        Err(e) => {
            warn(&format!(
                "could not delete {} ({what}): {e}; the checkpoint is saved and training goes \
                 on. Delete it by hand once nothing holds its files open (on NFS, a file still \
                 open somewhere leaves a .nfsXXXX file until it is closed)",
                path.display()
            ));
            false
        }
    }
}

/// Logs a checkpoint warning on stderr and through `tracing`.
pub(crate) fn warn(line: &str) {
    tracing::warn!("checkpoint: {line}");
    eprintln!("accelerate: warning: checkpoint: {line}");
}

/// Deletions made to fail, for tests: on this thread, any path under one registered with
/// [`fail_under`](injected::fail_under) (a real failure as root, whom permissions do not stop).
#[cfg(test)]
pub(crate) mod injected {
    use std::cell::RefCell;
    use std::path::{Path, PathBuf};

    thread_local! {
        static FAILING: RefCell<Vec<PathBuf>> = const { RefCell::new(Vec::new()) };
    }

    /// While it lives, deleting anything under the path it was made for fails on this thread.
    pub(crate) struct Failing(PathBuf);

    impl Drop for Failing {
        fn drop(&mut self) {
            FAILING.with(|f| f.borrow_mut().retain(|p| *p != self.0));
        }
    }

    /// Makes deleting `path` and anything under it fail on this thread until the guard drops.
    pub(crate) fn fail_under(path: &Path) -> Failing {
        FAILING.with(|f| f.borrow_mut().push(path.to_path_buf()));
        Failing(path.to_path_buf())
    }

    pub(super) fn fails(path: &Path) -> bool {
        FAILING.with(|f| f.borrow().iter().any(|p| path.starts_with(p)))
    }
}
