//! The manifest of a checkpoint: what it holds and how to tell that it is whole.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Shape};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Name of the manifest file in a checkpoint directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// The newest checkpoint layout this code writes and reads. Version 2 added several models
/// (`further_models`), objects registered for checkpointing (`custom_objects`), the gradients
/// a `no_sync` guard left outside a window and ZeRO's per-rank optimizer pieces (`zero`);
/// version 3 added parameters saved as each rank's pieces (ZeRO stage 3 under
/// `SHARDED_STATE_DICT`: [`ZeroEntry::sharded_parameters`]). A checkpoint is written as the
/// oldest version that holds what it uses, which older builds read alike, and one that uses more
/// is refused by them instead of silently losing that state.
pub const FORMAT_VERSION: u32 = 3;

/// The version of a checkpoint that uses what version 2 added but no sharded parameters.
pub const FORMAT_VERSION_2: u32 = 2;

/// The oldest checkpoint layout this code reads.
pub const OLDEST_FORMAT_VERSION: u32 = 1;

/// What the `format` field of every manifest says.
pub const FORMAT_NAME: &str = "accelerate-rs checkpoint";

/// One parameter of the saved model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParameterEntry {
    /// Its name (PyTorch style, `l1.weight`).
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its dtype, as candle spells it (`f32`).
    pub dtype: String,
}

/// One file of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Its size in bytes.
    pub bytes: u64,
    /// CRC-32 (IEEE) of its content.
    pub crc32: u32,
}

/// A prepared model after the first: its optimizers, schedulers and parameters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelEntry {
    /// Its optimizer steps when it was saved.
    pub optimizer_steps: u64,
    /// Its prepared optimizers (`model_<m>.optimizer_<i>`).
    pub optimizers: usize,
    /// Its prepared schedulers (`model_<m>.scheduler_<i>`).
    pub schedulers: usize,
    /// Its parameters, sorted by name.
    pub parameters: Vec<ParameterEntry>,
    /// How its optimizer state was sharded (absent without ZeRO).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero: Option<ZeroEntry>,
}

/// One rank's piece of one parameter under ZeRO: elements `start .. start + len` of the
/// parameter's flattened elements.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PieceEntry {
    /// The parameter's name.
    pub param: String,
    /// Its first element in the flattened parameter.
    pub start: u64,
    /// Its number of elements.
    pub len: u64,
}

/// How a model's optimizer state was sharded by ZeRO: each rank saved the pieces listed here in
/// `optimizer_<i>.rank_<r>.safetensors` (1-D tensors `"<what>.<param>"` of the piece's length),
/// and the main process the scalars in `optimizer_<i>.json`. At stage 3 the pieces are also those
/// of the parameters themselves, which each rank saved in `model.rank_<r>.safetensors` (1-D
/// tensors named by the parameter) when [`sharded_parameters`](Self::sharded_parameters) says
/// so. A load re-cuts them for its own stage and world size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ZeroEntry {
    /// The ZeRO stage (1, 2 or 3).
    pub stage: u8,
    /// The number of ranks that saved pieces.
    pub world_size: usize,
    /// Each rank's pieces, in rank order; a parameter a rank owns none of is absent from its list.
    pub pieces: Vec<Vec<PieceEntry>>,
    /// Whether the parameters were saved as each rank's pieces (`model.rank_<r>.safetensors`;
    /// stage 3 under `SHARDED_STATE_DICT`) rather than whole in `model.safetensors`; absent, and
    /// false, otherwise.
    #[serde(default, skip_serializing_if = "is_false")]
    pub sharded_parameters: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl ZeroEntry {
    /// Rank `rank`'s piece of `param`, as a range of its flattened elements.
    pub fn piece(&self, rank: usize, param: &str) -> Option<std::ops::Range<usize>> {
        self.pieces
            .get(rank)?
            .iter()
            .find(|p| p.param == param)
            .map(|p| {
                let start = p.start as usize;
                start..start + p.len as usize
            })
    }
}

