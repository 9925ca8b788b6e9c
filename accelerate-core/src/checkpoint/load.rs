//! `load_state`: find the checkpoint, read and verify every file it needs, and only then change
//! the training state; if applying still fails (an optimizer refuses its state), what was already
//! applied is rolled back, so nothing is ever half-loaded.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use rand_chacha::ChaCha8Rng;

use super::files::{
    self, AccumulationFile, LossScalerFile, OptimizerScalars, RankFile, SchedulerFile,
};
use super::manifest::{Manifest, MANIFEST_FILE};
use super::naming::latest_checkpoint;
use super::save::{is_complete, log_recovery};
use super::staging;
use super::TrainingView;
use crate::accumulate::AccumulationCounters;
use crate::error::{Error, Result};
use crate::mixed_precision::LossScalerState;
use crate::optim::{OptimizerState, SchedulerState};
use crate::training::TrainingSnapshot;

fn problem(path: &Path, problem: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// `dir` itself if it holds a manifest; otherwise the latest `checkpoint_<N>` under it.
pub(crate) fn resolve(dir: &Path) -> Result<PathBuf> {
    if dir.join(MANIFEST_FILE).exists() {
        return Ok(dir.to_path_buf());
    }
    if let Some(latest) = latest_checkpoint(dir)? {
        return Ok(latest);
    }
    if dir.is_dir() {
        Err(problem(
            dir,
            format!(
                "neither a checkpoint (no {MANIFEST_FILE}) nor a directory of checkpoints (no \
                 checkpoint_<N> inside); pass the directory save_state wrote"
            ),
        ))
    } else {
        Err(problem(
            dir,
            "no such directory; pass the directory save_state wrote",
        ))
    }
}

/// Everything read and verified, ready to apply.
struct Loaded {
    params: BTreeMap<String, Tensor>,
    optimizers: Vec<OptimizerState>,
    schedulers: Vec<SchedulerState>,
    counters: AccumulationCounters,
    rank: RankFile,
    gradients: Option<BTreeMap<String, Tensor>>,
    /// The fp16 loss scaler's state, when this run has a scaler and the checkpoint one.
    loss_scaler: Option<LossScalerState>,
    /// This rank's generator, unless the checkpoint predates saved generators.
    rng: Option<ChaCha8Rng>,
}

/// Loads the checkpoint at `dir` (or the latest under it); returns the directory loaded. First the
/// main process finishes or rolls back a save that a crash interrupted between its renames; every
/// rank then reads and verifies its files, and all agree before anything changes, so either every
/// rank loads or none does.
pub(crate) fn load_state(view: &TrainingView<'_>, dir: &Path) -> Result<PathBuf> {
    let recovered = if view.rank == 0 {
        staging::recover_interrupted_replaces(dir, is_complete).map(|done| log_recovery(&done))
    } else {
        Ok(())
    };
    view.agree(dir, "recovering an interrupted save", recovered)?;
    let read = resolve(dir).and_then(|resolved| Ok((read_all(view, &resolved)?, resolved)));
    let (loaded, dir) = view.agree(dir, "reading the checkpoint", read)?;
    apply(view, loaded, &dir)?;
    Ok(dir)
}

fn read_all(view: &TrainingView<'_>, dir: &Path) -> Result<Loaded> {
    let manifest = Manifest::read(dir)?;
    manifest.check_compatible(dir, view.world_size, view.params())?;
    let (n_opt, n_sched) = view.training.registered();
    if manifest.optimizers != n_opt || manifest.schedulers != n_sched {
        return Err(problem(
            &dir.join(MANIFEST_FILE),
            format!(
                "it holds {} optimizer(s) and {} scheduler(s), but this run prepared {n_opt} and \
                 {n_sched}; prepare the same objects before load_state",
                manifest.optimizers, manifest.schedulers
            ),
        ));
    }
    // Every listed file is checked, including other ranks' parts: a corrupt checkpoint is refused
    // by every rank alike.
    for name in manifest.files.keys() {
        manifest.read_verified(dir, name)?;
    }

    let path = dir.join(files::PARAMETERS_FILE);
    let params =
        files::parse_safetensors(&path, &manifest.read_verified(dir, files::PARAMETERS_FILE)?)?;
    for (name, var) in view.params() {
        match params.get(name) {
            Some(t) if t.dims() == var.dims() && t.dtype() == var.dtype() => {}
            Some(t) => {
                return Err(problem(
                    &path,
                    format!(
                        "tensor {name:?} is {:?} {:?} but the manifest and the model say {:?} {:?}",
                        t.dims(),
                        t.dtype(),
                        var.dims(),
                        var.dtype()
                    ),
                ))
            }
            None => return Err(problem(&path, format!("tensor {name:?} is missing"))),
        }
    }
    if params.len() != view.params().len() {
        return Err(problem(
            &path,
            format!(
                "holds {} tensors for {} parameters",
                params.len(),
                view.params().len()
            ),
        ));
    }

    let mut optimizers = Vec::with_capacity(n_opt);
    for i in 0..n_opt {
        let tpath = dir.join(files::optimizer_tensors_file(i));
        let tensors = files::parse_safetensors(
            &tpath,
            &manifest.read_verified(dir, &files::optimizer_tensors_file(i))?,
        )?;
        let jpath = dir.join(files::optimizer_json_file(i));
        let s: OptimizerScalars = files::parse_json(
            &jpath,
            &manifest.read_verified(dir, &files::optimizer_json_file(i))?,
        )?;
        let mut state = OptimizerState::new(s.kind);
        state.tensors = tensors;
        for (k, v) in s.scalars {
            let v = v
                .get()
                .map_err(|e| problem(&jpath, format!("scalar {k:?}: {e}")))?;
            state.scalars.insert(k, v);
        }
        optimizers.push(state);
    }

    let mut schedulers = Vec::with_capacity(n_sched);
    for i in 0..n_sched {
        let spath = dir.join(files::scheduler_file(i));
        let s: SchedulerFile = files::parse_json(
            &spath,
            &manifest.read_verified(dir, &files::scheduler_file(i))?,
        )?;
        let base_lr = s
            .base_lr
            .get()
            .map_err(|e| problem(&spath, format!("base_lr: {e}")))?;
        schedulers.push(SchedulerState {
            steps: s.steps,
            base_lr,
        });
    }

    let apath = dir.join(files::ACCUMULATION_FILE);
    let a: AccumulationFile = files::parse_json(
        &apath,
        &manifest.read_verified(dir, files::ACCUMULATION_FILE)?,
    )?;
    let item_scale = match a.item_scale {
        Some(v) => Some(
            v.get()
                .map_err(|e| problem(&apath, format!("item_scale: {e}")))?,
        ),
        None => None,
    };
    let counters = AccumulationCounters {
        steps: a.gradient_accumulation_steps,
        taken: a.micro_steps_taken_in_window,
        window_len: a.window_len,
        item_scale,
        optimizer_steps: a.optimizer_steps,
    };
    view.training
        .check_counters(&counters)
        .map_err(|e| problem(&apath, e))?;

    let loss_scaler = read_loss_scaler(view, &manifest, dir)?;

    let rpath = dir.join(files::rank_file(view.rank));
    let rank: RankFile = files::parse_json(
        &rpath,
        &manifest.read_verified(dir, &files::rank_file(view.rank))?,
    )?;
    let loaders = view.training.loader_batches_per_epoch();
    if rank.rank != view.rank || rank.loaders.len() != loaders.len() {
        return Err(problem(
            &rpath,
            format!(
                "holds rank {}'s {} loader position(s), but this is rank {} with {} prepared \
                 loader(s); prepare the same data loaders before load_state",
                rank.rank,
                rank.loaders.len(),
                view.rank,
                loaders.len()
            ),
        ));
    }
    for (i, (saved, now)) in rank.loaders.iter().zip(&loaders).enumerate() {
        // A stream's length is known only once read: its iteration checks the position instead.
        let Some(now) = *now else { continue };
        if saved.batches_per_epoch != now || saved.batches_consumed > now {
            return Err(problem(
                &rpath,
                format!(
                    "loader {i} had {} batches per epoch on this rank (position: epoch {}, batch \
                     {}), this run's has {now}; resume with the same dataset, batch size and \
                     number of processes",
                    saved.batches_per_epoch, saved.epoch, saved.batches_consumed
                ),
            ));
        }
    }
    let gradients = if counters.taken > 0 {
        if !rank.has_gradients {
            return Err(problem(
                &rpath,
                "saved inside an accumulation window but without that window's gradients",
            ));
        }
        let name = files::rank_gradients_file(view.rank);
        let gpath = dir.join(&name);
        let g = files::parse_safetensors(&gpath, &manifest.read_verified(dir, &name)?)?;
        for (name, t) in &g {
            match view.params().iter().find(|(n, _)| n == name) {
                Some((_, v)) if v.dims() == t.dims() => {}
                _ => {
                    return Err(problem(
                        &gpath,
                        format!(
                            "gradient {name:?} {:?} fits no parameter of the model",
                            t.dims()
                        ),
                    ))
                }
            }
        }
        Some(g)
    } else {
        None
    };
    let rng_name = files::rng_file(view.rank);
    let rng = if manifest.files.contains_key(&rng_name) {
        let path = dir.join(&rng_name);
        let state: crate::rng::RngState =
            files::parse_json(&path, &manifest.read_verified(dir, &rng_name)?)?;
        Some(
            view.rng
                .parse_state(&state)
                .map_err(|e| problem(&path, e))?,
        )
    } else {
        None
    };
    Ok(Loaded {
        params,
        optimizers,
        schedulers,
        counters,
        rank,
        gradients,
        loss_scaler,
        rng,
    })
}

/// The saved fp16 loss scaler state, checked against this run's scaler. A checkpoint saved without
/// fp16 has none (the scaler then starts afresh), and a run without fp16 ignores a saved one.
fn read_loss_scaler(
    view: &TrainingView<'_>,
    manifest: &Manifest,
    dir: &Path,
) -> Result<Option<LossScalerState>> {
    let Some(mut scaler) = view.training.loss_scaler() else {
        return Ok(None);
    };
    if !manifest.files.contains_key(files::LOSS_SCALER_FILE) {
        return Ok(None);
    }
    let path = dir.join(files::LOSS_SCALER_FILE);
    let f: LossScalerFile = files::parse_json(
        &path,
        &manifest.read_verified(dir, files::LOSS_SCALER_FILE)?,
    )?;
    let state = LossScalerState {
        scale: f
            .scale
            .get()
            .map_err(|e| problem(&path, format!("scale: {e}")))?,
        growth_tracker: f.growth_tracker,
    };
    // Checked on a copy: nothing changes before everything is verified.
    scaler
        .load_state(&state)
        .map_err(|e| problem(&path, e.to_string()))?;
    Ok(Some(state))
}

/// Applies a verified checkpoint (the training state puts back what it changed if a part still
/// refuses its value), then this rank's generator.
fn apply(view: &TrainingView<'_>, loaded: Loaded, dir: &Path) -> Result<()> {
    let snapshot = TrainingSnapshot {
        counters: loaded.counters,
        loaders: loaded.rank.loaders,
        window_gradients: loaded.gradients,
        optimizers: loaded.optimizers,
        schedulers: loaded.schedulers,
        loss_scaler: loaded.loss_scaler,
    };
    view.training.restore(&loaded.params, snapshot)?;
    match loaded.rng {
        Some(rng) => view.rng.restore(rng),
        None => {
            let line = format!(
                "{} holds no random generator state for rank {} (it was saved before \
                 generators were checkpointed); this rank's generator continues from where it is, \
                 so dropout masks and other draws from Accelerator::rng differ from the saved \
                 run's",
                dir.display(),
                view.rank
            );
            tracing::warn!("checkpoint: {line}");
            eprintln!("accelerate: warning: checkpoint: {line}");
        }
    }
    view.reseed_device()?;
    Ok(())
}
