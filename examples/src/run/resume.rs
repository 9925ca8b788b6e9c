//! `--resume`: continuing from the latest checkpoint in --checkpoint-dir; and a fresh run refusing
//! a --checkpoint-dir that holds another run's checkpoints (or deleting them with
//! --overwrite-checkpoints), as Accelerate refuses an existing `checkpoint_<i>`.

use std::path::Path;

use accelerate_core::data::{DataLoader, Dataset};
use accelerate_core::Accelerator;
use anyhow::{Context, Result};

use super::RunArgs;

impl RunArgs {
    /// With --resume, loads the latest checkpoint in --checkpoint-dir into everything `acc` has
    /// prepared, or says there is none yet and leaves the run at its start. Without it, a run that
    /// will write checkpoints (--checkpoint-every) into a --checkpoint-dir already holding some is
    /// refused, naming the ways out, or with --overwrite-checkpoints deletes them first. Call it on
    /// every rank after the optimizer, scheduler and `loader` are prepared; `loader` only names
    /// the epoch resumed at.
    pub fn resume_if_asked<D: Dataset>(
        &self,
        acc: &Accelerator,
        loader: &DataLoader<D>,
    ) -> Result<()> {
        let root = &self.checkpoint_dir;
        if !self.resume {
            return self.start_fresh(acc, root);
        }
        // One collective on every rank, whatever each finds: the ranks agree on the latest
        // checkpoint (or on none) before anything is loaded. The cause names the file and the
        // problem; the way out depends on what the user wants, so both are offered.
        let resumed = acc.resume_latest(root).map_err(|e| {
            let latest = accelerate_core::latest_checkpoint(root)
                .ok()
                .flatten()
                .map_or_else(|| root.display().to_string(), |p| p.display().to_string());
            anyhow::anyhow!(
                "--resume from {}: {e}; nothing was loaded or changed. If the checkpoint is \
                 damaged, delete {latest} to resume from the one before it, or run without \
                 --resume to start over",
                root.display(),
            )
        })?;
        let Some(dir) = resumed else {
            acc.print(format!(
                "--resume: no checkpoint in {} yet; starting from the beginning",
                root.display()
            ));
            return Ok(());
        };
        acc.print(format!(
            "resumed from {} at optimizer step {} (epoch {})",
            dir.display(),
            acc.optimizer_steps(),
            loader.next_epoch()
        ));
        Ok(())
    }

    /// A run from the start that will write checkpoints into `root`: refused if `root` holds
    /// checkpoints already (they are another run's: mixing them would let --checkpoints-keep
    /// delete this run's and --resume continue the other), unless --overwrite-checkpoints, which
    /// deletes them. The main process alone looks and decides, and every rank joins the
    /// agreement on its outcome: ranks need not share a filesystem, and a rank that listed the
    /// directory after the main process emptied it would otherwise skip the agreement's
    /// collective that the others run.
    fn start_fresh(&self, acc: &Accelerator, root: &Path) -> Result<()> {
        if self.checkpoint_every.is_none() {
            return Ok(());
        }
        let mut deleted = 0;
        let outcome = if acc.is_main_process() {
            self.clear_for_fresh_start(root).map(|n| deleted = n)
        } else {
            Ok(())
        };
        acc.agree_across_ranks(root, "starting a fresh run in --checkpoint-dir", outcome)
            .with_context(|| format!("--checkpoint-dir {}", root.display()))?;
        if deleted > 0 {
            acc.print(format!(
                "--overwrite-checkpoints: deleted {deleted} checkpoint(s) in {}; starting from \
                 the beginning",
                root.display()
            ));
        }
        Ok(())
    }

    /// The main process's part of [`start_fresh`](Self::start_fresh): the number of another
    /// run's checkpoints deleted (0 when `root` holds none), or the refusal.
    fn clear_for_fresh_start(&self, root: &Path) -> accelerate_core::Result<usize> {
        let existing = accelerate_core::list_checkpoints(root)?;
        let Some((newest, _)) = existing.last() else {
            return Ok(0);
        };
        if !self.overwrite_checkpoints {
            return Err(accelerate_core::Error::Config(format!(
                "--checkpoint-dir {} already holds {} checkpoint(s) of another run (up to \
                 checkpoint_{newest}); pass --resume to continue that run, choose another \
                 --checkpoint-dir, or pass --overwrite-checkpoints to delete them and start over",
                root.display(),
                existing.len()
            )));
        }
        for (_, dir) in &existing {
            std::fs::remove_dir_all(dir).map_err(|e| accelerate_core::Error::Io {
                path: dir.clone(),
                source: e,
            })?;
        }
        Ok(existing.len())
    }
}
