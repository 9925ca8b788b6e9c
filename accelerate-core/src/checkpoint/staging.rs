//! A directory written in full before it appears: files go into a hidden sibling
//! (`.<name>.staging`), are fsynced, and the sibling is renamed onto the target. An existing target
//! is first renamed away (`.<name>.replaced`) and deleted only once the new one is in place, so at
//! every moment either the old or the new complete directory exists.

use std::io::Write;
use std::path::{Path, PathBuf};

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

    /// The directory it becomes.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Creates an empty staging directory, removing what an interrupted save left there.
    pub fn create(&self) -> Result<()> {
        let parent = parent_of(&self.target);
        std::fs::create_dir_all(&parent).map_err(|e| Error::io(&parent, e))?;
        if self.dir.exists() {
            std::fs::remove_dir_all(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        }
        std::fs::create_dir(&self.dir).map_err(|e| Error::io(&self.dir, e))
    }

    /// Writes `bytes` as `name` in the staging directory and fsyncs it.
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<()> {
        write_synced(&self.dir.join(name), bytes)
    }

    /// Moves the staging directory onto the target: fsyncs the directory, renames an existing
    /// target away, renames the staging directory into place, fsyncs the parent, then deletes the
    /// old one.
    pub fn commit(&self) -> Result<()> {
        sync_dir(&self.dir)?;
        let replaced = Self::replaced_path(&self.target)?;
        let had_old = self.target.exists();
        if had_old {
            if replaced.exists() {
                std::fs::remove_dir_all(&replaced).map_err(|e| Error::io(&replaced, e))?;
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
        sync_dir(&parent_of(&self.target))?;
        if had_old {
            std::fs::remove_dir_all(&replaced).map_err(|e| Error::io(&replaced, e))?;
        }
        Ok(())
    }

    /// Deletes the staging directory (after a failed save); the target is untouched.
    pub fn abort(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
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
