//! `save_state`: every rank writes its part into the staging directory, the main process writes
//! the shared files and the manifest and renames the directory into place; barriers keep the ranks
//! in step, so when `save_state` returns on any rank the checkpoint is complete on disk.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::Tensor;

use super::exact::ExactF64;
use super::files::{self, AccumulationFile, ModelFiles, OptimizerScalars, RankFile};
use super::layout::ModelLayout;
use super::manifest::{
    self, Manifest, ModelEntry, FORMAT_NAME, FORMAT_VERSION, FORMAT_VERSION_2, MANIFEST_FILE,
    OLDEST_FORMAT_VERSION,
};
use super::scalars;
use super::staging::{self, Staging};
use super::state_dict::StateDictType;
use super::{custom_file, TrainingView};
use crate::error::{Error, Result};
use crate::training::TrainingSnapshot;

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

/// One model's parameters as this rank writes them.
enum ParameterPart {
    /// Whole, in `model.safetensors` (main process): the trained parameters, or under ZeRO
    /// stage 3 those gathered unit by unit (`FULL_STATE_DICT`), by name.
    Whole(Vec<(String, Tensor)>),
    /// Under ZeRO stage 3 (`SHARDED_STATE_DICT`), this rank's non-empty pieces by name, in its
    /// own `model.rank_<r>.safetensors`.
    Pieces(Vec<(String, Tensor)>),
    /// Nothing from this rank (whole parameters are the main process's to write).
    None,
}

/// What a model's parameters look like and how this run writes them.
struct SavedModel {
    layout: ModelLayout,
    part: ParameterPart,
}

impl SavedModel {
    /// Whether the parameters go into every rank's own file.
    fn sharded_parameters(&self) -> bool {
        matches!(self.part, ParameterPart::Pieces(_))
    }
}

