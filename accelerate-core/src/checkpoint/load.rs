//! `load_state`: find the checkpoint, read and verify every file it needs, and only then change
//! the training state; if applying still fails (an optimizer refuses its state), what was already
//! applied is rolled back, so nothing is ever half-loaded.

use std::any::Any;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use rand_chacha::ChaCha8Rng;

use super::files::{
    self, AccumulationFile, LoaderPosition, LossScalerFile, ModelFiles, OptimizerScalars, RankFile,
    SchedulerFile,
};
use super::layout::ModelLayout;
use super::manifest::{self, Manifest, MANIFEST_FILE};
use super::naming::latest_checkpoint;
use super::reshard::{self, Keys, SavedTensors};
use super::save::{is_complete, log_recovery};
use super::scalars;
use super::staging;
use super::{custom_file, TrainingView};
use crate::error::{Error, Result};
use crate::mixed_precision::LossScalerState;
use crate::optim::{OptimizerState, SchedulerState};
use crate::training::{TrainingSnapshot, TrainingState};
use crate::window::AccumulationCounters;

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

/// One model's part of a checkpoint, read and verified.
struct LoadedModel {
    /// The parameters as this run's model holds them: whole, or under ZeRO stage 3 this rank's
    /// pieces.
    params: BTreeMap<String, Tensor>,
    snapshot: TrainingSnapshot,
}

/// Everything read and verified, ready to apply.
struct Loaded {
    /// Each prepared model's part, in order of preparation.
    models: Vec<LoadedModel>,
    rank: RankFile,
    /// This rank's generator, unless the checkpoint predates saved generators.
    rng: Option<ChaCha8Rng>,
    /// Each registered object's saved value, parsed, in order of registration.
    custom: Vec<Box<dyn Any + Send>>,
    /// The number of processes that saved the checkpoint.
    saved_world: usize,
}

