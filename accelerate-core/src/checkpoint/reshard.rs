//! Re-cutting saved tensors to this run's layout: an optimizer's state, or under ZeRO stage 3 the
//! parameters themselves, as full tensors (stage 0, or parameters at stages 1 and 2) or this
//! rank's pieces of its own partition (stages 1 to 3), whatever stage and world size saved them.
//!
//! A stage-0 checkpoint holds each tensor whole (so does a stage-3 one whose parameters were
//! gathered): a piece is cut from it. A sharded one holds each rank's pieces (listed in the
//! manifest's [`ZeroEntry`]): the range this run needs of each parameter is assembled from the
//! saved pieces that overlap it, reading one rank's file at a time, so the host holds one shard
//! file (and what is kept of it) rather than the whole state. This one function gives
//! stage 0 → 1/2/3, 1/2/3 → 0, every stage to every other, and N → M ranks.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use candle_core::{Shape, Tensor};

use super::manifest::ZeroEntry;
use crate::error::{Error, Result};

/// What a checkpoint holds of one set of tensors (an optimizer's state, or the parameters).
pub(crate) enum SavedTensors<'a> {
    /// Every tensor whole, as a stage-0 run saves them (`optimizer_<i>.safetensors`,
    /// `model.safetensors`).
    Full(BTreeMap<String, Tensor>),
    /// Pieces: which rank saved which (the manifest's entry), and how to read rank `r`'s file.
    Pieces {
        zero: &'a ZeroEntry,
        read: &'a mut dyn FnMut(usize) -> Result<BTreeMap<String, Tensor>>,
    },
}

/// How saved tensors are named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keys {
    /// An optimizer's state: `"<what>.<param>"`.
    OptimizerState,
    /// The parameters, each by its name.
    Parameters,
}

impl Keys {
    /// The parameter `key` belongs to (an index into `params`). An optimizer state's key is
    /// split after the first dot after which the rest is a parameter's name (parameter names
    /// hold dots themselves).
    fn param_of(self, key: &str, params: &[(String, Shape)]) -> Option<usize> {
        match self {
            Self::OptimizerState => key.match_indices('.').find_map(|(i, _)| {
                let name = &key[i + 1..];
                params.iter().position(|(n, _)| n == name)
            }),
            Self::Parameters => params.iter().position(|(n, _)| n == key),
        }
    }

    /// What one tensor is, in messages.
    fn noun(self) -> &'static str {
        match self {
            Self::OptimizerState => "optimizer state",
            Self::Parameters => "parameter",
        }
    }

    /// What one rank's file is, in messages.
    fn file(self) -> &'static str {
        match self {
            Self::OptimizerState => "optimizer file",
            Self::Parameters => "parameter file",
        }
    }
}

fn problem(path: &Path, problem: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// The tensors this rank loads, cut from `saved` (named as `keys` says) for `target`: `None` for
/// full tensors of each parameter's shape, or each parameter's piece on this rank (`None` where
/// it owns none), as 1-D tensors. `params` are the model's parameters, whole (names and shapes,
/// sorted by name); `path` names the checkpoint in errors. A needed range that no saved piece
/// covers is an error naming the parameter.
pub(crate) fn tensors_for(
    path: &Path,
    keys: Keys,
    saved: SavedTensors<'_>,
    params: &[(String, Shape)],
    target: Option<&[Option<Range<usize>>]>,
) -> Result<BTreeMap<String, Tensor>> {
    let needed = |p: usize| -> Option<Range<usize>> {
        match target {
            None => Some(0..params[p].1.elem_count()),
            Some(pieces) => pieces[p].clone(),
        }
    };
    let find = |key: &str| {
        keys.param_of(key, params).ok_or_else(|| {
            problem(
                path,
                format!(
                    "holds {} {key:?} of no parameter of this model; resume with the model that \
                     saved it",
                    keys.noun()
                ),
            )
        })
    };
    match saved {
        // The same layout as saved: loaded as it is (the optimizer, or the load, checks shapes).
        SavedTensors::Full(tensors) if target.is_none() => Ok(tensors),
        SavedTensors::Full(tensors) => {
            let mut out = BTreeMap::new();
            for (key, t) in tensors {
                let p = find(&key)?;
                let Some(range) = needed(p) else { continue };
                let (name, shape) = &params[p];
                if t.elem_count() != shape.elem_count() {
                    return Err(problem(
                        path,
                        format!(
                            "{} {key:?} has shape {:?} but parameter {name:?} has shape {:?}; \
                             resume with the model that saved it",
                            keys.noun(),
                            t.dims(),
                            shape.dims()
                        ),
                    ));
                }
                let piece = t
                    .flatten_all()?
                    .narrow(0, range.start, range.len())?
                    .force_contiguous()?;
                out.insert(key, piece);
            }
            Ok(out)
        }
        SavedTensors::Pieces { zero, read } => {
            let cut = Cut {
                path,
                keys,
                params,
                full: target.is_none(),
            };
            cut.assemble(zero, read, &needed, &find)
        }
    }
}

/// What [`tensors_for`] assembles from pieces.
struct Cut<'a> {
    path: &'a Path,
    keys: Keys,
    params: &'a [(String, Shape)],
    /// Whether whole tensors are wanted (reshaped to the parameters' shapes).
    full: bool,
}

