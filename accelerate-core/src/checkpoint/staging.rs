//! A directory written in full before it appears: files go into a hidden sibling
//! (`.<name>.staging`), are fsynced, and the sibling is renamed onto the target. An existing target
//! is first renamed away (`.<name>.replaced`) and deleted only once the new one is in place, so at
//! every moment either the old or the new complete directory exists.
//!
//! A crash between those renames leaves the target missing and its previous copy at
//! `.<name>.replaced`; a crash after them leaves that copy beside the new target.
//! [`recover_interrupted_replace`] finishes such a replace (the staged directory is complete) or
//! rolls it back (it is not), so nobody has to rename anything by hand.
//!
//! Once the new directory is in place, deleting the old one can only warn: the save is complete
//! (see `removal`). A leftover that still cannot be deleted when the next save needs its name is
//! moved aside (`.<name>.replaced.stale-<pid>-<n>`, named in a warning) so that save goes on.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::removal;
use crate::error::{Error, Result};

/// A staging directory for `target`.
#[derive(Debug, Clone)]
pub struct Staging {
    target: PathBuf,
    dir: PathBuf,
}

fn sibling(target: &Path, suffix: &str) -> Result<PathBuf> {
    let name = target.file_name().ok_or_else(|| {
        Error::Config(format!(
            "{} cannot be a checkpoint directory (it has no final component); pass a directory \
             path such as checkpoints/checkpoint_10",
            target.display()
        ))
    })?;
    Ok(target.with_file_name(format!(".{}.{suffix}", name.to_string_lossy())))
}

fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Clears the way for a sibling at `path` (a leftover `.replaced` or `.staging` directory),
/// before anything of the new save is committed: deletes it, or if that fails moves it aside to
/// a name nothing reads, with a warning naming it. An error if neither works, or if `path` is not
/// a directory (not something a save left: it is not ours to move).
fn clear_leftover(path: &Path) -> Result<()> {
    let Err(e) = removal::remove_dir_all(path) else {
        return Ok(());
    };
    if !std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()) {
        return Err(Error::io(path, e));
    }
    static ASIDE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let aside = path.with_file_name(format!(
        "{}.stale-{}-{}",
        path.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id(),
        ASIDE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::rename(path, &aside).map_err(|_| Error::io(path, e))?;
    removal::warn(&format!(
        "could not delete {}, left by an earlier save, so it was moved to {}; delete that by \
         hand once nothing holds its files open",
        path.display(),
        aside.display()
    ));
    Ok(())
}

fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}

impl Staging {
    /// The staging directory of `target` (nothing is created).
    pub fn for_target(target: impl AsRef<Path>) -> Result<Self> {
        let target = target.as_ref().to_path_buf();
        let dir = sibling(&target, "staging")?;
        Ok(Self { target, dir })
    }

    /// Where the previous directory waits while it is being replaced.
    pub fn replaced_path(target: &Path) -> Result<PathBuf> {
        sibling(target, "replaced")
    }

    /// The staging directory (files are written here).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Creates an empty staging directory, removing what an interrupted save left there.
    pub fn create(&self) -> Result<()> {
        let parent = parent_of(&self.target);
        std::fs::create_dir_all(&parent).map_err(|e| Error::io(&parent, e))?;
        if self.dir.exists() {
            clear_leftover(&self.dir)?;
        }
        std::fs::create_dir(&self.dir).map_err(|e| Error::io(&self.dir, e))
    }

    /// Writes `bytes` as `name` in the staging directory and fsyncs it.
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<()> {
        write_synced(&self.dir.join(name), bytes)
    }