/// What [`load_state`] is asked to load on this rank.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Source<'a> {
    /// A checkpoint directory, or the latest `checkpoint_<N>` under it; an error if neither.
    Dir(&'a Path),
    /// The latest `checkpoint_<N>` under this root, or none if it holds none.
    Latest(&'a Path),
    /// What the caller found on this rank by its own rules: a checkpoint (as [`Source::Dir`]),
    /// or none.
    Found(Option<&'a Path>),
}

/// This rank's pick, as compared across ranks: the key that must be equal everywhere (the
/// checkpoint's step and manifest checksum, or none) and how the pick is shown in an error.
fn pick(found: Option<&(PathBuf, Manifest, u32)>) -> (String, String) {
    match found {
        None => ("none".into(), "none found".into()),
        Some((dir, manifest, crc)) => (
            format!("step {} manifest {crc:08x}", manifest.optimizer_steps),
            format!(
                "{} (step {}, manifest CRC-32 {crc:08x})",
                dir.display(),
                manifest.optimizer_steps
            ),
        ),
    }
}

/// Loads what `source` names on this rank; returns the directory loaded, or `None` when every
/// rank found none. The one path every load takes: first the main process finishes or rolls back
/// a save that a crash interrupted between its renames; every rank then resolves its checkpoint
/// and reads its manifest, and all agree that they picked the same one (its step and manifest
/// checksum), or that none found any, before anything else. A rank that found none still joins
/// every collective, so ranks that disagree all stop with an error naming each rank's pick,
/// instead of one waiting in a collective the other skipped. Every rank then reads and verifies
/// the files it needs, and all agree before anything changes, so either every rank loads or
/// none does.
pub(crate) fn load_state(view: &TrainingView<'_>, source: Source<'_>) -> Result<Option<PathBuf>> {
    let asked = match source {
        Source::Dir(dir) | Source::Latest(dir) | Source::Found(Some(dir)) => Some(dir),
        Source::Found(None) => None,
    };
    let named = asked.unwrap_or(Path::new("(none found on this rank)"));
    let recovered = match asked {
        Some(dir) if view.rank == 0 => {
            staging::recover_interrupted_replaces(dir, is_complete).map(|done| log_recovery(&done))
        }
        _ => Ok(()),
    };
    view.agree(named, "recovering an interrupted save", recovered)?;
    let resolved = match source {
        Source::Dir(dir) | Source::Found(Some(dir)) => resolve(dir).map(Some),
        Source::Latest(root) => latest_checkpoint(root),
        Source::Found(None) => Ok(None),
    };
    let found = resolved.and_then(|dir| {
        dir.map(|dir| {
            let (manifest, crc) = Manifest::read_with_checksum(&dir)?;
            Ok((dir, manifest, crc))
        })
        .transpose()
    });
    let found = view.agree(named, "finding the checkpoint", found)?;
    // Each rank resolves its checkpoint on its own file system, or is handed one its caller
    // resolved: where machines do not share it, they could load different steps and train apart
    // without a word.
    let (key, shown) = pick(found.as_ref());
    view.agree_on_choice(named, "checkpoints to load", &key, &shown)?;
    let Some((dir, manifest, _)) = found else {
        return Ok(None);
    };
    let read = read_all(view, &manifest, &dir);
    let loaded = view.agree(&dir, "reading the checkpoint", read)?;
    apply(view, loaded, &dir)?;
    Ok(Some(dir))
}

/// Reads and verifies what this rank needs of the checkpoint at `dir`, whose `manifest` was read
/// already: its own part, the shared files, and under ZeRO only the saved ranks' optimizer
/// shards its own pieces come from. Another rank's files are that rank's to verify (every rank
/// agrees on the outcome before anything changes).
fn read_all(view: &TrainingView<'_>, manifest: &Manifest, dir: &Path) -> Result<Loaded> {
    let layouts: Vec<ModelLayout> = view
        .models
        .iter()
        .map(|m| ModelLayout::of(m, view.world_size))
        .collect();
    manifest.check_compatible(dir, &layouts[0].entries())?;
    if manifest.models() != view.models.len() {
        return Err(problem(
            &dir.join(MANIFEST_FILE),
            format!(
                "it holds {} prepared model(s), but this run prepared {}; prepare the same \
                 models before load_state",
                manifest.models(),
                view.models.len()
            ),
        ));
    }

    let rank = if manifest.world_size == view.world_size {
        read_rank_file(view, manifest, dir)?
    } else {
        rank_file_for_another_world(view, manifest, dir)?
    };

    let models = layouts
        .iter()
        .enumerate()
        .map(|(m, layout)| read_model(view, manifest, dir, (m, layout), &rank))
        .collect::<Result<Vec<_>>>()?;

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
    let custom = read_custom(view, manifest, dir)?;
    Ok(Loaded {
        models,
        rank,
        rng,
        custom,
        saved_world: manifest.world_size,
    })
}

/// This rank's own part, saved by the same rank of a run of as many processes.
fn read_rank_file(view: &TrainingView<'_>, manifest: &Manifest, dir: &Path) -> Result<RankFile> {
    let rpath = dir.join(files::rank_file(view.rank));
    let rank: RankFile = files::parse_json(
        &rpath,
        &manifest.read_verified(dir, &files::rank_file(view.rank))?,
    )?;
    let loaders = view.loaders.batches_per_epoch();
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

    Ok(rank)
}

/// This rank's part when the checkpoint was saved by another number of processes: allowed only
/// between accumulation windows (a window's partial gradients are per rank), with every loader's
/// position remapped by global batches (see [`LoaderPosition::for_world`]). A refusal names the
/// manifest, both numbers of processes and why.
fn rank_file_for_another_world(
    view: &TrainingView<'_>,
    manifest: &Manifest,
    dir: &Path,
) -> Result<RankFile> {
    let (old, new) = (manifest.world_size, view.world_size);
    let positions = remapped_positions(view, manifest, dir)?.map_err(|why| {
        problem(
            &dir.join(MANIFEST_FILE),
            format!(
                "saved by {old} processes but this run has {new}, which is possible only between \
                 accumulation windows and where the new processes can share the batches \
                 consumed: {why}; resume at an epoch boundary or with --num-processes {old}"
            ),
        )
    })?;
    if view.rank == 0 {
        let line = format!(
            "{} was saved by {old} processes and this run has {new}: the optimizer state is \
             re-cut and the loaders continue after the same global batches, but the sums of \
             another number of ranks round differently from the saved run's",
            dir.display()
        );
        tracing::warn!("checkpoint: {line}");
        eprintln!("accelerate: warning: checkpoint: {line}");
    }
    Ok(RankFile {
        rank: view.rank,
        loaders: positions,
        has_gradients: false,
        further_models_have_gradients: vec![false; view.models.len().saturating_sub(1)],
    })
}

/// Every loader's position for this run's world, or why there is none (the outer error is a file
/// that cannot be read).
fn remapped_positions(
    view: &TrainingView<'_>,
    manifest: &Manifest,
    dir: &Path,
) -> Result<std::result::Result<Vec<LoaderPosition>, String>> {
    let (old, new) = (manifest.world_size, view.world_size);
    for m in 0..view.models.len() {
        let name = ModelFiles(m).accumulation();
        let path = dir.join(&name);
        let a: AccumulationFile = files::parse_json(&path, &manifest.read_verified(dir, &name)?)?;
        if a.micro_steps_taken_in_window > 0 {
            return Ok(Err(format!(
                "{name} says it was saved inside an accumulation window, whose partial \
                 gradients are per rank"
            )));
        }
    }
    let mut saved: Option<Vec<LoaderPosition>> = None;
    for r in 0..old {
        let name = files::rank_file(r);
        if !manifest.files.contains_key(&name) {
            return Ok(Err(format!("it lists no {name}, rank {r}'s part")));
        }
        let path = dir.join(&name);
        let part: RankFile = files::parse_json(&path, &manifest.read_verified(dir, &name)?)?;
        if part.has_gradients || part.further_models_have_gradients.contains(&true) {
            return Ok(Err(format!(
                "rank {r} saved gradients a no_sync guard left unsynced, which are per rank"
            )));
        }
        match &saved {
            None => saved = Some(part.loaders),
            Some(first) if *first != part.loaders => {
                return Ok(Err(format!(
                    "rank {r}'s loader positions differ from rank 0's"
                )))
            }
            Some(_) => {}
        }
    }
    let saved = saved.unwrap_or_default();
    let loaders = view.loaders.batches_per_epoch();
    if saved.len() != loaders.len() {
        return Ok(Err(format!(
            "it holds {} loader position(s) but this run prepared {} loader(s) (prepare the same \
             data loaders before load_state)",
            saved.len(),
            loaders.len()
        )));
    }
    Ok(saved
        .iter()
        .zip(&loaders)
        .enumerate()
        .map(|(i, (position, &now))| {
            position
                .for_world(old, new, now)
                .map_err(|e| format!("loader {i}: {e}"))
        })
        .collect())
}

/// Reads and parses every registered object's saved value; refuses a checkpoint that holds
/// another number of them than this run registered.
fn read_custom(
    view: &TrainingView<'_>,
    manifest: &Manifest,
    dir: &Path,
) -> Result<Vec<Box<dyn Any + Send>>> {
    if manifest.custom_objects != view.custom.len() {
        return Err(problem(
            &dir.join(MANIFEST_FILE),
            format!(
                "it holds {} object(s) registered for checkpointing, but this run registered {} \
                 with register_for_checkpointing; register the same objects, in the same order, \
                 before load_state",
                manifest.custom_objects,
                view.custom.len()
            ),
        ));
    }
    view.custom
        .iter()
        .enumerate()
        .map(|(i, object)| {
            let name = custom_file(i);
            object.check_unlocked().map_err(|e| {
                problem(
                    &dir.join(&name),
                    format!(
                        "registered object {i} ({}) cannot be loaded: {e}",
                        object.type_name()
                    ),
                )
            })?;
            let bytes = manifest.read_verified(dir, &name)?;
            object.parse(&bytes).map_err(|e| {
                problem(
                    &dir.join(&name),
                    format!(
                        "does not hold a {} ({e}), which this run registered as object {i}; \
                         register the same objects, in the same order, as the run that saved it",
                        object.type_name()
                    ),
                )
            })
        })
        .collect()
}

/// Reads and verifies model `m`'s files against this run's model `m`, whose parameters are laid
/// out as `layout` says.
fn read_model(
    view: &TrainingView<'_>,
    manifest: &Manifest,
    dir: &Path,
    (m, layout): (usize, &ModelLayout),
    rank: &RankFile,
) -> Result<LoadedModel> {
    let training = &view.models[m];
    let names = ModelFiles(m);
    let which = if m == 0 {
        String::new()
    } else {
        format!("model {m}: ")
    };
    let saved = manifest.model_parameters(m).unwrap_or_default();
    if m > 0 {
        manifest::check_parameters(
            &dir.join(MANIFEST_FILE),
            &format!("model {m} of the "),
            saved,
            &layout.entries(),
        )?;
    }
    let (n_opt, n_sched) = training.registered();
    let (saved_opt, saved_sched) = manifest.registered(m);
    if saved_opt != n_opt || saved_sched != n_sched {
        return Err(problem(
            &dir.join(MANIFEST_FILE),
            format!(
                "{which}it holds {saved_opt} optimizer(s) and {saved_sched} scheduler(s), but \
                 this run prepared {n_opt} and {n_sched}; prepare the same objects before \
                 load_state"
            ),
        ));
    }

    let params = read_parameters(view, manifest, dir, m, layout)?;
    let shapes = layout.shapes();
    // Under ZeRO stage 3 each rank's optimizer holds state only where it holds a piece.
    let held = layout
        .shards_parameters()
        .then(|| layout.partition().map(|z| z.rank(view.rank)))
        .flatten();

    let mut optimizers = Vec::with_capacity(n_opt);
    for i in 0..n_opt {
        let tensors = read_optimizer_tensors(view, manifest, dir, (m, layout), i)?;
        let jname = names.optimizer_json(i);
        let jpath = dir.join(&jname);
        let s: OptimizerScalars = files::parse_json(&jpath, &manifest.read_verified(dir, &jname)?)?;
        let mut state = OptimizerState::new(s.kind);
        state.tensors = tensors;
        for (k, v) in s.scalars {
            let v = v
                .get()
                .map_err(|e| problem(&jpath, format!("scalar {k:?}: {e}")))?;
            state.scalars.insert(k, v);
        }
        if let Some(held) = held {
            scalars::keep_held_step_counts(&mut state, &shapes, held);
        }
        optimizers.push(state);
    }

    let mut schedulers = Vec::with_capacity(n_sched);
    for i in 0..n_sched {
        let sname = names.scheduler(i);
        let spath = dir.join(&sname);
        let s: SchedulerFile = files::parse_json(&spath, &manifest.read_verified(dir, &sname)?)?;
        let base_lr = s
            .base_lr
            .get()
            .map_err(|e| problem(&spath, format!("base_lr: {e}")))?;
        let group_base_lrs = s
            .group_base_lrs
            .iter()
            .map(|v| v.get())
            .collect::<std::result::Result<Vec<f64>, _>>()
            .map_err(|e| problem(&spath, format!("group_base_lrs: {e}")))?;
        schedulers.push(SchedulerState {
            steps: s.steps,
            base_lr,
            group_base_lrs,
        });
    }

    let aname = names.accumulation();
    let apath = dir.join(&aname);
    let a: AccumulationFile = files::parse_json(&apath, &manifest.read_verified(dir, &aname)?)?;
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
    training
        .check_counters(&counters)
        .map_err(|e| problem(&apath, e))?;

    let loss_scaler = read_loss_scaler(training, manifest, dir, names)?;

    let has_gradients = match m {
        0 => rank.has_gradients,
        m => rank
            .further_models_have_gradients
            .get(m - 1)
            .copied()
            .unwrap_or(false),
    };
    // Gradients outside a window: a backward under a NoSync guard ended a window unsynced.
    let window_gradients = if counters.taken > 0 || has_gradients {
        if !has_gradients {
            return Err(problem(
                &dir.join(files::rank_file(view.rank)),
                format!(
                    "{which}saved inside an accumulation window but without that window's \
                     gradients"
                ),
            ));
        }
        let name = names.rank_gradients(view.rank);
        let gpath = dir.join(&name);
        let g = files::parse_safetensors(&gpath, &manifest.read_verified(dir, &name)?)?;
        for (name, t) in &g {
            match shapes.iter().find(|(n, _)| n == name) {
                Some((_, shape)) if shape.dims() == t.dims() => {}
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
    Ok(LoadedModel {
        params,
        snapshot: TrainingSnapshot {
            counters,
            window_gradients,
            optimizers,
            schedulers,
            loss_scaler,
        },
    })
}

/// Model `m`'s parameters as this rank's model holds them (laid out as `layout` says): whole
/// below ZeRO stage 3, this rank's pieces at stage 3 (empty where it holds none), whatever stage
/// and world size saved them, whole or in pieces. Whole tensors are read on the host and cut
/// there: nothing but this rank's pieces reaches its device.
fn read_parameters(
    view: &TrainingView<'_>,
    manifest: &Manifest,
    dir: &Path,
    m: usize,
    layout: &ModelLayout,
) -> Result<BTreeMap<String, Tensor>> {
    let names = ModelFiles(m);
    let entries = layout.entries();
    let shapes = layout.shapes();
    let target = layout
        .shards_parameters()
        .then(|| layout.partition().map(|z| z.rank(view.rank)))
        .flatten();
    let saved_zero = manifest.model_zero(m).filter(|z| z.sharded_parameters);
    let mut read_shard = |rank: usize| {
        let name = names.parameter_shard(rank);
        files::parse_safetensors(&dir.join(&name), &manifest.read_verified(dir, &name)?)
    };
    let (path, saved) = match saved_zero {
        None => {
            let pname = names.parameters();
            let path = dir.join(&pname);
            let params = files::parse_safetensors(&path, &manifest.read_verified(dir, &pname)?)?;
            check_whole_parameters(&path, &params, &entries)?;
            (path, SavedTensors::Full(params))
        }
        Some(zero) => saved_pieces(dir, zero, manifest, &mut read_shard)?,
    };
    let mut params = reshard::tensors_for(&path, Keys::Parameters, saved, &shapes, target)?;
    for (p, (name, _)) in shapes.iter().enumerate() {
        let dtype = layout.dtype(p);
        match params.get(name) {
            Some(t) if t.dtype() == dtype => {}
            Some(t) => {
                return Err(problem(
                    &path,
                    format!(
                        "parameter {name:?} was saved as {:?} but the manifest and the model say \
                         {dtype:?}; the checkpoint is corrupt",
                        t.dtype()
                    ),
                ))
            }
            // A piece this rank holds none of: empty, as the model holds it.
            None if target.is_some_and(|pieces| pieces[p].is_none()) => {
                params.insert(
                    name.clone(),
                    Tensor::zeros(0, dtype, &candle_core::Device::Cpu)?,
                );
            }
            None => {
                return Err(problem(
                    &path,
                    format!(
                        "parameter {name:?} is in no rank's saved pieces; the checkpoint is \
                         incomplete or corrupt"
                    ),
                ))
            }
        }
    }
    Ok(params)
}

/// Checks that `params`, read whole from `path`, are the model's parameters `entries`: every
/// one, of its shape and dtype, and nothing else.
fn check_whole_parameters(
    path: &Path,
    params: &BTreeMap<String, Tensor>,
    entries: &[manifest::ParameterEntry],
) -> Result<()> {
    for entry in entries {
        let name = &entry.name;
        match params.get(name) {
            Some(t) if t.dims() == entry.shape && t.dtype().as_str() == entry.dtype => {}
            Some(t) => {
                return Err(problem(
                    path,
                    format!(
                        "tensor {name:?} is {:?} {:?} but the manifest and the model say {:?} {}",
                        t.dims(),
                        t.dtype(),
                        entry.shape,
                        entry.dtype
                    ),
                ))
            }
            None => return Err(problem(path, format!("tensor {name:?} is missing"))),
        }
    }
    if params.len() != entries.len() {
        return Err(problem(
            path,
            format!(
                "holds {} tensors for {} parameters",
                params.len(),
                entries.len()
            ),
        ));
    }
    Ok(())
}

/// Refuses a ZeRO entry whose ranks do not match the world that saved the checkpoint.
/// The per-rank pieces `zero` records, read by `read`, once the entry is checked against the
/// manifest, with the manifest's path to name them in errors.
fn saved_pieces<'a>(
    dir: &Path,
    zero: &'a manifest::ZeroEntry,
    manifest: &Manifest,
    read: &'a mut dyn FnMut(usize) -> Result<BTreeMap<String, Tensor>>,
) -> Result<(PathBuf, SavedTensors<'a>)> {
    let path = dir.join(MANIFEST_FILE);
    check_zero_entry(&path, zero, manifest)?;
    Ok((path, SavedTensors::Pieces { zero, read }))
}

fn check_zero_entry(path: &Path, zero: &manifest::ZeroEntry, manifest: &Manifest) -> Result<()> {
    if zero.world_size != manifest.world_size || zero.pieces.len() != zero.world_size {
        return Err(problem(
            path,
            format!(
                "its ZeRO entry lists {} rank(s)' pieces for a world of {} saved by {} \
                 processes; the manifest is corrupt",
                zero.pieces.len(),
                zero.world_size,
                manifest.world_size
            ),
        ));
    }
    Ok(())
}

/// Optimizer `i` of model `m`'s tensors as this rank's optimizer loads them: whole without ZeRO,
/// this rank's pieces of this run's partition under it (laid out as `layout` says), whatever
/// stage and world size saved them.
fn read_optimizer_tensors(
    view: &TrainingView<'_>,
    manifest: &Manifest,
    dir: &Path,
    (m, layout): (usize, &ModelLayout),
    i: usize,
) -> Result<BTreeMap<String, Tensor>> {
    let names = ModelFiles(m);
    let target = layout.partition().map(|z| z.rank(view.rank));
    let mut read_shard = |rank: usize| {
        let name = names.optimizer_shard(i, rank);
        files::parse_safetensors(&dir.join(&name), &manifest.read_verified(dir, &name)?)
    };
    let (path, saved) = match manifest.model_zero(m) {
        None => {
            let name = names.optimizer_tensors(i);
            let path = dir.join(&name);
            let tensors = files::parse_safetensors(&path, &manifest.read_verified(dir, &name)?)?;
            (path, SavedTensors::Full(tensors))
        }
        Some(zero) => saved_pieces(dir, zero, manifest, &mut read_shard)?,
    };
    reshard::tensors_for(&path, Keys::OptimizerState, saved, &layout.shapes(), target)
}

/// The saved fp16 loss scaler state, checked against this run's scaler. A checkpoint saved without
/// fp16 has none (the scaler then starts afresh), and a run without fp16 ignores a saved one.
fn read_loss_scaler(
    training: &TrainingState,
    manifest: &Manifest,
    dir: &Path,
    names: ModelFiles,
) -> Result<Option<LossScalerState>> {
    let Some(mut scaler) = training.loss_scaler() else {
        return Ok(None);
    };
    let name = names.loss_scaler();
    if !manifest.files.contains_key(&name) {
        return Ok(None);
    }
    let path = dir.join(&name);
    let f: LossScalerFile = files::parse_json(&path, &manifest.read_verified(dir, &name)?)?;
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

/// Restores every model; if one still refuses its part, the models already restored are put back
/// as they were (each model puts back its own part itself), so none is half-loaded.
fn apply_models(view: &TrainingView<'_>, loaded: Vec<LoadedModel>) -> Result<()> {
    // With one model, its own restore is the whole rollback: no second copy of its state.
    let several = loaded.len() > 1;
    let mut before = Vec::with_capacity(loaded.len());
    for (training, part) in view.models.iter().zip(loaded) {
        let now = if several {
            Some((training.parameter_values()?, training.snapshot(true)?))
        } else {
            None
        };
        if let Err(e) = training.restore(&part.params, part.snapshot) {
            for (training, (params, snapshot)) in
                view.models.iter().zip(before.into_iter().flatten())
            {
                let _ = training.restore(&params, snapshot);
            }
            return Err(e);
        }
        before.push(now);
    }
    Ok(())
}

/// Applies a verified checkpoint (the training state puts back what it changed if a part still
/// refuses its value), then this rank's generator.
fn apply(view: &TrainingView<'_>, loaded: Loaded, dir: &Path) -> Result<()> {
    apply_models(view, loaded.models)?;
    // Parsed, and their locks seen free, already: replacing the values fails only if another
    // thread of the loop holds a handle's lock for longer than the bounded wait.
    for (i, (object, value)) in view.custom.iter().zip(loaded.custom).enumerate() {
        object.apply(value).map_err(|e| {
            problem(
                &dir.join(custom_file(i)),
                format!(
                    "registered object {i} ({}) was not replaced: {e}",
                    object.type_name()
                ),
            )
        })?;
    }
    view.loaders.resume(&loaded.rank.loaders);
    match loaded.rng {
        Some(rng) => view.rng.restore(rng),
        None if view.rank >= loaded.saved_world => {
            let line = format!(
                "{} was saved by {} processes and holds no random generator state for rank {}; \
                 this rank's generator starts from the run's seed",
                dir.display(),
                loaded.saved_world,
                view.rank
            );
            tracing::warn!("checkpoint: {line}");
            eprintln!("accelerate: warning: checkpoint: {line}");
        }
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
