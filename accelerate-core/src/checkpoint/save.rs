//! `save_state`: every rank writes its part into the staging directory, the main process writes
//! the shared files and the manifest and renames the directory into place; barriers keep the ranks
//! in step, so when `save_state` returns on any rank the checkpoint is complete on disk.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::Tensor;

use super::exact::ExactF64;
use super::files::{self, AccumulationFile, ModelFiles, OptimizerScalars, RankFile};
use super::manifest::{
    self, Manifest, ModelEntry, PieceEntry, ZeroEntry, FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE,
    OLDEST_FORMAT_VERSION,
};
use super::staging::{self, Staging};
use super::{custom_file, TrainingView};
use crate::error::{Error, Result};
use crate::training::{TrainingSnapshot, TrainingState};

/// What the manifest says about randomness.
const RANDOM_STATE: &str = "each loader's shuffle order is a pure function of its seed (from the \
    run's configuration) and the epoch, and rank_<r>.json holds every loader's epoch and position; \
    rng_<r>.json holds the exact position of rank r's own generator";

/// Logs what recovering an interrupted replace did (on stderr and through `tracing`).
pub(crate) fn log_recovery(done: &[String]) {
    for line in done {
        tracing::warn!("checkpoint: {line}");
        eprintln!("accelerate: warning: checkpoint: {line}");
    }
}

/// Whether `dir` holds a whole checkpoint (the manifest is written last).
pub(crate) fn is_complete(dir: &Path) -> bool {
    dir.join(MANIFEST_FILE).is_file()
}

/// Saves the training state into `dir` (replacing a previous checkpoint there atomically). Every
/// step that a rank does apart is agreed on by all before the next (see [`super::agree`]), so all
/// ranks return the same outcome.
pub(crate) fn save_state(view: &TrainingView<'_>, dir: &Path) -> Result<()> {
    check_same_custom_count(view, dir)?;
    let staging = Staging::for_target(dir)?;
    let main = view.rank == 0;
    let (snapshots, custom) = view.agree(
        dir,
        "taking the training state's snapshot",
        view.snapshots()
            .and_then(|s| Ok((s, custom_values(view, dir)?))),
    )?;
    let created = if main {
        staging::recover_interrupted_replace(dir, is_complete)
            .map(|done| log_recovery(&done.into_iter().collect::<Vec<_>>()))
            .and_then(|()| staging.create())
    } else {
        Ok(())
    };
    view.agree(dir, "creating the checkpoint's directory", created)?;
    let written = write_rank_part(view, &snapshots, &staging).and_then(|()| {
        if main {
            snapshots
                .iter()
                .enumerate()
                .try_for_each(|(m, snapshot)| write_model_files(view, m, snapshot, &staging))
                .and_then(|()| {
                    custom
                        .iter()
                        .enumerate()
                        .try_for_each(|(i, bytes)| staging.write(&custom_file(i), bytes))
                })
        } else {
            Ok(())
        }
    });
    if let Err(e) = view.agree(dir, "writing the checkpoint's files", written) {
        if main {
            staging.abort();
        }
        return Err(e);
    }
    let committed = if main {
        write_manifest(view, &snapshots, &staging)
            .and_then(|()| staging.commit())
            .inspect_err(|_| staging.abort())
    } else {
        Ok(())
    };
    view.agree(dir, "committing the checkpoint", committed)?;
    view.reseed_device()?;
    Ok(())
}

/// The registered objects' values now, as CBOR (main process, which writes them; empty on the
/// others).
fn custom_values(view: &TrainingView<'_>, dir: &Path) -> Result<Vec<Vec<u8>>> {
    if view.rank != 0 {
        return Ok(Vec::new());
    }
    view.custom
        .iter()
        .enumerate()
        .map(|(i, object)| {
            object.encode().map_err(|e| Error::Checkpoint {
                path: dir.join(custom_file(i)),
                problem: format!(
                    "registered object {i} ({}) cannot be saved: {e}",
                    object.type_name()
                ),
            })
        })
        .collect()
}