    /// Moves the staging directory onto the target: fsyncs the directory, renames an existing
    /// target away, renames the staging directory into place, fsyncs the parent, then deletes the
    /// old one (a failure to delete it is a warning: the new directory is in place).
    pub fn commit(&self) -> Result<()> {
        sync_dir(&self.dir)?;
        let replaced = Self::replaced_path(&self.target)?;
        let had_old = self.target.exists();
        if had_old {
            if replaced.exists() {
                clear_leftover(&replaced)?;
            }
            std::fs::rename(&self.target, &replaced).map_err(|e| Error::io(&self.target, e))?;
        }
        if let Err(e) = std::fs::rename(&self.dir, &self.target) {
            if had_old {
                // Put the previous checkpoint back where it was.
                let _ = std::fs::rename(&replaced, &self.target);
            }
            return Err(Error::io(&self.target, e));
        }
        // Committed: from here on nothing fails the save.
        if let Err(e) = sync_dir(&parent_of(&self.target)) {
            removal::warn(&format!(
                "{} is in place, but its directory could not be synced ({e}); a power loss now \
                 could undo the rename",
                self.target.display()
            ));
        }
        if had_old {
            removal::remove_or_warn(
                &replaced,
                &format!(
                    "the previous copy of {}, replaced by the new one",
                    self.target.display()
                ),
            );
        }
        Ok(())
    }

    /// Deletes the staging directory (after a failed save); the target is untouched.
    pub fn abort(&self) {
        let _ = removal::remove_dir_all(&self.dir);
    }
}

/// Finishes or rolls back a replace of `target` that a crash interrupted (see the module
/// documentation); `is_complete` says whether a directory holds a whole save (for a checkpoint: a
/// manifest, which is written last). Returns what it did, to be logged, or `None` when there was
/// nothing to recover.
pub fn recover_interrupted_replace(
    target: &Path,
    is_complete: impl Fn(&Path) -> bool,
) -> Result<Option<String>> {
    let replaced = Staging::replaced_path(target)?;
    if !replaced.exists() {
        return Ok(None);
    }
    let staged = Staging::for_target(target)?.dir;
    let parent = parent_of(target);
    let done = if target.exists() {
        // The new directory was in place; only deleting the previous one was left, which can
        // only warn (the target is whole either way).
        let what = format!(
            "the previous copy left by a replace of {} that was interrupted after the new one \
             was in place",
            target.display()
        );
        if !removal::remove_or_warn(&replaced, &what) {
            return Ok(None);
        }
        return Ok(Some(format!("removed {}, {what}", replaced.display())));
    } else if staged.is_dir() && is_complete(&staged) {
        std::fs::rename(&staged, target).map_err(|e| Error::io(&staged, e))?;
        sync_dir(&parent)?;
        format!(
            "finished a replace of {} interrupted between its renames: the new, complete \
             directory was moved into place from {}",
            target.display(),
            staged.display()
        )
    } else {
        std::fs::rename(&replaced, target).map_err(|e| Error::io(&replaced, e))?;
        sync_dir(&parent)?;
        if staged.exists() {
            removal::remove_or_warn(&staged, "the incomplete new copy of a rolled-back replace");
        }
        return Ok(Some(format!(
            "rolled back a replace of {} interrupted between its renames: the new directory was \
             incomplete, so the previous one was moved back into place from {}",
            target.display(),
            replaced.display()
        )));
    };
    if replaced.exists() {
        removal::remove_or_warn(&replaced, "the previous copy of a finished replace");
    }
    Ok(Some(done))
}

/// [`recover_interrupted_replace`] for `dir` itself and for every directory under `dir` whose
/// replace was interrupted (a `.<name>.replaced` entry). A missing `dir` has nothing to recover.
pub fn recover_interrupted_replaces(
    dir: &Path,
    is_complete: impl Fn(&Path) -> bool,
) -> Result<Vec<String>> {
    let mut done: Vec<String> = recover_interrupted_replace(dir, &is_complete)?
        .into_iter()
        .collect();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
            ) =>
        {
            return Ok(done)
        }
        Err(e) => return Err(Error::io(dir, e)),
    };
    let mut targets = Vec::new();
    for entry in entries {
        let name = entry.map_err(|e| Error::io(dir, e))?.file_name();
        if let Some(target) = name
            .to_str()
            .and_then(|n| n.strip_prefix('.'))
            .and_then(|n| n.strip_suffix(".replaced"))
            .filter(|n| !n.is_empty())
        {
            targets.push(dir.join(target));
        }
    }
    targets.sort();
    for target in targets {
        done.extend(recover_interrupted_replace(&target, &is_complete)?);
    }
    Ok(done)
}

