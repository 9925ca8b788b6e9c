//! The model alone, as Hugging Face writes it: `model.safetensors`, or above a size limit shards
//! `model-00001-of-0000N.safetensors` with `model.safetensors.index.json`
//! (`{"metadata": {"total_size": bytes}, "weight_map": {name: shard}}`). Names and layouts are
//! PyTorch's (candle's `Linear` weight is `[out, in]` like `nn.Linear`'s), so
//! `safetensors.torch.load_file` / `transformers` read it unchanged.
//!
//! A save replaces the whole set, and a crash at any point leaves a directory from which a reader
//! loads either the whole previous model or the whole new one, never a mix, whether it opens
//! `model.safetensors` first (as transformers does) or the index first. The directory itself
//! cannot be swapped (it holds other files: a Trainer's checkpoints), so the order does it:
//! - new shards never overwrite a file the current index names (they take the next free name,
//!   `model-00001-of-00002-1.safetensors`, when the standard one is taken), and the index, written
//!   atomically after them, switches index-first readers in one rename;
//! - `model.safetensors`, written atomically, switches readers that open it first;
//! - only then go the files of the previous set, the other layout's entry point (the single file
//!   or the index) first, so until it goes a reader that prefers it still finds the whole
//!   previous set.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use candle_core::{Tensor, Var};

use crate::error::{Error, Result};
use crate::files::save_safetensors;

/// The unsharded model file.
pub const MODEL_FILE: &str = "model.safetensors";
/// The index of a sharded model.
pub const MODEL_INDEX_FILE: &str = "model.safetensors.index.json";
/// Shard size limit of [`save_model`]'s callers by default: Hugging Face's `max_shard_size="5GB"`.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

fn is_model_file(name: &str) -> bool {
    name == MODEL_FILE
        || name == MODEL_INDEX_FILE
        || (name.starts_with("model-") && name.contains("-of-") && name.ends_with(".safetensors"))
}