/// Every rank's number of objects registered for checkpointing; refused on every rank, naming
/// them, unless all registered as many (only the main process's values are saved, and every rank
/// loads them: a rank that registered another number could not load the checkpoint).
fn check_same_custom_count(view: &TrainingView<'_>, dir: &Path) -> Result<()> {
    if view.world_size == 1 {
        return Ok(());
    }
    let local = Tensor::new(&[view.custom.len() as i64], &candle_core::Device::Cpu)?;
    let counts = view
        .comm
        .all_gather(&local)?
        .flatten_all()?
        .to_vec1::<i64>()?;
    if counts.iter().all(|&c| c == counts[0]) {
        return Ok(());
    }
    let per_rank: Vec<String> = counts
        .iter()
        .enumerate()
        .map(|(rank, c)| format!("rank {rank}: {c}"))
        .collect();
    Err(Error::Checkpoint {
        path: dir.to_path_buf(),
        problem: format!(
            "the ranks registered different numbers of objects for checkpointing ({}); call \
             register_for_checkpointing with the same objects, in the same order, on every rank",
            per_rank.join(", ")
        ),
    })
}

/// This rank's loader positions and, inside a window, each model's partial gradient sums.
fn write_rank_part(
    view: &TrainingView<'_>,
    snapshots: &[TrainingSnapshot],
    staging: &Staging,
) -> Result<()> {
    let mut has_gradients = Vec::with_capacity(snapshots.len());
    for (m, snapshot) in snapshots.iter().enumerate() {
        if let Some(grads) = &snapshot.window_gradients {
            let tensors: Vec<(String, Tensor)> =
                grads.iter().map(|(n, t)| (n.clone(), t.clone())).collect();
            let name = ModelFiles(m).rank_gradients(view.rank);
            let bytes = files::safetensors_bytes(&staging.dir().join(&name), &tensors)?;
            staging.write(&name, &bytes)?;
        }
        has_gradients.push(snapshot.window_gradients.is_some());
        // Under ZeRO each rank's snapshot holds its own pieces of every optimizer's tensors.
        if view.models[m].zero_plan().is_some() {
            for (i, state) in snapshot.optimizers.iter().enumerate() {
                let tensors: Vec<(String, Tensor)> = state
                    .tensors
                    .iter()
                    .map(|(k, t)| (k.clone(), t.clone()))
                    .collect();
                let name = ModelFiles(m).optimizer_shard(i, view.rank);
                let bytes = files::safetensors_bytes(&staging.dir().join(&name), &tensors)?;
                staging.write(&name, &bytes)?;
            }
        }
    }
    let part = RankFile {
        rank: view.rank,
        loaders: view.loaders.positions(),
        has_gradients: has_gradients[0],
        further_models_have_gradients: has_gradients[1..].to_vec(),
    };
    staging.write(&files::rank_file(view.rank), &files::json_bytes(&part)?)?;
    let mut rng = view.rng.state();
    rng.device_seed = (!view.device.is_cpu()).then(|| view.rng.device_seed());
    staging.write(&files::rng_file(view.rank), &files::json_bytes(&rng)?)
}

/// Model `m`'s parameters (the f32 masters under mixed precision), optimizers, schedulers, fp16
/// loss scaler and accumulation counters (main process only).
fn write_model_files(
    view: &TrainingView<'_>,
    m: usize,
    snapshot: &TrainingSnapshot,
    staging: &Staging,
) -> Result<()> {
    let names = ModelFiles(m);
    let params: Vec<(String, Tensor)> = view.models[m]
        .parameters()
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect();
    let name = names.parameters();
    staging.write(
        &name,
        &files::safetensors_bytes(&staging.dir().join(&name), &params)?,
    )?;

    // Under ZeRO the tensors are in every rank's shard files (`write_rank_part`).
    let sharded = view.models[m].zero_plan().is_some();
    for (i, state) in snapshot.optimizers.iter().enumerate() {
        if !sharded {
            let tensors: Vec<(String, Tensor)> = state
                .tensors
                .iter()
                .map(|(k, t)| (k.clone(), t.clone()))
                .collect();
            let name = names.optimizer_tensors(i);
            let bytes = files::safetensors_bytes(&staging.dir().join(&name), &tensors)?;
            staging.write(&name, &bytes)?;
        }
        let scalars = OptimizerScalars {
            kind: state.kind.clone(),
            scalars: state
                .scalars
                .iter()
                .map(|(k, v)| (k.clone(), ExactF64::new(*v)))
                .collect(),
        };
        staging.write(&names.optimizer_json(i), &files::json_bytes(&scalars)?)?;
    }

    for (i, state) in snapshot.schedulers.iter().enumerate() {
        let file = files::SchedulerFile {
            steps: state.steps,
            base_lr: ExactF64::new(state.base_lr),
            group_base_lrs: state
                .group_base_lrs
                .iter()
                .map(|&v| ExactF64::new(v))
                .collect(),
        };
        staging.write(&names.scheduler(i), &files::json_bytes(&file)?)?;
    }

    if let Some(state) = &snapshot.loss_scaler {
        let file = files::LossScalerFile {
            scale: ExactF64::new(state.scale),
            growth_tracker: state.growth_tracker,
        };
        staging.write(&names.loss_scaler(), &files::json_bytes(&file)?)?;
    }

    let c = snapshot.counters;
    let acc = AccumulationFile {
        gradient_accumulation_steps: c.steps,
        micro_steps_taken_in_window: c.taken,
        window_len: c.window_len,
        item_scale: c.item_scale.map(ExactF64::new),
        optimizer_steps: c.optimizer_steps,
    };
    staging.write(&names.accumulation(), &files::json_bytes(&acc)?)
}

