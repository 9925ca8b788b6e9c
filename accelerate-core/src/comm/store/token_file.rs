//! The job token of a job whose ranks all run on one machine, when nobody gave one: rank 0 makes
//! a random token and writes it to a file that only this user can read, and every rank of the
//! job reads it from there. So the store of such a job admits only this user's processes that
//! can read the file, and no setting is needed.
//!
//! - **Where.** In a folder of this user's: `$XDG_RUNTIME_DIR/accelerate-rs` when
//!   `XDG_RUNTIME_DIR` is a folder that belongs to this user and no one else may enter (systemd's
//!   `/run/user/UID`, on a tmpfs cleared at logout), else `accelerate-rs-UID` in the temp folder
//!   (`TMPDIR`, else `/tmp`). The folder is created with mode 0700; one that is a symbolic link,
//!   not a folder, or another user's is refused (on a shared `/tmp` someone may have made it to
//!   read the tokens), and one of ours with a looser mode is set back to 0700. It is opened once,
//!   without following links, and every file is reached through that open folder, so a link or
//!   a renamed path cannot redirect what is read or written.
//! - **Which file.** `store-PORT[-RUN].token`: the port of the job's store and, where the launcher
//!   gives one, the id of the run (torchrun's `TORCHELASTIC_RUN_ID`, SLURM's job and step,
//!   Open MPI's PMIx namespace). Only one job at a time can serve on a port.
//! - **Written atomically.** Rank 0 writes the token to a new file of mode 0600 under a temporary
//!   name and renames it into place, so a reader sees a whole token or none; it does so before
//!   its store binds the port, and the other ranks read the file only once the port answers, so
//!   they never read the file of an earlier job. The file is removed when rank 0's store stops.
//! - **Read with checks.** The file must be a regular file of this user's that no one else may
//!   read; anything else is refused.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::process::Launcher;

/// The name of the folder under `XDG_RUNTIME_DIR`; under the temp folder the user id follows it.
const FOLDER: &str = "accelerate-rs";

/// Longest token file this reads: a token is 64 hex digits.
const MAX_TOKEN_BYTES: usize = 4096;

/// A folder that belongs to this user and no one else may enter, held open.
#[derive(Debug)]
pub(crate) struct PrivateDir {
    fd: OwnedFd,
    path: PathBuf,
}

fn uid() -> libc::uid_t {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn c_name(name: &str, path: &Path) -> Result<CString> {
    CString::new(name).map_err(|_| io_error(path, "a name with a NUL byte"))
}

fn io_error(path: &Path, problem: &str) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(problem.to_string()),
    }
}

fn last_os_error(path: &Path) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source: std::io::Error::last_os_error(),
    }
}

fn fstat(fd: RawFd, path: &Path) -> Result<libc::stat> {
    // SAFETY: `stat` is plain data that fstat fills in; `fd` is open.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut stat) } != 0 {
        return Err(last_os_error(path));
    }
    Ok(stat)
}