/// The files the index in `dir` names now: the previous set, which new shards must not overwrite
/// before the new index replaces it. None without an index (or with one no reader can use).
fn indexed_shards(dir: &Path) -> BTreeSet<String> {
    let Ok(bytes) = std::fs::read(dir.join(MODEL_INDEX_FILE)) else {
        return BTreeSet::new();
    };
    let Ok(index) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
        return BTreeSet::new();
    };
    index["weight_map"]
        .as_object()
        .map(|map| {
            map.values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Names for `count` shards that none of `taken` has: Hugging Face's
/// `model-0000i-of-0000N.safetensors`, or, where one of those is taken,
/// `model-0000i-of-0000N-<g>.safetensors` with the first free `g`.
fn shard_names(count: usize, taken: &BTreeSet<String>) -> Vec<String> {
    let names = |generation: usize| -> Vec<String> {
        (1..=count)
            .map(|i| match generation {
                0 => format!("model-{i:05}-of-{count:05}.safetensors"),
                g => format!("model-{i:05}-of-{count:05}-{g}.safetensors"),
            })
            .collect()
    };
    (0..)
        .map(names)
        .find(|names| names.iter().all(|n| !taken.contains(n)))
        .unwrap_or_default()
}

/// Writes `params` (sorted by name) into `dir`: one file when their data fits `max_shard_bytes`,
/// shards of at most that size (a larger tensor gets a shard of its own) plus the index otherwise.
/// The set is replaced as a whole (see the module documentation): a crash at any point leaves the
/// previous model or the new one loadable, and once it returns, the model files of an earlier save
/// are gone. Other files in `dir` are left alone. Returns the files written.
pub fn save_model(
    params: &[(String, Var)],
    dir: impl AsRef<Path>,
    max_shard_bytes: u64,
) -> Result<Vec<PathBuf>> {
    save_model_steps(params, dir.as_ref(), max_shard_bytes, &mut || Ok(()))
}

/// [`save_model`] of tensors (a sharded model's parameters, gathered to the host).
pub(crate) fn save_model_tensors(
    tensors: Vec<(String, Tensor)>,
    dir: &Path,
    max_shard_bytes: u64,
) -> Result<Vec<PathBuf>> {
    save_tensors_steps(tensors, dir, max_shard_bytes, &mut || Ok(()))
}

/// [`save_model`], calling `step` before each change on disk (a file written or removed), so a
/// test can stop it there as a crash would.
fn save_model_steps(
    params: &[(String, Var)],
    dir: &Path,
    max_shard_bytes: u64,
    step: &mut dyn FnMut() -> Result<()>,
) -> Result<Vec<PathBuf>> {
    let tensors: Vec<(String, Tensor)> = params
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect();
    save_tensors_steps(tensors, dir, max_shard_bytes, step)
}

/// [`save_model_steps`] of tensors.
fn save_tensors_steps(
    tensors: Vec<(String, Tensor)>,
    dir: &Path,
    max_shard_bytes: u64,
    step: &mut dyn FnMut() -> Result<()>,
) -> Result<Vec<PathBuf>> {
    if max_shard_bytes == 0 {
        return Err(Error::Config(
            "the shard size limit of save_model is 0 bytes; give a positive limit (Hugging Face \
             uses 5 GB)"
                .into(),
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let total: u64 = tensors.iter().map(|(_, t)| tensor_bytes(t)).sum();

    let mut shards: Vec<Vec<(String, Tensor)>> = Vec::new();
    let mut size = 0u64;
    for (n, t) in tensors {
        let b = tensor_bytes(&t);
        match shards.last_mut() {
            Some(last) if size + b <= max_shard_bytes => {
                last.push((n, t));
                size += b;
            }
            _ => {
                shards.push(vec![(n, t)]);
                size = b;
            }
        }
    }

    let mut written = Vec::new();
    if shards.len() <= 1 {
        let path = dir.join(MODEL_FILE);
        step()?;
        save_safetensors(&path, shards.first().map_or(&[][..], |s| &s[..]))?;
        written.push(path);
    } else {
        let names = shard_names(shards.len(), &indexed_shards(dir));
        let mut weight_map = BTreeMap::new();
        for (shard, name) in shards.iter().zip(&names) {
            for (n, _) in shard {
                weight_map.insert(n.clone(), name.clone());
            }
            let path = dir.join(name);
            step()?;
            save_safetensors(&path, shard)?;
            written.push(path);
        }
        let index = serde_json::json!({
            "metadata": { "total_size": total },
            "weight_map": weight_map,
        });
        let path = dir.join(MODEL_INDEX_FILE);
        let bytes = serde_json::to_vec_pretty(&index)
            .map_err(|e| Error::Config(format!("cannot encode the model index: {e}")))?;
        // The index last, in one rename: a reader that finds it finds every shard it names.
        step()?;
        crate::files::write_atomic(&path, &bytes)?;
        written.push(path);
    }

    let mut stale = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if is_model_file(&name) && !written.contains(&entry.path()) {
            stale.push(name);
        }
    }
    // The other layout's entry point first: while it is there, a reader that prefers it still
    // finds the whole previous set.
    stale.sort_by_key(|n| (n != MODEL_FILE && n != MODEL_INDEX_FILE, n.clone()));
    for name in stale {
        let path = dir.join(&name);
        step()?;
        std::fs::remove_file(&path).map_err(|e| Error::io(&path, e))?;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn var(values: &[f32], shape: &[usize]) -> Var {
        Var::from_tensor(&Tensor::from_slice(values, shape, &Device::Cpu).unwrap()).unwrap()
    }

    #[test]
    fn small_models_are_one_file_large_ones_shards_with_an_index() {
        let dir = tempfile::tempdir().unwrap();
        // 24 + 8 + 12 bytes.
        let params = vec![
            (
                "a.weight".to_string(),
                var(&[1., 2., 3., 4., 5., 6.], &[2, 3]),
            ),
            ("a.bias".to_string(), var(&[7., 8.], &[2])),
            ("b.weight".to_string(), var(&[9., 10., 11.], &[1, 3])),
        ];
        let mut sorted = params.clone();
        sorted.sort_by(|x, y| x.0.cmp(&y.0));

        save_model(&sorted, dir.path(), 1000).unwrap();
        let one =
            candle_core::safetensors::load(dir.path().join(MODEL_FILE), &Device::Cpu).unwrap();
        assert_eq!(one.len(), 3);
        assert_eq!(one["a.weight"].dims(), [2, 3]);
        assert_eq!(one["a.weight"].dtype(), DType::F32);

        // 32 bytes per shard: [a.bias 8 + a.weight 24], [b.weight 12].
        let files = save_model(&sorted, dir.path(), 32).unwrap();
        assert!(
            !dir.path().join(MODEL_FILE).exists(),
            "the unsharded file of the first save is gone"
        );
        assert_eq!(files.len(), 3);
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join(MODEL_INDEX_FILE)).unwrap())
                .unwrap();
        assert_eq!(index["metadata"]["total_size"], 44);
        assert_eq!(
            index["weight_map"]["a.bias"],
            "model-00001-of-00002.safetensors"
        );
        assert_eq!(
            index["weight_map"]["a.weight"],
            "model-00001-of-00002.safetensors"
        );
        assert_eq!(
            index["weight_map"]["b.weight"],
            "model-00002-of-00002.safetensors"
        );
        let second = candle_core::safetensors::load(
            dir.path().join("model-00002-of-00002.safetensors"),
            &Device::Cpu,
        )
        .unwrap();
        assert_eq!(
            second["b.weight"].to_vec2::<f32>().unwrap(),
            vec![vec![9., 10., 11.]]
        );
        assert!(save_model(&sorted, dir.path(), 0).is_err());
    }

    /// The three parameters of these tests (sorted by name; 8, 24 and 12 bytes), each value
    /// offset by `offset` so that two saves differ in every element.
    fn three(offset: f32) -> Vec<(String, Var)> {
        vec![
            (
                "a.bias".to_string(),
                var(&[7., 8.].map(|v| v + offset), &[2]),
            ),
            (
                "a.weight".to_string(),
                var(&[1., 2., 3., 4., 5., 6.].map(|v| v + offset), &[2, 3]),
            ),
            (
                "b.weight".to_string(),
                var(&[9., 10., 11.].map(|v| v + offset), &[1, 3]),
            ),
        ]
    }

    type Values = BTreeMap<String, Vec<f32>>;

    fn values_of(params: &[(String, Var)]) -> Values {
        params
            .iter()
            .map(|(n, v)| (n.clone(), v.flatten_all().unwrap().to_vec1().unwrap()))
            .collect()
    }

    fn load_file(path: &Path) -> Values {
        candle_core::safetensors::load(path, &Device::Cpu)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .into_iter()
            .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1().unwrap()))
            .collect()
    }

    /// The model as a reader sees it that opens the single file if there is one, else the index
    /// (transformers' order), or the index first (`index_first`, as some scripts do): every
    /// shard the index names, each holding exactly the tensors mapped to it. `None` if neither
    /// file is there.
    fn read_model(dir: &Path, index_first: bool) -> Option<Values> {
        let single = dir.join(MODEL_FILE);
        let index = dir.join(MODEL_INDEX_FILE);
        let use_index = index.exists() && (index_first || !single.exists());
        if !use_index {
            return single.exists().then(|| load_file(&single));
        }
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&index).unwrap()).unwrap();
        let map = index["weight_map"].as_object().unwrap();
        let mut all = Values::new();
        let shards: std::collections::BTreeSet<&str> =
            map.values().map(|v| v.as_str().unwrap()).collect();
        for shard in shards {
            for (name, v) in load_file(&dir.join(shard)) {
                assert_eq!(
                    map[&name], shard,
                    "{name} is not in the shard the index names"
                );
                all.insert(name, v);
            }
        }
        assert_eq!(
            all.len(),
            map.len(),
            "the index names tensors no shard holds"
        );
        Some(all)
    }

    /// The model files in `dir`, sorted.
    fn model_files(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("safetensors"))
            .collect();
        v.sort();
        v
    }

    /// Re-saving over every layout (one file, 2 or 3 shards, to one file or shards), stopped as
    /// a crash would stop it after each of its changes on disk: both kinds of reader then load
    /// the whole previous model or the whole new one, never a mix; finished (or done again after
    /// the stop), only the new set is left, and the directory's other files are untouched.
    #[test]
    fn a_resave_stopped_at_any_point_leaves_the_old_or_the_new_model_whole() {
        // 1000 bytes: one file; 32: [a.bias a.weight] [b.weight]; 12: three shards.
        let layouts = [1000u64, 32, 12];
        let (old, new) = (three(0.0), three(100.0));
        let (old_values, new_values) = (values_of(&old), values_of(&new));
        for from in layouts {
            for to in layouts {
                for stop_at in 0.. {
                    let dir = tempfile::tempdir().unwrap();
                    save_model(&old, dir.path(), from).unwrap();
                    std::fs::write(dir.path().join("trainer_state.json"), b"{}").unwrap();
                    let mut steps = 0;
                    let done = save_model_steps(&new, dir.path(), to, &mut || {
                        if steps == stop_at {
                            return Err(Error::Config("stopped".into()));
                        }
                        steps += 1;
                        Ok(())
                    });
                    let case = format!("{from} -> {to} bytes per shard, stopped after {stop_at}");
                    for index_first in [false, true] {
                        let seen = read_model(dir.path(), index_first)
                            .unwrap_or_else(|| panic!("{case}: no model at all"));
                        assert!(
                            seen == old_values || seen == new_values,
                            "{case}: a reader (index first: {index_first}) loads a mix of the \
                             two saves: {seen:?}; files: {:?}",
                            model_files(dir.path())
                        );
                    }
                    let finished = done.is_ok();
                    if !finished {
                        save_model(&new, dir.path(), to).unwrap();
                    }
                    for index_first in [false, true] {
                        assert_eq!(
                            read_model(dir.path(), index_first).as_ref(),
                            Some(&new_values),
                            "{case}, then finished"
                        );
                    }
                    let files = model_files(dir.path());
                    if to == 1000 {
                        assert_eq!(files, [MODEL_FILE], "{case}: stale files");
                    } else {
                        let index: serde_json::Value = serde_json::from_slice(
                            &std::fs::read(dir.path().join(MODEL_INDEX_FILE)).unwrap(),
                        )
                        .unwrap();
                        let mut named: Vec<String> = index["weight_map"]
                            .as_object()
                            .unwrap()
                            .values()
                            .map(|v| v.as_str().unwrap().to_string())
                            .chain([MODEL_INDEX_FILE.to_string()])
                            .collect();
                        named.sort();
                        named.dedup();
                        assert_eq!(files, named, "{case}: stale files");
                    }
                    assert_eq!(
                        std::fs::read(dir.path().join("trainer_state.json")).unwrap(),
                        b"{}"
                    );
                    if finished {
                        break;
                    }
                }
            }
        }
    }
}