impl Cut<'_> {
    /// The needed range of every tensor, from the saved pieces that overlap it.
    fn assemble(
        &self,
        zero: &ZeroEntry,
        read: &mut dyn FnMut(usize) -> Result<BTreeMap<String, Tensor>>,
        needed: &dyn Fn(usize) -> Option<Range<usize>>,
        find: &dyn Fn(&str) -> Result<usize>,
    ) -> Result<BTreeMap<String, Tensor>> {
        let (path, params) = (self.path, self.params);
        let overlap = |a: &Range<usize>, b: &Range<usize>| a.start.max(b.start)..a.end.min(b.end);
        // Per key: the slices kept, by their first element in the parameter.
        let mut parts: BTreeMap<String, Vec<(usize, Tensor)>> = BTreeMap::new();
        for (rank, pieces) in zero.pieces.iter().enumerate() {
            let mut wanted = false;
            for entry in pieces {
                let p = params
                    .iter()
                    .position(|(n, _)| *n == entry.param)
                    .ok_or_else(|| {
                        problem(
                            path,
                            format!(
                                "lists a ZeRO piece of {:?}, which is not a parameter of this \
                                 model",
                                entry.param
                            ),
                        )
                    })?;
                let saved = entry.start as usize..(entry.start + entry.len) as usize;
                wanted |= needed(p).is_some_and(|n| !overlap(&n, &saved).is_empty());
            }
            if !wanted {
                continue;
            }
            for (key, t) in read(rank)? {
                let p = find(&key)?;
                let name = &params[p].0;
                let saved = zero.piece(rank, name).ok_or_else(|| {
                    problem(
                        path,
                        format!(
                            "rank {rank}'s {} holds {key:?} but the manifest lists no piece of \
                             {name:?} for rank {rank}; the checkpoint is corrupt",
                            self.keys.file()
                        ),
                    )
                })?;
                if t.dims() != [saved.len()] {
                    return Err(problem(
                        path,
                        format!(
                            "rank {rank}'s {key:?} has shape {:?} but its piece of {name:?} is \
                             elements {saved:?}; the checkpoint is corrupt",
                            t.dims()
                        ),
                    ));
                }
                let Some(need) = needed(p) else { continue };
                let keep = overlap(&need, &saved);
                if keep.is_empty() {
                    continue;
                }
                let slice = t
                    .narrow(0, keep.start - saved.start, keep.len())?
                    .force_contiguous()?;
                parts.entry(key).or_default().push((keep.start, slice));
            }
        }
        let mut out = BTreeMap::new();
        for (key, mut slices) in parts {
            let p = find(&key)?;
            let (name, shape) = &params[p];
            let need = needed(p).expect("only needed parameters have slices");
            slices.sort_by_key(|(start, _)| *start);
            let mut at = need.start;
            for (start, t) in &slices {
                if *start != at {
                    return Err(self.uncovered(&key, name, at, *start));
                }
                at += t.elem_count();
            }
            if at != need.end {
                return Err(self.uncovered(&key, name, at, need.end));
            }
            let tensors: Vec<Tensor> = slices.into_iter().map(|(_, t)| t).collect();
            let joined = Tensor::cat(&tensors, 0)?;
            out.insert(
                key,
                if self.full {
                    joined.reshape(shape)?
                } else {
                    joined
                },
            );
        }
        Ok(out)
    }

    fn uncovered(&self, key: &str, name: &str, from: usize, to: usize) -> Error {
        let what = match self.keys {
            Keys::OptimizerState => format!("optimizer state {key:?} of parameter {name:?}"),
            Keys::Parameters => format!("parameter {name:?}"),
        };
        problem(
            self.path,
            format!(
                "{what}: elements {from}..{to} are in no rank's saved piece (or in two); the \
                 checkpoint is incomplete or corrupt"
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::manifest::PieceEntry;
    use candle_core::Device;

    fn params() -> Vec<(String, Shape)> {
        vec![
            ("a.w".into(), Shape::from((2, 3))),
            ("b".into(), Shape::from(4)),
        ]
    }

    fn t(v: &[f32]) -> Tensor {
        Tensor::new(v, &Device::Cpu).unwrap()
    }

    fn piece(param: &str, start: u64, len: u64) -> PieceEntry {
        PieceEntry {
            param: param.into(),
            start,
            len,
        }
    }

    /// Two ranks: rank 0 holds a.w[0..4], rank 1 a.w[4..6] and b[0..4]; values are the element's
    /// index (+ 10 for b), so every assembled tensor is written out below.
    fn saved_by_two() -> (ZeroEntry, Vec<BTreeMap<String, Tensor>>) {
        let zero = ZeroEntry {
            stage: 1,
            world_size: 2,
            pieces: vec![
                vec![piece("a.w", 0, 4)],
                vec![piece("a.w", 4, 2), piece("b", 0, 4)],
            ],
            sharded_parameters: false,
        };
        let files = vec![
            BTreeMap::from([("exp_avg.a.w".to_string(), t(&[0., 1., 2., 3.]))]),
            BTreeMap::from([
                ("exp_avg.a.w".to_string(), t(&[4., 5.])),
                ("exp_avg.b".to_string(), t(&[10., 11., 12., 13.])),
            ]),
        ];
        (zero, files)
    }

    fn cut(
        zero: &ZeroEntry,
        files: &[BTreeMap<String, Tensor>],
        target: Option<&[Option<Range<usize>>]>,
    ) -> (Result<BTreeMap<String, Tensor>>, Vec<usize>) {
        let mut opened = Vec::new();
        let mut read = |r: usize| {
            opened.push(r);
            Ok(files[r].clone())
        };
        let out = tensors_for(
            Path::new("ckpt"),
            Keys::OptimizerState,
            SavedTensors::Pieces {
                zero,
                read: &mut read,
            },
            &params(),
            target,
        );
        (out, opened)
    }

    fn values(m: &BTreeMap<String, Tensor>, k: &str) -> (Vec<usize>, Vec<f32>) {
        let t = &m[k];
        (
            t.dims().to_vec(),
            t.flatten_all().unwrap().to_vec1().unwrap(),
        )
    }

    #[test]
    fn pieces_assemble_into_full_tensors_of_the_parameters_shapes() {
        let (zero, files) = saved_by_two();
        let (out, _) = cut(&zero, &files, None);
        let out = out.unwrap();
        assert_eq!(
            values(&out, "exp_avg.a.w"),
            (vec![2, 3], vec![0., 1., 2., 3., 4., 5.])
        );
        assert_eq!(
            values(&out, "exp_avg.b"),
            (vec![4], vec![10., 11., 12., 13.])
        );
    }

    /// Three ranks' pieces cut from two ranks' (2 → 3): each range spans the saved boundary or
    /// lies inside one file, and a rank reads only the files it needs.
    #[test]
    fn pieces_are_recut_for_another_partition() {
        let (zero, files) = saved_by_two();
        let target = [Some(3..5), Some(1..3)];
        let (out, opened) = cut(&zero, &files, Some(&target));
        let out = out.unwrap();
        assert_eq!(values(&out, "exp_avg.a.w"), (vec![2], vec![3., 4.]));
        assert_eq!(values(&out, "exp_avg.b"), (vec![2], vec![11., 12.]));
        assert_eq!(opened, vec![0, 1]);
        let target = [None, Some(0..4)];
        let (out, opened) = cut(&zero, &files, Some(&target));
        let out = out.unwrap();
        assert_eq!(opened, vec![1], "rank 0's file holds nothing needed");
        assert!(!out.contains_key("exp_avg.a.w"));
        let target = [None, None];
        let (out, opened) = cut(&zero, &files, Some(&target));
        assert!(out.unwrap().is_empty() && opened.is_empty());
    }

    #[test]
    fn full_tensors_are_cut_into_pieces_or_passed_through() {
        let full = BTreeMap::from([
            (
                "exp_avg.a.w".to_string(),
                t(&[0., 1., 2., 3., 4., 5.]).reshape((2, 3)).unwrap(),
            ),
            ("exp_avg.b".to_string(), t(&[10., 11., 12., 13.])),
        ]);
        let target = [Some(2..6), None];
        let out = tensors_for(
            Path::new("ckpt"),
            Keys::OptimizerState,
            SavedTensors::Full(full.clone()),
            &params(),
            Some(&target),
        )
        .unwrap();
        assert_eq!(values(&out, "exp_avg.a.w"), (vec![4], vec![2., 3., 4., 5.]));
        assert!(!out.contains_key("exp_avg.b"));
        let out = tensors_for(
            Path::new("ckpt"),
            Keys::OptimizerState,
            SavedTensors::Full(full),
            &params(),
            None,
        )
        .unwrap();
        assert_eq!(values(&out, "exp_avg.a.w").0, vec![2, 3]);
    }

    /// A piece missing from the manifest (rank 1 lost its part of a.w) leaves a gap: refused,
    /// naming the parameter and the elements.
    #[test]
    fn an_uncovered_range_is_refused_naming_the_parameter() {
        let (mut zero, mut files) = saved_by_two();
        zero.pieces[1].remove(0);
        files[1].remove("exp_avg.a.w");
        let (out, _) = cut(&zero, &files, None);
        let err = out.unwrap_err().to_string();
        assert!(
            err.contains("\"a.w\"") && err.contains("elements 4..6"),
            "{err}"
        );
    }

    /// Parameters saved as pieces (ZeRO stage 3) are named by the parameter alone, "a.w" whole
    /// (not state "a" of a parameter "w"): assembled whole for stage 0, and re-cut for another
    /// partition, each value landing where its element index says.
    #[test]
    fn parameter_pieces_are_named_by_the_parameter() {
        let (zero, files) = saved_by_two();
        let files: Vec<BTreeMap<String, Tensor>> = files
            .into_iter()
            .map(|f| {
                f.into_iter()
                    .map(|(k, t)| (k.trim_start_matches("exp_avg.").to_string(), t))
                    .collect()
            })
            .collect();
        let load = |target: Option<&[Option<Range<usize>>]>| {
            let mut read = |r: usize| Ok(files[r].clone());
            tensors_for(
                Path::new("ckpt"),
                Keys::Parameters,
                SavedTensors::Pieces {
                    zero: &zero,
                    read: &mut read,
                },
                &params(),
                target,
            )
            .unwrap()
        };
        let whole = load(None);
        assert_eq!(
            values(&whole, "a.w"),
            (vec![2, 3], vec![0., 1., 2., 3., 4., 5.])
        );
        assert_eq!(values(&whole, "b"), (vec![4], vec![10., 11., 12., 13.]));
        let target = [Some(1..5), Some(3..4)];
        let cut = load(Some(&target));
        assert_eq!(values(&cut, "a.w"), (vec![4], vec![1., 2., 3., 4.]));
        assert_eq!(values(&cut, "b"), (vec![1], vec![13.]));
        let err = tensors_for(
            Path::new("ckpt"),
            Keys::OptimizerState,
            SavedTensors::Full(files[1].clone()),
            &params(),
            Some(&target),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("of no parameter of this model"), "{err}");
    }
}