/// Lists every file of the staging directory with its size and checksum, checks that every rank
/// wrote its part, and writes the manifest last.
fn write_manifest(
    view: &TrainingView<'_>,
    snapshots: &[TrainingSnapshot],
    staging: &Staging,
) -> Result<()> {
    let mut entries = BTreeMap::new();
    let dir = staging.dir();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let bytes = std::fs::read(entry.path()).map_err(|e| Error::io(entry.path(), e))?;
        entries.insert(name, manifest::file_entry(&bytes));
    }
    for r in 0..view.world_size {
        let name = files::rank_file(r);
        if !entries.contains_key(&name) {
            return Err(Error::Checkpoint {
                path: dir.join(&name),
                problem: format!(
                    "rank {r} did not write its part; checkpoints of several processes need a \
                     directory every process can write to (a shared filesystem)"
                ),
            });
        }
    }
    let first = &snapshots[0];
    let further_models: Vec<ModelEntry> = snapshots
        .iter()
        .zip(view.models)
        .skip(1)
        .map(|(snapshot, model)| ModelEntry {
            optimizer_steps: snapshot.counters.optimizer_steps,
            optimizers: snapshot.optimizers.len(),
            schedulers: snapshot.schedulers.len(),
            parameters: manifest::parameter_entries(model.parameters()),
            zero: zero_entry(model),
        })
        .collect();
    let zero = zero_entry(&view.models[0]);
    let sharded = zero.is_some() || further_models.iter().any(|m| m.zero.is_some());
    // A no_sync guard is used alike on every rank, so the main process's snapshot tells.
    let unsynced_outside_window = snapshots
        .iter()
        .any(|s| s.window_gradients.is_some() && s.counters.taken == 0);
    let needs_newest =
        !further_models.is_empty() || !view.custom.is_empty() || unsynced_outside_window || sharded;
    let m = Manifest {
        format: FORMAT_NAME.into(),
        format_version: if needs_newest {
            FORMAT_VERSION
        } else {
            OLDEST_FORMAT_VERSION
        },
        world_size: view.world_size,
        optimizer_steps: first.counters.optimizer_steps,
        optimizers: first.optimizers.len(),
        schedulers: first.schedulers.len(),
        parameters: manifest::parameter_entries(view.params()),
        further_models,
        custom_objects: view.custom.len(),
        zero,
        random_state: RANDOM_STATE.into(),
        files: entries,
    };
    staging.write(MANIFEST_FILE, &files::json_bytes(&m)?)
}

/// Under ZeRO, every rank's pieces of `model`'s parameters (the partition is the same on every
/// rank, so the main process lists them all).
fn zero_entry(model: &TrainingState) -> Option<ZeroEntry> {
    let (stage, plan) = model.zero_plan()?;
    let params = model.parameters();
    let pieces = (0..plan.world())
        .map(|rank| {
            params
                .iter()
                .enumerate()
                .filter_map(|(p, (name, _))| {
                    let piece = plan.piece(p, rank)?;
                    Some(PieceEntry {
                        param: name.clone(),
                        start: piece.start as u64,
                        len: piece.len() as u64,
                    })
                })
                .collect()
        })
        .collect();
    Some(ZeroEntry {
        stage,
        world_size: plan.world(),
        pieces,
    })
}
