//! `--resume`: continuing from the latest checkpoint in --checkpoint-dir.

use accelerate_core::data::{DataLoader, Dataset};
use accelerate_core::Accelerator;
use anyhow::{Context, Result};

use super::RunArgs;

impl RunArgs {
    /// With --resume, loads the latest checkpoint in --checkpoint-dir into everything `acc` has
    /// prepared, or says there is none yet and leaves the run at its start. Call it after the
    /// optimizer, scheduler and `loader` are prepared; `loader` only names the epoch resumed at.
    pub fn resume_if_asked<D: Dataset>(
        &self,
        acc: &Accelerator,
        loader: &DataLoader<D>,
    ) -> Result<()> {
        if !self.resume {
            return Ok(());
        }
        let root = &self.checkpoint_dir;
        let latest = accelerate_core::checkpoint::latest_checkpoint(root)
            .with_context(|| format!("--resume: --checkpoint-dir {}", root.display()))?;
        let Some(latest) = latest else {
            acc.print(format!(
                "--resume: no checkpoint in {} yet; starting from the beginning",
                root.display()
            ));
            return Ok(());
        };
        // The cause names the file and the problem; the way out depends on what the user wants,
        // so both are offered.
        let dir = acc.load_state(root).map_err(|e| {
            anyhow::anyhow!(
                "--resume from {}: {e}; nothing was loaded or changed. If the checkpoint is \
                 damaged, delete {} to resume from the one before it, or run without --resume \
                 to start over",
                root.display(),
                latest.display()
            )
        })?;
        acc.print(format!(
            "resumed from {} at optimizer step {} (epoch {})",
            dir.display(),
            acc.optimizer_steps(),
            loader.next_epoch()
        ));
        Ok(())
    }
}
