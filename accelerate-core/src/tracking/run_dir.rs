//! The logging directory of a run: a fresh `runs/<YYYYmmdd-HHMMSS>_<host>` when the user names
//! none (Hugging Face's Trainer logs to `<output_dir>/runs/<time>_<host>` the same way), so
//! separate runs never mix their files; and a lock on the directory, so that two live runs
//! naming the same one are refused instead of interleaving rows (CSV widening renames the file
//! under the other writer, whose rows then go to the replaced file).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use super::io_error;
use crate::error::{Error, Result};

/// The machine's host name, with path separators replaced (it goes into file names).
pub(super) fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..end]).replace(['/', '\\'], "_");
    if rc != 0 || name.is_empty() {
        "localhost".to_string()
    } else {
        name
    }
}

/// The local time now as `YYYYmmdd-HHMMSS` (Hugging Face's `%b%d_%H-%M-%S` sorts badly; this
/// sorts by time).
fn local_timestamp() -> String {
    // SAFETY: time(NULL) only returns; localtime_r writes into the zeroed tm it is given.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    let now = unsafe { libc::time(std::ptr::null_mut()) };
    if unsafe { libc::localtime_r(&now, &mut tm) }.is_null() {
        return format!("{now}");
    }
    format!(
        "{:04}{:02}{:02}-{:02}{:02}{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

/// Creates and returns a directory of this run's own under `parent`:
/// `<parent>/<YYYYmmdd-HHMMSS>_<host>`, with `-2`, `-3`, … appended when a run of the same
/// second has it (`create_dir` is atomic, so two racing runs cannot both get one name).
pub(super) fn fresh_run_dir(parent: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(parent)
        .map_err(|e| io_error(parent, "creating the logging directory", e))?;
    let base = format!("{}_{}", local_timestamp(), host_name());
    for n in 1.. {
        let dir = if n == 1 {
            parent.join(&base)
        } else {
            parent.join(format!("{base}-{n}"))
        };
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io_error(&dir, "creating the logging directory", e)),
        }
    }
    unreachable!("the suffixes run out only after u32::MAX runs in one second")
}

/// An exclusive lock on a logging directory, held while its trackers are open (`flock` on the
/// directory itself: no lock file is left behind, and the kernel drops the lock when the
/// process dies).
#[derive(Debug)]
pub(super) struct DirLock {
    _dir: File,
}

impl DirLock {
    /// Locks `dir`, or fails naming it when another live run (or tracker set) holds it.
    pub(super) fn acquire(dir: &Path) -> Result<Self> {
        let file =
            File::open(dir).map_err(|e| io_error(dir, "opening the logging directory", e))?;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                return Err(Error::Tracking {
                    path: dir.to_path_buf(),
                    problem: "another running process (or accelerator) is writing to this \
                              logging directory; give this run a `logging_dir` of its own, or \
                              leave `logging_dir` out to get a fresh runs/<time>_<host>"
                        .into(),
                });
            }
            return Err(io_error(dir, "locking the logging directory", e));
        }
        Ok(Self { _dir: file })
    }
}