/// The manifest: written last, so a checkpoint with a manifest is complete.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// Layout version ([`FORMAT_VERSION`]).
    pub format_version: u32,
    /// Number of processes that saved it (each wrote its own `rank_<r>.json`).
    pub world_size: usize,
    /// Optimizer steps taken when it was saved.
    pub optimizer_steps: u64,
    /// Prepared optimizers and schedulers saved (`optimizer_<i>`, `scheduler_<i>`).
    pub optimizers: usize,
    /// Prepared schedulers saved.
    pub schedulers: usize,
    /// The model's parameters, sorted by name.
    pub parameters: Vec<ParameterEntry>,
    /// Each prepared model after the first (none in a checkpoint of one model).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub further_models: Vec<ModelEntry>,
    /// Objects registered with `register_for_checkpointing` (`custom_checkpoint_<i>.cbor`);
    /// absent, and 0, in a checkpoint of a run that registered none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub custom_objects: usize,
    /// How the first model's optimizer state was sharded (absent without ZeRO).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero: Option<ZeroEntry>,
    /// What the random state is (there is no generator to save; see the module documentation).
    pub random_state: String,
    /// Every other file of the checkpoint, by its plain name in the checkpoint's directory
    /// (no directories, no `..`: see [`check_file_name`]).
    pub files: BTreeMap<String, FileEntry>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// CRC-32 and size of `bytes`.
pub fn file_entry(bytes: &[u8]) -> FileEntry {
    FileEntry {
        bytes: bytes.len() as u64,
        crc32: crc32fast::hash(bytes),
    }
}

/// The manifest entry of a parameter called `name`, whole.
pub fn parameter_entry(name: &str, shape: &Shape, dtype: DType) -> ParameterEntry {
    ParameterEntry {
        name: name.to_string(),
        shape: shape.dims().to_vec(),
        dtype: dtype.as_str().to_string(),
    }
}

fn corrupt(path: &Path, problem: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// Checks that `name` is a plain file name: one component, not `.` or `..`, without a path
/// separator or NUL. A manifest names the files of its own directory; any other name (`/dev/zero`,
/// `../../x`) would make loading read outside the checkpoint.
pub fn check_file_name(name: &str) -> std::result::Result<(), String> {
    let plain = !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\0'])
        && Path::new(name).file_name() == Some(std::ffi::OsStr::new(name));
    if plain {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a plain file name inside the checkpoint (a checkpoint's files are \
             named like model.safetensors, without directories)"
        ))
    }
}

impl Manifest {
    /// Reads and parses `<dir>/manifest.json`, refusing a manifest that names a file outside the
    /// checkpoint (see [`check_file_name`]); returns it with the CRC-32 of its bytes: two
    /// checkpoints with the same step and manifest checksum hold the same files (the manifest
    /// lists every file's CRC-32).
    pub fn read_with_checksum(dir: &Path) -> Result<(Self, u32)> {
        let path = dir.join(MANIFEST_FILE);
        let bytes = std::fs::read(&path).map_err(|e| {
            corrupt(
                &path,
                format!(
                    "cannot read the manifest ({e}); a checkpoint without one is incomplete (an \
                     interrupted save) or not a checkpoint: load another checkpoint"
                ),
            )
        })?;
        let manifest: Manifest = serde_json::from_slice(&bytes).map_err(|e| {
            corrupt(
                &path,
                format!("the manifest is not valid ({e}); the checkpoint is corrupt"),
            )
        })?;
        if manifest.format != FORMAT_NAME {
            return Err(corrupt(
                &path,
                format!(
                    "format is {:?}, not {FORMAT_NAME:?}: not an accelerate-rs checkpoint",
                    manifest.format
                ),
            ));
        }
        if !(OLDEST_FORMAT_VERSION..=FORMAT_VERSION).contains(&manifest.format_version) {
            return Err(corrupt(
                &path,
                format!(
                    "format version {} cannot be read by this build, which reads versions \
                     {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION}; load it with the version of \
                     accelerate-rs that wrote it",
                    manifest.format_version
                ),
            ));
        }
        for name in manifest.files.keys() {
            check_file_name(name).map_err(|why| {
                corrupt(
                    &path,
                    format!(
                        "it lists {why}; the manifest is corrupt or was not written by \
                         accelerate-rs, so nothing of it is read: load another checkpoint"
                    ),
                )
            })?;
        }
        Ok((manifest, crc32fast::hash(&bytes)))
    }

    /// Checks that the checkpoint fits this run's model, whose whole parameters are `ours`: same
    /// parameter names, shapes and dtypes. (Another world size is the load's to judge: it
    /// depends on where the loaders were.)
    pub fn check_compatible(&self, dir: &Path, ours: &[ParameterEntry]) -> Result<()> {
        check_parameters(&dir.join(MANIFEST_FILE), "", &self.parameters, ours)
    }

