//! The settings of a prepared data loader that must be equal on every rank, and the message that
//! names those that are not.
//!
//! Every rank computes its own shard of the same global batch list, and its accumulation windows
//! from its own batch count. If the ranks' loaders disagree on anything that shapes that list (the
//! dataset's length, the batch size, shuffle, seed, drop_last) or on K, the ranks mix batches of
//! different windows into one all-reduce and finally wait for a collective that one of them never
//! issues. The accelerator compares these settings across ranks when a loader is prepared, as it
//! does for the parameters, and refuses with [`LoaderSettings::differences`].

use serde::{Deserialize, Serialize};

use super::plan::BatchPlan;
use crate::comm::store::Store;
use crate::error::{Error, Result};

/// What decides which batches, and so which accumulation windows, a rank gets in each epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderSettings {
    /// Number of samples in the dataset.
    pub dataset_len: usize,
    /// Samples per batch, per rank.
    pub batch_size: usize,
    /// Whether each epoch's order is a seeded permutation.
    pub shuffle: bool,
    /// Seed of that permutation.
    pub seed: u64,
    /// Whether a final partial batch (and an incomplete last round) is dropped.
    pub drop_last: bool,
    /// Micro-steps per accumulation window (K) of the accelerator the loader is prepared on.
    pub gradient_accumulation_steps: usize,
}

impl LoaderSettings {
    /// The settings of a loader following `plan`, trained with K = `gradient_accumulation_steps`.
    pub fn new(plan: &BatchPlan, gradient_accumulation_steps: usize) -> Self {
        Self {
            dataset_len: plan.len(),
            batch_size: plan.batch_size(),
            shuffle: plan.shuffle(),
            seed: plan.seed(),
            drop_last: plan.drop_last(),
            gradient_accumulation_steps,
        }
    }

    /// The settings as `(name, value)` pairs, in declaration order.
    fn fields(&self) -> Vec<(&'static str, String)> {
        vec![
            ("dataset length", self.dataset_len.to_string()),
            ("batch size", self.batch_size.to_string()),
            ("shuffle", self.shuffle.to_string()),
            ("seed", self.seed.to_string()),
            ("drop_last", self.drop_last.to_string()),
            (
                "gradient accumulation steps",
                self.gradient_accumulation_steps.to_string(),
            ),
        ]
    }

    /// `None` if every rank's settings (`per_rank[r]` is rank r's) are equal; otherwise a message
    /// naming each differing setting with its value on each rank, and the fix. Every rank that
    /// reads the same `per_rank` gets the same message. `which` names the loader (e.g. "data
    /// loader #1").
    pub fn differences(which: &str, per_rank: &[LoaderSettings]) -> Option<String> {
        let first = per_rank.first()?;
        if per_rank.iter().all(|s| s == first) {
            return None;
        }
        let fields: Vec<_> = per_rank.iter().map(LoaderSettings::fields).collect();
        let mut differing = Vec::new();
        for (i, (name, _)) in fields[0].iter().enumerate() {
            // Each distinct value with the ranks that have it, in order of first appearance.
            let mut values: Vec<(&str, Vec<usize>)> = Vec::new();
            for (rank, f) in fields.iter().enumerate() {
                let value = f[i].1.as_str();
                match values.iter_mut().find(|(v, _)| *v == value) {
                    Some((_, ranks)) => ranks.push(rank),
                    None => values.push((value, vec![rank])),
                }
            }
            if values.len() > 1 {
                let described: Vec<String> = values
                    .iter()
                    .map(|(value, ranks)| format!("{value} ({})", rank_list(ranks)))
                    .collect();
                differing.push(format!("{name} is {}", described.join(" vs ")));
            }
        }
        Some(format!(
            "the {which} differs between the ranks: {}. Every rank deals its batches from the \
             same global list and syncs gradients at the same windows, so these must be equal \
             everywhere, or the ranks average gradients of different windows and end up waiting \
             for each other; build every rank's DataLoader from the same dataset with the same \
             batch size, shuffle, seed and drop_last, and give every rank the same gradient \
             accumulation steps",
            differing.join("; ")
        ))
    }
}

impl LoaderSettings {
    /// Compares these settings, of this rank's `index`-th prepared loader, with every other
    /// rank's through the store; every rank reports the same differences (an error naming each
    /// differing setting with its value on each rank).
    pub(crate) fn check_same_everywhere(
        &self,
        store: &dyn Store,
        index: usize,
        (rank, world_size): (usize, usize),
    ) -> Result<()> {
        let key = |r: usize| format!("accelerate/loaders/{index}/{r}");
        let encoded = serde_json::to_vec(self)
            .map_err(|e| Error::Data(format!("cannot encode the data loader's settings: {e}")))?;
        store.set(&key(rank), &encoded)?;
        let timeout = crate::comm::cpu::CpuCommOptions::from_env()?.timeout;
        let per_rank = (0..world_size)
            .map(|r| {
                let bytes = store.get(&key(r), timeout)?;
                serde_json::from_slice(&bytes).map_err(|e| {
                    Error::Data(format!(
                        "rank {r} published unreadable data loader settings ({e}); every rank \
                         must run the same build of the program"
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let which = format!("data loader #{} (in order of preparation)", index + 1);
        match Self::differences(&which, &per_rank) {
            Some(message) => Err(Error::Config(message)),
            None => Ok(()),
        }
    }
}

/// "rank 1", or "ranks 0, 2".
fn rank_list(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    let noun = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{noun} {}", list.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(dataset_len: usize, seed: u64) -> LoaderSettings {
        LoaderSettings {
            dataset_len,
            batch_size: 4,
            shuffle: true,
            seed,
            drop_last: false,
            gradient_accumulation_steps: 2,
        }
    }

    #[test]
    fn equal_settings_pass_and_each_difference_is_named_with_its_ranks() {
        let same = vec![settings(100, 1); 3];
        assert_eq!(LoaderSettings::differences("data loader #1", &same), None);
        let mixed = [settings(100, 1), settings(90, 1), settings(100, 7)];
        let message = LoaderSettings::differences("data loader #1", &mixed).unwrap();
        assert!(
            message.starts_with(
                "the data loader #1 differs between the ranks: dataset length is 100 (ranks 0, \
                 2) vs 90 (rank 1); seed is 1 (ranks 0, 1) vs 7 (rank 2). "
            ),
            "{message}"
        );
        assert!(!message.contains("batch size is"), "{message}");
        assert!(
            message.contains("same batch size, shuffle, seed"),
            "{message}"
        );
    }
}
