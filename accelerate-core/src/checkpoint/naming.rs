//! Automatic checkpoint names: `<root>/checkpoint_<N>` where N is the optimizer step the state was
//! saved at, a limit on how many are kept, and "the latest".

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Prefix of automatically named checkpoint directories.
pub const CHECKPOINT_PREFIX: &str = "checkpoint_";

/// `<root>/checkpoint_<step>`.
pub fn checkpoint_dir(root: impl AsRef<Path>, step: u64) -> PathBuf {
    root.as_ref().join(format!("{CHECKPOINT_PREFIX}{step}"))
}

/// The checkpoints under `root`, oldest (smallest N) first. Only directories named exactly
/// `checkpoint_<N>` count: temporary directories of a save in progress are hidden (`.`-prefixed).
/// A missing `root` has none.
pub fn list_checkpoints(root: impl AsRef<Path>) -> Result<Vec<(u64, PathBuf)>> {
    let root = root.as_ref();
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(root, e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(root, e))?;
        let name = entry.file_name();
        let Some(n) = name
            .to_str()
            .and_then(|s| s.strip_prefix(CHECKPOINT_PREFIX))
            .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|d| d.parse::<u64>().ok())
        else {
            continue;
        };
        if entry.path().is_dir() {
            found.push((n, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// The checkpoint with the largest N under `root`, if any, as this process sees it. To resume on
/// several ranks, use `Accelerator::resume_latest` (or pass what this finds to
/// `Accelerator::resume_from` on every rank, `None` included): the ranks then agree on what they
/// found, instead of a rank that found none skipping the load the others wait in.
pub fn latest_checkpoint(root: impl AsRef<Path>) -> Result<Option<PathBuf>> {
    Ok(list_checkpoints(root)?.pop().map(|(_, p)| p))
}

/// Deletes the oldest checkpoints under `root` until at most `keep` remain (`keep` 0 is refused: it
/// would delete the checkpoint just written). Returns the deleted directories. One that cannot be
/// deleted (on NFS a file still open elsewhere leaves a `.nfsXXXX` file) is kept with a warning,
/// and the others still go: pruning follows a complete save, which it must not fail. After a
/// save, use [`prune_checkpoints_keeping`], which never deletes the checkpoint just written.
pub fn prune_checkpoints(root: impl AsRef<Path>, keep: usize) -> Result<Vec<PathBuf>> {
    prune(root.as_ref(), keep, None)
}

/// [`prune_checkpoints`] after writing `just_written`: it is never deleted, whatever its number,
/// and counts as one of the `keep`; the oldest of the others go.
pub fn prune_checkpoints_keeping(
    root: impl AsRef<Path>,
    keep: usize,
    just_written: &Path,
) -> Result<Vec<PathBuf>> {
    prune(root.as_ref(), keep, Some(just_written))
}

fn prune(root: &Path, keep: usize, just_written: Option<&Path>) -> Result<Vec<PathBuf>> {
    if keep == 0 {
        return Err(Error::Config(
            "checkpoints to keep is 0, which would delete every checkpoint including the newest; \
             keep at least 1 (or do not set a limit)"
                .into(),
        ));
    }
    let all = list_checkpoints(root)?;
    let kept_apart = just_written.is_some_and(|w| all.iter().any(|(_, p)| p == w));
    let others: Vec<PathBuf> = all
        .into_iter()
        .map(|(_, p)| p)
        .filter(|p| Some(p.as_path()) != just_written)
        .collect();
    let room = keep - usize::from(kept_apart);
    let excess = others.len().saturating_sub(room);
    let mut deleted = Vec::new();
    for path in others.into_iter().take(excess) {
        if super::removal::remove_or_warn(&path, "an old checkpoint beyond the keep limit") {
            deleted.push(path);
        }
    }
    Ok(deleted)
}

/// Refuses to save `checkpoint_<step>` under `root` when a checkpoint with a larger number is
/// there: it belongs to another run (or to this run's future, which a run cannot have), so the new
/// one would not be the latest: a keep limit would delete it, and resuming would continue the
/// other run. The message names the directory and the ways out.
pub fn check_no_newer_checkpoint(root: impl AsRef<Path>, step: u64) -> Result<()> {
    let root = root.as_ref();
    let newer: Vec<u64> = list_checkpoints(root)?
        .into_iter()
        .map(|(n, _)| n)
        .filter(|&n| n > step)
        .collect();
    let Some(&newest) = newer.last() else {
        return Ok(());
    };
    Err(Error::Checkpoint {
        path: root.to_path_buf(),
        problem: format!(
            "it already holds {} checkpoint(s) newer than the {CHECKPOINT_PREFIX}{step} this run \
             is saving (up to {CHECKPOINT_PREFIX}{newest}), left by another run; saving here \
             would mix the two runs (a keep limit would delete this run's checkpoint and a resume \
             would continue the other run). Resume that run (load_state, --resume), save into \
             another directory, or delete its checkpoints to start over",
            newer.len()
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_in_numeric_order_and_prunes_the_oldest() {
        let root = tempfile::tempdir().unwrap();
        for n in [2u64, 10, 9] {
            std::fs::create_dir(checkpoint_dir(root.path(), n)).unwrap();
        }
        // Not checkpoints: a staging directory, a file, a stray name.
        std::fs::create_dir(root.path().join(".checkpoint_11.staging")).unwrap();
        std::fs::write(root.path().join("checkpoint_12"), b"").unwrap();
        std::fs::create_dir(root.path().join("checkpoint_x")).unwrap();
        let ns: Vec<u64> = list_checkpoints(root.path())
            .unwrap()
            .into_iter()
            .map(|c| c.0)
            .collect();
        assert_eq!(ns, [2, 9, 10], "10 sorts after 9 (numbers, not strings)");
        assert_eq!(
            latest_checkpoint(root.path()).unwrap().unwrap(),
            root.path().join("checkpoint_10")
        );
        let gone = prune_checkpoints(root.path(), 2).unwrap();
        assert_eq!(gone, [root.path().join("checkpoint_2")]);
        assert!(prune_checkpoints(root.path(), 0).is_err());
        assert_eq!(list_checkpoints(root.path()).unwrap().len(), 2);
        assert!(latest_checkpoint(root.path().join("none"))
            .unwrap()
            .is_none());
    }

    #[test]
    fn the_checkpoint_just_written_survives_the_keep_limit_whatever_its_number() {
        // Another run left checkpoint_90 and checkpoint_100; this one just wrote checkpoint_10.
        let root = tempfile::tempdir().unwrap();
        for n in [90u64, 100, 10] {
            std::fs::create_dir(checkpoint_dir(root.path(), n)).unwrap();
        }
        let ours = checkpoint_dir(root.path(), 10);
        let gone = prune_checkpoints_keeping(root.path(), 2, &ours).unwrap();
        assert_eq!(gone, [checkpoint_dir(root.path(), 90)]);
        assert!(ours.is_dir(), "the checkpoint just written was deleted");
        let gone = prune_checkpoints_keeping(root.path(), 1, &ours).unwrap();
        assert_eq!(gone, [checkpoint_dir(root.path(), 100)]);
        assert_eq!(list_checkpoints(root.path()).unwrap(), [(10, ours.clone())]);
    }

    #[test]
    fn a_newer_checkpoint_of_another_run_is_refused_by_name() {
        let root = tempfile::tempdir().unwrap();
        for n in [90u64, 100] {
            std::fs::create_dir(checkpoint_dir(root.path(), n)).unwrap();
        }
        let e = check_no_newer_checkpoint(root.path(), 10)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&root.path().display().to_string())
                && e.contains("2 checkpoint(s) newer than the checkpoint_10")
                && e.contains("checkpoint_100")
                && e.contains("another directory"),
            "{e}"
        );
        assert!(check_no_newer_checkpoint(root.path(), 100).is_ok());
        assert!(check_no_newer_checkpoint(root.path().join("none"), 0).is_ok());
    }
}
