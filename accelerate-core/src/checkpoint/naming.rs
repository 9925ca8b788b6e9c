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

/// The checkpoint with the largest N under `root`, if any.
pub fn latest_checkpoint(root: impl AsRef<Path>) -> Result<Option<PathBuf>> {
    Ok(list_checkpoints(root)?.pop().map(|(_, p)| p))
}

/// Deletes the oldest checkpoints under `root` until at most `keep` remain (`keep` 0 is refused: it
/// would delete the checkpoint just written). Returns the deleted directories.
pub fn prune_checkpoints(root: impl AsRef<Path>, keep: usize) -> Result<Vec<PathBuf>> {
    if keep == 0 {
        return Err(Error::Config(
            "checkpoints to keep is 0, which would delete every checkpoint including the newest; \
             keep at least 1 (or do not set a limit)"
                .into(),
        ));
    }
    let all = list_checkpoints(root)?;
    let excess = all.len().saturating_sub(keep);
    let mut deleted = Vec::new();
    for (_, path) in all.into_iter().take(excess) {
        std::fs::remove_dir_all(&path).map_err(|e| Error::io(&path, e))?;
        deleted.push(path);
    }
    Ok(deleted)
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
}