/// Saves the training state into `dir` (replacing a previous checkpoint there atomically), the
/// parameters of a model under ZeRO stage 3 as `given` says, or else as
/// `ACCELERATE_FSDP_STATE_DICT_TYPE` does. Every step that a rank does apart is agreed on by all
/// before the next (see [`super::agree`]), so all ranks return the same outcome.
pub(crate) fn save_state(
    view: &TrainingView<'_>,
    dir: &Path,
    given: Option<StateDictType>,
) -> Result<()> {
    check_same_custom_count(view, dir)?;
    let kind = agreed_state_dict_type(view, dir, given)?;
    let staging = Staging::for_target(dir)?;
    let main = view.rank == 0;
    let (mut snapshots, custom) = view.agree(
        dir,
        "taking the training state's snapshot",
        view.snapshots()
            .and_then(|s| Ok((s, custom_values(view, dir)?))),
    )?;
    let layouts: Vec<ModelLayout> = view
        .models
        .iter()
        .map(|m| ModelLayout::of(m, view.world_size))
        .collect();
    // Collectives (the same on every rank): the main process gets every rank's optimizer
    // scalars, and gathers the parameters of FULL_STATE_DICT.
    let merged = scalars::merge_on_main(view.comm, view.rank, &layouts, &mut snapshots);
    view.agree(dir, "collecting the optimizers' scalars", merged)?;
    let models = layouts
        .into_iter()
        .enumerate()
        .map(|(m, layout)| {
            let part = parameter_part(view, m, &layout, kind)?;
            Ok(SavedModel { layout, part })
        })
        .collect::<Result<Vec<_>>>();
    let models = view.agree(dir, "taking the parameters", models)?;
    let created = if main {
        staging::recover_interrupted_replace(dir, is_complete)
            .map(|done| log_recovery(&done.into_iter().collect::<Vec<_>>()))
            .and_then(|()| staging.create())
    } else {
        Ok(())
    };
    view.agree(dir, "creating the checkpoint's directory", created)?;
    let written = write_rank_part(view, &snapshots, &models, &staging).and_then(|()| {
        if main {
            snapshots
                .iter()
                .zip(&models)
                .enumerate()
                .try_for_each(|(m, (snapshot, model))| {
                    write_model_files(m, snapshot, model, &staging)
                })
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
        write_manifest(view, &snapshots, &models, &staging)
            .and_then(|()| staging.commit())
            .inspect_err(|_| staging.abort())
    } else {
        Ok(())
    };
    view.agree(dir, "committing the checkpoint", committed)?;
    view.reseed_device()?;
    Ok(())
}

/// Under ZeRO stage 3, how the parameters are written: `given`, or the environment's choice,
/// which must be the same on every rank (each rank reads its own environment, and a rank that
/// wrote its pieces while the main process gathered would leave a checkpoint without them).
/// `None` when no model is fully sharded (then nothing is exchanged).
fn agreed_state_dict_type(
    view: &TrainingView<'_>,
    dir: &Path,
    given: Option<StateDictType>,
) -> Result<Option<StateDictType>> {
    if !view.models.iter().any(|m| m.fsdp().is_some()) {
        return Ok(None);
    }
    let local = given.map_or_else(StateDictType::from_env, Ok);
    let kind = view.agree(dir, "choosing how to save the sharded parameters", local)?;
    if view.world_size > 1 {
        let codes = view
            .comm
            .all_gather(&Tensor::new(&[kind.code()], &candle_core::Device::Cpu)?)?
            .flatten_all()?
            .to_vec1::<i64>()?;
        if codes.iter().any(|&c| c != kind.code()) {
            let per_rank: Vec<String> = codes
                .iter()
                .enumerate()
                .map(|(rank, &c)| {
                    let name = if c == StateDictType::Full.code() {
                        StateDictType::Full
                    } else {
                        StateDictType::Sharded
                    };
                    format!("rank {rank}: {}", name.as_str())
                })
                .collect();
            return Err(Error::Checkpoint {
                path: dir.to_path_buf(),
                problem: format!(
                    "the ranks chose different ways to save the sharded parameters ({}); set {} \
                     alike on every rank, or pass the same one to save_state_with everywhere",
                    per_rank.join(", "),
                    crate::env::FSDP_STATE_DICT_TYPE
                ),
            });
        }
    }
    Ok(Some(kind))
}

/// Model `m`'s parameters as this rank writes them: whole from the main process below stage 3;
/// at stage 3 gathered unit by unit to the main process's host (`Full`, a collective) or this
/// rank's own pieces (`Sharded`).
fn parameter_part(
    view: &TrainingView<'_>,
    m: usize,
    layout: &ModelLayout,
    kind: Option<StateDictType>,
) -> Result<ParameterPart> {
    let model = &view.models[m];
    let main = view.rank == 0;
    if !layout.shards_parameters() {
        return Ok(if main {
            ParameterPart::Whole(
                model
                    .parameters()
                    .iter()
                    .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
                    .collect(),
            )
        } else {
            ParameterPart::None
        });
    }
    match kind.unwrap_or(StateDictType::Sharded) {
        StateDictType::Full => {
            let whole = model.whole_parameters(view.comm, main)?;
            Ok(if main {
                ParameterPart::Whole(whole)
            } else {
                ParameterPart::None
            })
        }
        StateDictType::Sharded => Ok(ParameterPart::Pieces(
            model
                .parameters()
                .iter()
                .filter(|(_, v)| v.elem_count() > 0)
                .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
                .collect(),
        )),
    }
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

/// This rank's loader positions and, inside a window, each model's partial gradient sums; under
/// ZeRO its pieces of the optimizer state, and under stage 3 with sharded parameters its pieces
/// of the parameters.
fn write_rank_part(
    view: &TrainingView<'_>,
    snapshots: &[TrainingSnapshot],
    models: &[SavedModel],
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
        if models[m].layout.partition().is_some() {
            for (i, state) in snapshot.optimizers.iter().enumerate() {
                // At stage 3 a rank holding no piece of a parameter has no state of it; an empty
                // tensor is no piece either.
                let tensors: Vec<(String, Tensor)> = state
                    .tensors
                    .iter()
                    .filter(|(_, t)| t.elem_count() > 0)
                    .map(|(k, t)| (k.clone(), t.clone()))
                    .collect();
                let name = ModelFiles(m).optimizer_shard(i, view.rank);
                let bytes = files::safetensors_bytes(&staging.dir().join(&name), &tensors)?;
                staging.write(&name, &bytes)?;
            }
        }
    }
    for (m, model) in models.iter().enumerate() {
        if let ParameterPart::Pieces(pieces) = &model.part {
            let name = ModelFiles(m).parameter_shard(view.rank);
            let bytes = files::safetensors_bytes(&staging.dir().join(&name), pieces)?;
            staging.write(&name, &bytes)?;
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

/// Model `m`'s whole parameters (the f32 masters under mixed precision) unless every rank wrote
/// its pieces, optimizers, schedulers, fp16 loss scaler and accumulation counters (main process
/// only).
fn write_model_files(
    m: usize,
    snapshot: &TrainingSnapshot,
    model: &SavedModel,
    staging: &Staging,
) -> Result<()> {
    let names = ModelFiles(m);
    if let ParameterPart::Whole(params) = &model.part {
        let name = names.parameters();
        staging.write(
            &name,
            &files::safetensors_bytes(&staging.dir().join(&name), params)?,
        )?;
    }

    // Under ZeRO the tensors are in every rank's shard files (`write_rank_part`).
    let sharded = model.layout.partition().is_some();
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
    models: &[SavedModel],
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
    let zero_entry = |model: &SavedModel| model.layout.zero_entry(model.sharded_parameters());
    let further_models: Vec<ModelEntry> = snapshots
        .iter()
        .zip(models)
        .skip(1)
        .map(|(snapshot, model)| ModelEntry {
            optimizer_steps: snapshot.counters.optimizer_steps,
            optimizers: snapshot.optimizers.len(),
            schedulers: snapshot.schedulers.len(),
            parameters: model.layout.entries(),
            zero: zero_entry(model),
        })
        .collect();
    let zero = zero_entry(&models[0]);
    let sharded = zero.is_some() || further_models.iter().any(|m| m.zero.is_some());
    // A no_sync guard is used alike on every rank, so the main process's snapshot tells.
    let unsynced_outside_window = snapshots
        .iter()
        .any(|s| s.window_gradients.is_some() && s.counters.taken == 0);
    let needs_version_2 =
        !further_models.is_empty() || !view.custom.is_empty() || unsynced_outside_window || sharded;
    let m = Manifest {
        format: FORMAT_NAME.into(),
        format_version: if models.iter().any(SavedModel::sharded_parameters) {
            FORMAT_VERSION
        } else if needs_version_2 {
            FORMAT_VERSION_2
        } else {
            OLDEST_FORMAT_VERSION
        },
        world_size: view.world_size,
        optimizer_steps: first.counters.optimizer_steps,
        optimizers: first.optimizers.len(),
        schedulers: first.schedulers.len(),
        parameters: models[0].layout.entries(),
        further_models,
        custom_objects: view.custom.len(),
        zero,
        random_state: RANDOM_STATE.into(),
        files: entries,
    };
    staging.write(MANIFEST_FILE, &files::json_bytes(&m)?)
}