impl PrivateDir {
    /// This user's folder for token files (see the module's documentation), created if missing.
    pub(crate) fn for_this_user() -> Result<Self> {
        if let Some(runtime) = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
            if runtime.is_absolute() && Self::only_ours(&runtime) {
                return Self::open(&runtime, FOLDER);
            }
        }
        Self::open(&std::env::temp_dir(), &format!("{FOLDER}-{}", uid()))
    }

    /// Whether `path` is a folder of this user's that no one else may enter.
    fn only_ours(path: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        std::fs::symlink_metadata(path)
            .is_ok_and(|m| m.is_dir() && m.uid() == uid() && m.mode() & 0o077 == 0)
    }

    /// The folder `name` in `parent`, created with mode 0700 if missing; refused when it is a
    /// symbolic link, not a folder, or another user's; set to 0700 when it is ours with another
    /// mode.
    pub(crate) fn open(parent: &Path, name: &str) -> Result<Self> {
        let path = parent.join(name);
        let parent_c = CString::new(parent.as_os_str().as_bytes())
            .map_err(|_| io_error(parent, "a path with a NUL byte"))?;
        let name_c = c_name(name, &path)?;
        // SAFETY: a NUL-terminated path; the returned descriptor is checked.
        let parent_fd = unsafe {
            libc::open(
                parent_c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if parent_fd < 0 {
            return Err(last_os_error(parent));
        }
        // SAFETY: a descriptor we just opened and own.
        let parent_fd = unsafe { OwnedFd::from_raw_fd(parent_fd) };
        // SAFETY: a NUL-terminated name relative to an open folder.
        if unsafe { libc::mkdirat(parent_fd.as_raw_fd(), name_c.as_ptr(), 0o700) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::AlreadyExists {
                return Err(Error::Io { path, source: e });
            }
        }
        // SAFETY: as above; O_NOFOLLOW refuses a symbolic link in place of the folder.
        let fd = unsafe {
            libc::openat(
                parent_fd.as_raw_fd(),
                name_c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(Error::Config(format!(
                "{} cannot be this user's private folder for job tokens ({e}): it is a \
                 symbolic link or not a folder. Someone may be trying to read your jobs' \
                 tokens; remove it, or set ACCELERATE_JOB_TOKEN to a random string for every \
                 rank (e.g. `export ACCELERATE_JOB_TOKEN=$(openssl rand -hex 16)`)",
                path.display()
            )));
        }
        // SAFETY: a descriptor we just opened and own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let stat = fstat(fd.as_raw_fd(), &path)?;
        if stat.st_uid != uid() {
            return Err(Error::Config(format!(
                "{} belongs to user {}, not to this user ({}), so it cannot keep this user's \
                 job tokens private: someone may be trying to read them. Remove it, or set \
                 ACCELERATE_JOB_TOKEN to a random string for every rank (e.g. `export \
                 ACCELERATE_JOB_TOKEN=$(openssl rand -hex 16)`)",
                path.display(),
                stat.st_uid,
                uid()
            )));
        }
        if stat.st_mode & 0o777 != 0o700 {
            // Ours, with a mode that lets others in (or a umask that took our own bits).
            // SAFETY: fchmod on a descriptor we own.
            if unsafe { libc::fchmod(fd.as_raw_fd(), 0o700) } != 0 {
                return Err(last_os_error(&path));
            }
        }
        Ok(Self { fd, path })
    }

    /// Where the folder is.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

/// The name of the token file of the store on `port` of run `run` (see the module's
/// documentation). The run id is kept to letters, digits, `.`, `-` and `_`.
pub(crate) fn file_name(port: u16, run: Option<&str>) -> String {
    match run.map(str::trim).filter(|r| !r.is_empty()) {
        None => format!("store-{port}.token"),
        Some(run) => {
            let run: String = run
                .chars()
                .take(64)
                .map(|c| {
                    if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                        c
                    } else {
                        '_'
                    }
                })
                .collect();
            format!("store-{port}-{run}.token")
        }
    }
}

/// The id of this run where the launcher gives one, so that the token file names the run as
/// well as the port: torchrun's `TORCHELASTIC_RUN_ID`; SLURM's `SLURM_JOB_ID` and
/// `SLURM_STEP_ID`; Open MPI's PMIx namespace. `get` reads a variable.
pub(crate) fn run_id(launcher: Launcher, get: impl Fn(&str) -> Option<String>) -> Option<String> {
    match launcher {
        Launcher::Torchrun => get("TORCHELASTIC_RUN_ID"),
        Launcher::Slurm => {
            let job = get("SLURM_JOB_ID")?;
            Some(match get("SLURM_STEP_ID") {
                Some(step) => format!("{job}.{step}"),
                None => job,
            })
        }
        Launcher::Mpi => get("PMIX_NAMESPACE").or_else(|| get("OMPI_MCA_ess_base_jobid")),
        Launcher::None | Launcher::Accelerate => None,
    }
}

/// A token file written by rank 0, removed when dropped (if it still holds this token).
#[derive(Debug)]
pub(crate) struct TokenFile {
    dir: PrivateDir,
    name: String,
    token: String,
}

impl TokenFile {
    /// Writes a new random token to `name` in `dir`, atomically (a new 0600 file under a
    /// temporary name, renamed into place), replacing any file of an earlier job there.
    pub(crate) fn create(dir: PrivateDir, name: &str) -> Result<Self> {
        let token = super::auth::random_token();
        let path = dir.path.join(name);
        let temporary = format!(
            ".{name}.{}.{}",
            std::process::id(),
            &super::auth::random_token()[..16]
        );
        let temporary_c = c_name(&temporary, &path)?;
        let name_c = c_name(name, &path)?;
        // SAFETY: a NUL-terminated name relative to an open folder; O_EXCL and O_NOFOLLOW make
        // this a new file, never one someone prepared.
        let fd = unsafe {
            libc::openat(
                dir.fd.as_raw_fd(),
                temporary_c.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o600 as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(last_os_error(&path));
        }
        // SAFETY: a descriptor we just opened and own.
        let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let written = (|| {
            use std::io::Write;
            // The umask may have taken bits of 0600; it can never have added any.
            // SAFETY: fchmod on a descriptor we own.
            if unsafe { libc::fchmod(file.as_raw_fd(), 0o600) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            (&file).write_all(token.as_bytes())?;
            // SAFETY: renameat of two names relative to the one open folder.
            let renamed = unsafe {
                libc::renameat(
                    dir.fd.as_raw_fd(),
                    temporary_c.as_ptr(),
                    dir.fd.as_raw_fd(),
                    name_c.as_ptr(),
                )
            };
            if renamed != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })();
        if let Err(source) = written {
            // SAFETY: unlinkat of a name relative to the open folder.
            unsafe { libc::unlinkat(dir.fd.as_raw_fd(), temporary_c.as_ptr(), 0) };
            return Err(Error::Io { path, source });
        }
        Ok(Self {
            dir,
            name: name.to_string(),
            token,
        })
    }

    /// The token written.
    pub(crate) fn token(&self) -> &str {
        &self.token
    }

    /// Where the file is.
    #[cfg(test)]
    pub(crate) fn path(&self) -> PathBuf {
        self.dir.path.join(&self.name)
    }

    /// The token in `name` in `dir`, after checking that the file is a regular file of this
    /// user's that no one else may read.
    pub(crate) fn read(dir: &PrivateDir, name: &str) -> Result<String> {
        let path = dir.path.join(name);
        let name_c = c_name(name, &path)?;
        // SAFETY: a NUL-terminated name relative to an open folder; O_NOFOLLOW refuses a link.
        let fd = unsafe {
            libc::openat(
                dir.fd.as_raw_fd(),
                name_c.as_ptr(),
                libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(last_os_error(&path));
        }
        // SAFETY: a descriptor we just opened and own.
        let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let stat = fstat(file.as_raw_fd(), &path)?;
        if stat.st_mode & libc::S_IFMT != libc::S_IFREG
            || stat.st_uid != uid()
            || stat.st_mode & 0o077 != 0
        {
            return Err(Error::Config(format!(
                "{} is not a job token file of this user's that only this user may read \
                 (owner {}, mode {:o}); remove it",
                path.display(),
                stat.st_uid,
                stat.st_mode & 0o7777
            )));
        }
        use std::io::Read;
        let mut token = String::new();
        file.take(MAX_TOKEN_BYTES as u64)
            .read_to_string(&mut token)
            .map_err(|source| Error::Io {
                path: path.clone(),
                source,
            })?;
        let token = token.trim();
        if token.is_empty() {
            return Err(io_error(&path, "the job token file is empty"));
        }
        Ok(token.to_string())
    }
}

impl Drop for TokenFile {
    fn drop(&mut self) {
        // A later job on the same port may have replaced the file; leave its token alone.
        if Self::read(&self.dir, &self.name).is_ok_and(|t| t == self.token) {
            if let Ok(name) = CString::new(self.name.as_str()) {
                // SAFETY: unlinkat of a name relative to the open folder.
                unsafe { libc::unlinkat(self.dir.fd.as_raw_fd(), name.as_ptr(), 0) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn mode(path: &Path) -> u32 {
        std::fs::symlink_metadata(path).unwrap().mode() & 0o7777
    }

    #[test]
    fn the_token_file_is_0600_in_a_0700_folder_and_every_rank_reads_the_same_token() {
        let base = tempfile::tempdir().unwrap();
        let name = file_name(29501, Some("run 7/a"));
        assert_eq!(name, "store-29501-run_7_a.token");
        let written =
            TokenFile::create(PrivateDir::open(base.path(), "tokens").unwrap(), &name).unwrap();
        let folder = base.path().join("tokens");
        assert_eq!(mode(&folder), 0o700);
        assert_eq!(mode(&written.path()), 0o600);
        assert_eq!(
            std::fs::symlink_metadata(written.path()).unwrap().uid(),
            uid()
        );
        // No temporary file is left beside it.
        let entries: Vec<_> = std::fs::read_dir(&folder).unwrap().collect();
        assert_eq!(entries.len(), 1);
        // Another rank opens the folder on its own and reads the same token.
        let other = PrivateDir::open(base.path(), "tokens").unwrap();
        assert_eq!(TokenFile::read(&other, &name).unwrap(), written.token());
        assert_eq!(written.token().len(), 64);
        // The file goes with rank 0's store.
        let path = written.path();
        drop(written);
        assert!(!path.exists());
    }

    #[test]
    fn a_folder_of_ours_with_a_loose_mode_is_set_back_to_0700() {
        let base = tempfile::tempdir().unwrap();
        let folder = base.path().join("tokens");
        std::fs::create_dir(&folder).unwrap();
        std::fs::set_permissions(&folder, std::fs::Permissions::from_mode(0o777)).unwrap();
        PrivateDir::open(base.path(), "tokens").unwrap();
        assert_eq!(mode(&folder), 0o700);
    }

    #[test]
    fn a_symbolic_link_in_place_of_the_folder_is_refused() {
        let base = tempfile::tempdir().unwrap();
        let elsewhere = base.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, base.path().join("tokens")).unwrap();
        let e = PrivateDir::open(base.path(), "tokens")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("symbolic link") && e.contains("ACCELERATE_JOB_TOKEN"),
            "{e}"
        );
    }

    #[test]
    fn a_token_file_that_others_may_read_or_that_is_a_link_is_refused() {
        let base = tempfile::tempdir().unwrap();
        let dir = PrivateDir::open(base.path(), "tokens").unwrap();
        let loose = dir.path().join("store-1.token");
        std::fs::write(&loose, "t").unwrap();
        std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = TokenFile::read(&dir, "store-1.token")
            .unwrap_err()
            .to_string();
        assert!(e.contains("only this user may read"), "{e}");
        let target = base.path().join("planted");
        std::fs::write(&target, "planted-token").unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join("store-2.token")).unwrap();
        assert!(TokenFile::read(&dir, "store-2.token").is_err());
    }

    #[test]
    fn a_later_token_replaces_an_earlier_one_whole() {
        let base = tempfile::tempdir().unwrap();
        let first =
            TokenFile::create(PrivateDir::open(base.path(), "t").unwrap(), "s.token").unwrap();
        let second =
            TokenFile::create(PrivateDir::open(base.path(), "t").unwrap(), "s.token").unwrap();
        assert_ne!(first.token(), second.token());
        let dir = PrivateDir::open(base.path(), "t").unwrap();
        assert_eq!(TokenFile::read(&dir, "s.token").unwrap(), second.token());
        // The earlier job's end leaves the later job's token in place.
        drop(first);
        assert_eq!(TokenFile::read(&dir, "s.token").unwrap(), second.token());
    }

    #[test]
    fn the_run_id_comes_from_the_launcher_that_started_the_job() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let all = vars(&[
            ("TORCHELASTIC_RUN_ID", "abc"),
            ("SLURM_JOB_ID", "77"),
            ("SLURM_STEP_ID", "0"),
            ("PMIX_NAMESPACE", "prterun-node1-123@1"),
        ]);
        assert_eq!(run_id(Launcher::Torchrun, all).as_deref(), Some("abc"));
        assert_eq!(run_id(Launcher::Slurm, all).as_deref(), Some("77.0"));
        assert_eq!(
            run_id(Launcher::Mpi, all).as_deref(),
            Some("prterun-node1-123@1")
        );
        assert_eq!(run_id(Launcher::Torchrun, vars(&[])), None);
    }
}
