//! The Trainer's checkpoints in `output_dir`: Hugging Face's `checkpoint-<step>` names, the
//! newest, rotation under `save_total_limit` that keeps the best, and the refusal to save next to
//! newer checkpoints (whose rotation would delete the past and keep an abandoned future).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::state::TRAINER_STATE_NAME;

/// Prefix of a checkpoint directory, as Hugging Face's `PREFIX_CHECKPOINT_DIR`.
pub const CHECKPOINT_PREFIX: &str = "checkpoint-";

/// `<output_dir>/checkpoint-<step>`.
pub fn checkpoint_path(output_dir: &Path, step: u64) -> PathBuf {
    output_dir.join(format!("{CHECKPOINT_PREFIX}{step}"))
}

/// The `checkpoint-<step>` directories in `output_dir`, oldest (smallest step) first; none when
/// it does not exist.
pub fn list(output_dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let entries = match std::fs::read_dir(output_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(output_dir, e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| io(output_dir, e))?;
        let step = entry
            .file_name()
            .to_str()
            .and_then(|n| n.strip_prefix(CHECKPOINT_PREFIX))
            .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|d| d.parse::<u64>().ok());
        if let (Some(step), true) = (step, entry.path().is_dir()) {
            found.push((step, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// The newest complete checkpoint in `output_dir`, if any, and the newer incomplete ones passed
/// over (newest first). Complete means with its `trainer_state.json`, which is written after the
/// accelerator's state, so a run stopped between the two resumes from the checkpoint before (the
/// incomplete one is replaced when that step is saved again).
pub fn latest(output_dir: &Path) -> Result<(Option<PathBuf>, Vec<PathBuf>)> {
    let mut incomplete = Vec::new();
    for (_, path) in list(output_dir)?.into_iter().rev() {
        if path.join(TRAINER_STATE_NAME).is_file() {
            return Ok((Some(path), incomplete));
        }
        incomplete.push(path);
    }
    Ok((None, incomplete))
}

/// Refuses a run at `step` that would save into `output_dir` next to complete checkpoints with a
/// larger step (`what` says what the run does at `step`: "resumes from", "is saving"): they are
/// the future of a run that went on from an older checkpoint, and rotation, which deletes the
/// smallest steps, would delete this run's past and keep them, and `latest` would resume them.
/// (Incomplete ones, without their `trainer_state.json`, are passed over by `latest` and
/// replaced when their step is saved again.) The message names them and the ways out.
pub fn check_no_newer(output_dir: &Path, step: u64, what: &str) -> Result<()> {
    let newer: Vec<u64> = list(output_dir)?
        .into_iter()
        .filter(|(n, path)| *n > step && path.join(TRAINER_STATE_NAME).is_file())
        .map(|(n, _)| n)
        .collect();
    let Some(&newest) = newer.last() else {
        return Ok(());
    };
    Err(Error::Args(format!(
        "output_dir {} holds {} checkpoint(s) newer than the {CHECKPOINT_PREFIX}{step} this run \
         {what} (up to {CHECKPOINT_PREFIX}{newest}), saved by a run that went on from there; \
         saving next to them would let save_total_limit delete the older checkpoints and keep \
         those, and resume_from_checkpoint latest would continue them. Resume from the latest \
         (--resume-from-checkpoint latest), delete the newer checkpoints to go on from \
         {CHECKPOINT_PREFIX}{step}, or give another output_dir",
        output_dir.display(),
        newer.len()
    )))
}

/// Deletes the oldest checkpoints until at most `limit` remain, never `written` (the checkpoint
/// just saved; a newer one may be an incomplete leftover of a crashed run) and never `best`
/// (both then count as kept); returns what it deleted. It runs after a complete save, which it
/// must not fail: a checkpoint it cannot delete (on NFS a file still open elsewhere leaves a
/// `.nfsXXXX` file) is kept with a warning, and the others still go.
pub fn rotate(
    output_dir: &Path,
    limit: usize,
    written: &Path,
    best: Option<&Path>,
) -> Result<Vec<PathBuf>> {
    rotate_with(output_dir, limit, written, best, &|p| {
        std::fs::remove_dir_all(p)
    })
}

/// [`rotate`], deleting with `remove` (a test makes it fail).
fn rotate_with(
    output_dir: &Path,
    limit: usize,
    written: &Path,
    best: Option<&Path>,
    remove: &dyn Fn(&Path) -> std::io::Result<()>,
) -> Result<Vec<PathBuf>> {
    let all = list(output_dir)?;
    let protected = |p: &Path| Some(p) == best || p == written;
    let kept_apart = all.iter().filter(|(_, p)| protected(p)).count();
    let room = limit.saturating_sub(kept_apart);
    let others: Vec<PathBuf> = all
        .into_iter()
        .map(|(_, p)| p)
        .filter(|p| !protected(p))
        .collect();
    let excess = others.len().saturating_sub(room);
    let mut deleted = Vec::new();
    for path in others.into_iter().take(excess) {
        match remove(&path) {
            Ok(()) => deleted.push(path),
            Err(e) => eprintln!(
                "accelerate-trainer: warning: save_total_limit: could not delete {} ({e}); the \
                 new checkpoint is saved and training goes on. Delete it by hand once nothing \
                 holds its files open (on NFS, a file still open somewhere leaves a .nfsXXXX \
                 file until it is closed)",
                path.display()
            ),
        }
    }
    Ok(deleted)
}

fn io(path: &Path, e: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source: e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_that_cannot_be_deleted_is_kept_and_rotation_goes_on() {
        let out = tempfile::tempdir().unwrap();
        for step in [1, 2, 3, 4] {
            std::fs::create_dir(checkpoint_path(out.path(), step)).unwrap();
        }
        let stuck = checkpoint_path(out.path(), 1);
        // As on NFS, where a file still open leaves a .nfsXXXX file that stops the deletion.
        let remove = |p: &Path| {
            if p == stuck {
                Err(std::io::Error::other(
                    "Directory not empty (.nfs000000000001)",
                ))
            } else {
                std::fs::remove_dir_all(p)
            }
        };
        let written = checkpoint_path(out.path(), 4);
        let deleted = rotate_with(out.path(), 1, &written, None, &remove)
            .expect("rotation after a committed save failed on a checkpoint it could not delete");
        assert_eq!(
            deleted,
            [
                checkpoint_path(out.path(), 2),
                checkpoint_path(out.path(), 3)
            ]
        );
        let left: Vec<u64> = list(out.path()).unwrap().into_iter().map(|c| c.0).collect();
        assert_eq!(left, [1, 4], "the one it could not delete is kept");
    }
}