/// Creates `path` with `bytes` and fsyncs it.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(path)?;
        f.write_all(bytes)?;
        f.sync_all()
    })()
    .map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(dir: &Path) -> Vec<(String, Vec<u8>)> {
        let mut v: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_save_that_fails_midway_leaves_the_previous_directory_intact() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("ckpt");
        let first = Staging::for_target(&target).unwrap();
        first.create().unwrap();
        first.write("a", b"old a").unwrap();
        first.write("b", b"old b").unwrap();
        first.commit().unwrap();
        let before = read_all(&target);

        // The second save writes one file, then fails (a full disk, a crash): the target is the
        // first save's, whether the staging directory is cleaned up or left behind.
        let second = Staging::for_target(&target).unwrap();
        second.create().unwrap();
        second.write("a", b"new a").unwrap();
        assert_eq!(read_all(&target), before, "left behind");
        second.abort();
        assert_eq!(read_all(&target), before, "aborted");
        let names: Vec<_> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["ckpt"], "no staging directory remains");

        // A complete third save replaces it whole: no file of the first survives.
        let third = Staging::for_target(&target).unwrap();
        third.create().unwrap();
        third.write("c", b"new c").unwrap();
        third.commit().unwrap();
        assert_eq!(read_all(&target), [("c".to_string(), b"new c".to_vec())]);
        assert!(!Staging::replaced_path(&target).unwrap().exists());
    }

    /// `<root>/ckpt` replaced by a save that stopped between its renames: the previous copy at
    /// `.ckpt.replaced`, the new one at `.ckpt.staging` (complete or not), no `ckpt`.
    fn crashed_between_renames(root: &Path, new_complete: bool) -> PathBuf {
        let target = root.join("ckpt");
        let old = Staging::for_target(&target).unwrap();
        old.create().unwrap();
        old.write("a", b"old").unwrap();
        old.write("done", b"").unwrap();
        old.commit().unwrap();
        let new = Staging::for_target(&target).unwrap();
        new.create().unwrap();
        new.write("a", b"new").unwrap();
        if new_complete {
            new.write("done", b"").unwrap();
        }
        std::fs::rename(&target, Staging::replaced_path(&target).unwrap()).unwrap();
        target
    }

    fn is_done(dir: &Path) -> bool {
        dir.join("done").exists()
    }

    #[test]
    fn an_interrupted_replace_is_finished_or_rolled_back() {
        for (complete, want) in [(true, "new"), (false, "old")] {
            let root = tempfile::tempdir().unwrap();
            let target = crashed_between_renames(root.path(), complete);
            let done = recover_interrupted_replaces(root.path(), is_done).unwrap();
            assert_eq!(done.len(), 1, "{done:?}");
            let word = if complete { "finished" } else { "rolled back" };
            assert!(done[0].contains(word), "{done:?}");
            assert_eq!(std::fs::read(target.join("a")).unwrap(), want.as_bytes());
            let names: Vec<_> = std::fs::read_dir(root.path())
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert_eq!(names, ["ckpt"], "nothing else is left");
            assert!(recover_interrupted_replace(&target, is_done)
                .unwrap()
                .is_none());
        }
        // A crash after the second rename: only the previous copy is left to delete.
        let root = tempfile::tempdir().unwrap();
        let target = crashed_between_renames(root.path(), true);
        let staged = Staging::for_target(&target).unwrap();
        std::fs::rename(staged.dir(), &target).unwrap();
        let done = recover_interrupted_replace(&target, is_done)
            .unwrap()
            .unwrap();
        assert!(done.contains("removed"), "{done}");
        assert_eq!(std::fs::read(target.join("a")).unwrap(), b"new");
        assert!(!Staging::replaced_path(&target).unwrap().exists());
    }

    #[test]
    fn a_failed_commit_keeps_the_previous_directory() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("ckpt");
        let s = Staging::for_target(&target).unwrap();
        s.create().unwrap();
        s.write("a", b"old").unwrap();
        s.commit().unwrap();
        // A staging directory that vanished before the commit (deleted by another process)
        // makes the commit fail; the previous directory stays where it is.
        let t = Staging::for_target(&target).unwrap();
        t.create().unwrap();
        std::fs::remove_dir(t.dir()).unwrap();
        assert!(t.commit().is_err());
        assert_eq!(std::fs::read(target.join("a")).unwrap(), b"old");
    }
}