    /// How model `m`'s optimizer state was sharded, if it was.
    pub fn model_zero(&self, m: usize) -> Option<&ZeroEntry> {
        match m {
            0 => self.zero.as_ref(),
            m => self.further_models.get(m - 1)?.zero.as_ref(),
        }
    }

    /// The saved parameters of model `m` (0 is the first), if the checkpoint has that model.
    pub fn model_parameters(&self, m: usize) -> Option<&[ParameterEntry]> {
        match m {
            0 => Some(&self.parameters),
            m => self
                .further_models
                .get(m - 1)
                .map(|e| e.parameters.as_slice()),
        }
    }

    /// Number of prepared models saved.
    pub fn models(&self) -> usize {
        1 + self.further_models.len()
    }

    /// `(optimizers, schedulers)` saved for model `m`.
    pub fn registered(&self, m: usize) -> (usize, usize) {
        match m {
            0 => (self.optimizers, self.schedulers),
            m => self
                .further_models
                .get(m - 1)
                .map_or((0, 0), |e| (e.optimizers, e.schedulers)),
        }
    }
}

/// Checks that `ours` (a model's whole parameters) are the `saved` parameters (names, shapes,
/// dtypes) of the model `which` names in the message ("" for the first).
pub fn check_parameters(
    path: &Path,
    which: &str,
    saved: &[ParameterEntry],
    ours: &[ParameterEntry],
) -> Result<()> {
    if ours != saved {
        let mut problems = Vec::new();
        for p in saved {
            match ours.iter().find(|o| o.name == p.name) {
                None => problems.push(format!("{:?} is not a parameter of this model", p.name)),
                Some(o) if o != p => problems.push(format!(
                    "{:?} was saved as {:?} {} but the model has {:?} {}",
                    p.name, p.shape, p.dtype, o.shape, o.dtype
                )),
                Some(_) => {}
            }
        }
        for o in ours {
            if !saved.iter().any(|p| p.name == o.name) {
                problems.push(format!(
                    "{:?} of the model is not in the checkpoint",
                    o.name
                ));
            }
        }
        return Err(corrupt(
            path,
            format!(
                "it was saved from a different {which}model: {}; resume with the model \
                 configuration that saved it",
                problems.join("; ")
            ),
        ));
    }
    Ok(())
}

impl Manifest {
    /// Reads `name` from `dir` and checks it against its manifest entry: listed, a regular file
    /// of the checkpoint's directory (not a link, a directory or a device), of the recorded size
    /// (checked before reading) and CRC-32. Returns its bytes, which the caller parses (no second
    /// read).
    pub fn read_verified(&self, dir: &Path, name: &str) -> Result<Vec<u8>> {
        let path = dir.join(name);
        check_file_name(name).map_err(|why| corrupt(&dir.join(MANIFEST_FILE), why))?;
        let entry = self.files.get(name).ok_or_else(|| {
            corrupt(
                &path,
                "the manifest does not list this file, which this checkpoint needs; the \
                 checkpoint is incomplete or was written by something else",
            )
        })?;
        let missing = |e: std::io::Error| {
            corrupt(
                &path,
                format!("missing or unreadable ({e}); the checkpoint is incomplete"),
            )
        };
        let meta = std::fs::symlink_metadata(&path).map_err(missing)?;
        if !meta.file_type().is_file() {
            return Err(corrupt(
                &path,
                "not a regular file (a link, a directory or a device); a checkpoint's files are \
                 plain files in its own directory: load another checkpoint",
            ));
        }
        if meta.len() != entry.bytes {
            return Err(corrupt(
                &path,
                format!(
                    "is {} bytes but the manifest records {}; the file was truncated or replaced",
                    meta.len(),
                    entry.bytes
                ),
            ));
        }
        let bytes = std::fs::read(&path).map_err(missing)?;
        if bytes.len() as u64 != entry.bytes {
            return Err(corrupt(
                &path,
                format!(
                    "is {} bytes but the manifest records {}; the file was truncated or replaced",
                    bytes.len(),
                    entry.bytes
                ),
            ));
        }
        let crc = crc32fast::hash(&bytes);
        if crc != entry.crc32 {
            return Err(corrupt(
                &path,
                format!(
                    "checksum mismatch (CRC-32 {crc:08x}, the manifest records {:08x}); the file \
                     is corrupt",
                    entry.crc32
                ),
            ));
        }
        Ok(bytes)
    }
}
