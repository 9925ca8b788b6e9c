//! Re-cutting a saved optimizer state to this run's layout: full tensors (ZeRO stage 0) or this
//! rank's pieces of its own partition (stages 1 and 2), whatever stage and world size saved it.
//!
//! A stage-0 checkpoint holds each state tensor whole: a piece is cut from it. A sharded one holds
//! each rank's pieces (listed in the manifest's [`ZeroEntry`]): the range this run needs of each
//! parameter is assembled from the saved pieces that overlap it, reading one rank's file at a
//! time, so the host holds one shard file (and what is kept of it) rather than the whole state.
//! This one function gives stage 0 → 1/2, 1/2 → 0, 1 ↔ 2, and N → M ranks.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use candle_core::{Tensor, Var};

use super::manifest::ZeroEntry;
use crate::error::{Error, Result};

/// What a checkpoint holds of one optimizer's tensors.
pub(crate) enum SavedTensors<'a> {
    /// Every state tensor whole, as a stage-0 run saves them (`optimizer_<i>.safetensors`).
    Full(BTreeMap<String, Tensor>),
    /// Pieces: which rank saved which (the manifest's entry), and how to read rank `r`'s file.
    Pieces {
        zero: &'a ZeroEntry,
        read: &'a mut dyn FnMut(usize) -> Result<BTreeMap<String, Tensor>>,
    },
}

fn problem(path: &Path, problem: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// The parameter a state key `"<what>.<param>"` belongs to (an index into `params`): the first
/// split after which the rest is a parameter's name (parameter names hold dots themselves).
fn param_of(key: &str, params: &[(String, Var)]) -> Option<usize> {
    key.match_indices('.').find_map(|(i, _)| {
        let name = &key[i + 1..];
        params.iter().position(|(n, _)| n == name)
    })
}

/// The state tensors this rank's optimizer loads, cut from `saved` for `target`: `None` for full
/// tensors of each parameter's shape (stage 0), or each parameter's piece on this rank (`None`
/// where it owns none; stages 1 and 2), as 1-D tensors. `path` names the checkpoint in errors.
/// A needed range that no saved piece covers is an error naming the parameter.
pub(crate) fn optimizer_tensors_for(
    path: &Path,
    saved: SavedTensors<'_>,
    params: &[(String, Var)],
    target: Option<&[Option<Range<usize>>]>,
) -> Result<BTreeMap<String, Tensor>> {
    let needed = |p: usize| -> Option<Range<usize>> {
        match target {
            None => Some(0..params[p].1.elem_count()),
            Some(pieces) => pieces[p].clone(),
        }
    };
    let find = |key: &str| {
        param_of(key, params).ok_or_else(|| {
            problem(
                path,
                format!(
                    "holds optimizer state {key:?} of no parameter of this model; resume with \
                     the model that saved it"
                ),
            )
        })
    };
    match saved {
        // The same layout as saved: loaded as it is (the optimizer checks the shapes).
        SavedTensors::Full(tensors) if target.is_none() => Ok(tensors),
        SavedTensors::Full(tensors) => {
            let mut out = BTreeMap::new();
            for (key, t) in tensors {
                let p = find(&key)?;
                let Some(range) = needed(p) else { continue };
                let (name, var) = &params[p];
                if t.elem_count() != var.elem_count() {
                    return Err(problem(
                        path,
                        format!(
                            "optimizer state {key:?} has shape {:?} but parameter {name:?} has \
                             shape {:?}; resume with the model that saved it",
                            t.dims(),
                            var.dims()
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
            assemble(path, zero, read, params, target.is_none(), &needed, &find)
        }
    }
}

/// The needed range of every state tensor, from the saved pieces that overlap it.
fn assemble(
    path: &Path,
    zero: &ZeroEntry,
    read: &mut dyn FnMut(usize) -> Result<BTreeMap<String, Tensor>>,
    params: &[(String, Var)],
    full: bool,
    needed: &dyn Fn(usize) -> Option<Range<usize>>,
    find: &dyn Fn(&str) -> Result<usize>,
) -> Result<BTreeMap<String, Tensor>> {
    let overlap = |a: &Range<usize>, b: &Range<usize>| a.start.max(b.start)..a.end.min(b.end);
    // Per state key: the slices kept, by their first element in the parameter.
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
                            "lists a ZeRO piece of {:?}, which is not a parameter of this model",
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
                        "rank {rank}'s optimizer file holds {key:?} but the manifest lists no \
                         piece of {name:?} for rank {rank}; the checkpoint is corrupt"
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
        let (name, var) = &params[p];
        let need = needed(p).expect("only needed parameters have slices");
        slices.sort_by_key(|(start, _)| *start);
        let mut at = need.start;
        for (start, t) in &slices {
            if *start != at {
                return Err(uncovered(path, &key, name, at, *start));
            }
            at += t.elem_count();
        }
        if at != need.end {
            return Err(uncovered(path, &key, name, at, need.end));
        }
        let tensors: Vec<Tensor> = slices.into_iter().map(|(_, t)| t).collect();
        let joined = Tensor::cat(&tensors, 0)?;
        out.insert(
            key,
            if full {
                joined.reshape(var.shape())?
            } else {
                joined
            },
        );
    }
    Ok(out)
}

fn uncovered(path: &Path, key: &str, name: &str, from: usize, to: usize) -> Error {
    problem(
        path,
        format!(
            "optimizer state {key:?} of parameter {name:?}: elements {from}..{to} are in no \
             rank's saved piece (or in two); the checkpoint is incomplete or corrupt"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::manifest::PieceEntry;
    use candle_core::Device;

    fn params() -> Vec<(String, Var)> {
        vec![
            (
                "a.w".into(),
                Var::zeros((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap(),
            ),
            (
                "b".into(),
                Var::zeros(4, candle_core::DType::F32, &Device::Cpu).unwrap(),
            ),
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
        let out = optimizer_tensors_for(
            Path::new("ckpt"),
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
        let out = optimizer_tensors_for(
            Path::new("ckpt"),
            SavedTensors::Full(full.clone()),
            &params(),
            Some(&target),
        )
        .unwrap();
        assert_eq!(values(&out, "exp_avg.a.w"), (vec![4], vec![2., 3., 4., 5.]));
        assert!(!out.contains_key("exp_avg.b"));
        let out =
            optimizer_tensors_for(Path::new("ckpt"), SavedTensors::Full(full), &params(), None)
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
}
