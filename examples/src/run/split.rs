//! The held-out evaluation split (`--eval-fraction`): a share of a dataset's items, picked by a
//! seeded permutation so that every rank picks the same ones, set aside from training.

use std::sync::Arc;

use accelerate_core::data::{shuffled_indices, Dataset};
use anyhow::{bail, Result};

/// Mixed into the seed of the split's permutation, so that it is not the permutation of the
/// training loader's first epoch (which a loader seeded with the same seed draws).
const SPLIT_SALT: u64 = 0x000E_7A15_B117;

/// The items of a dataset at `indices`, in that order: one side of a [`hold_out`] split.
#[derive(Debug)]
pub struct Subset<D> {
    dataset: Arc<D>,
    indices: Vec<usize>,
}

impl<D: Dataset> Subset<D> {
    /// Every item of `dataset`, in order: a split given whole (a --validation-file).
    pub fn whole(dataset: D) -> Self {
        Self {
            indices: (0..dataset.len()).collect(),
            dataset: Arc::new(dataset),
        }
    }
}

impl<D> Subset<D> {
    /// The indices, in the whole dataset, of this subset's items.
    pub fn indices(&self) -> &[usize] {
        &self.indices
    }

    /// The whole dataset this subset is taken from.
    pub fn dataset(&self) -> &Arc<D> {
        &self.dataset
    }

    /// Keeps only the items whose index in the whole dataset passes `keep`.
    pub fn retain(&mut self, keep: impl FnMut(&usize) -> bool) {
        self.indices.retain(keep);
    }
}

impl<D: Dataset> Dataset for Subset<D> {
    type Item = D::Item;
    type Batch = D::Batch;

    fn len(&self) -> usize {
        self.indices.len()
    }

    fn get(&self, index: usize) -> accelerate_core::Result<D::Item> {
        let &inner = self.indices.get(index).ok_or_else(|| {
            accelerate_core::Error::Data(format!(
                "item {index} requested from a split of {} items",
                self.indices.len()
            ))
        })?;
        self.dataset.get(inner)
    }

    fn collate(&self, items: Vec<D::Item>) -> accelerate_core::Result<D::Batch> {
        self.dataset.collate(items)
    }

    /// The whole dataset's batch of the mapped indices (its own `get_batch`, which may gather
    /// rows at once rather than item by item).
    fn get_batch(&self, indices: &[usize]) -> accelerate_core::Result<D::Batch> {
        let inner = indices
            .iter()
            .map(|&i| {
                self.indices.get(i).copied().ok_or_else(|| {
                    accelerate_core::Error::Data(format!(
                        "item {i} requested from a split of {} items",
                        self.indices.len()
                    ))
                })
            })
            .collect::<accelerate_core::Result<Vec<usize>>>()?;
        self.dataset.get_batch(&inner)
    }
}

/// The indices of the training and the evaluation items of a dataset of `len` items when
/// `fraction` of them are held out (rounded to the nearest item) with `seed`: the first ones of
/// a seeded permutation are held out; both lists are in ascending order, so with `fraction` 0
/// the training side is the whole dataset in its order. `unit` names the items in errors
/// ("samples", "windows", "rows").
pub fn split_indices(
    len: usize,
    fraction: f64,
    seed: u64,
    unit: &str,
) -> Result<(Vec<usize>, Vec<usize>)> {
    if !(0.0..1.0).contains(&fraction) {
        bail!("--eval-fraction must be in [0, 1), got {fraction}");
    }
    if fraction == 0.0 {
        return Ok(((0..len).collect(), Vec::new()));
    }
    let held_out = (fraction * len as f64).round() as usize;
    if held_out == 0 {
        bail!(
            "--eval-fraction {fraction} of {len} {unit} holds out none (the split would be \
             empty): raise --eval-fraction to at least {:.3}, or use more data",
            0.5 / len.max(1) as f64
        );
    }
    if held_out >= len {
        bail!(
            "--eval-fraction {fraction} of {len} {unit} holds out all of them and leaves none to \
             train on: lower --eval-fraction, or use more data"
        );
    }
    let order = shuffled_indices(len, seed ^ SPLIT_SALT, 0);
    let mut eval = order[..held_out].to_vec();
    let mut train = order[held_out..].to_vec();
    eval.sort_unstable();
    train.sort_unstable();
    Ok((train, eval))
}

/// Splits `dataset` into its training items and, when `fraction` > 0, its held-out evaluation
/// items (see [`split_indices`]).
pub fn hold_out<D: Dataset>(
    dataset: D,
    fraction: f64,
    seed: u64,
    unit: &str,
) -> Result<(Subset<D>, Option<Subset<D>>)> {
    let (train, eval) = split_indices(dataset.len(), fraction, seed, unit)?;
    let dataset = Arc::new(dataset);
    let eval = (!eval.is_empty()).then(|| Subset {
        dataset: dataset.clone(),
        indices: eval,
    });
    Ok((
        Subset {
            dataset,
            indices: train,
        },
        eval,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_split_is_seeded_disjoint_and_covers_the_dataset() {
        let (train, eval) = split_indices(100, 0.1, 7, "samples").unwrap();
        assert_eq!((train.len(), eval.len()), (90, 10));
        let mut all = [train.clone(), eval.clone()].concat();
        all.sort_unstable();
        assert_eq!(all, (0..100).collect::<Vec<_>>());
        assert_eq!(split_indices(100, 0.1, 7, "samples").unwrap().1, eval);
        assert_ne!(split_indices(100, 0.1, 8, "samples").unwrap().1, eval);
        // Not simply the first or last items.
        assert_ne!(eval, (0..10).collect::<Vec<_>>());
        assert_ne!(eval, (90..100).collect::<Vec<_>>());
        assert_eq!(
            split_indices(5, 0.0, 7, "samples").unwrap(),
            ((0..5).collect(), vec![])
        );
    }

    #[test]
    fn empty_sides_are_refused_naming_the_flag() {
        let e = split_indices(4, 0.1, 0, "windows").unwrap_err().to_string();
        assert!(
            e.contains("--eval-fraction 0.1 of 4 windows holds out none"),
            "{e}"
        );
        let e = split_indices(4, 0.9, 0, "rows").unwrap_err().to_string();
        assert!(e.contains("leaves none to train on"), "{e}");
    }
}
