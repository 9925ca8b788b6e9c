//! The held-out split of `--validation-split-percentage`, as run_clm.py makes it: the first
//! `N%` of the documents are the validation set (`train[:N%]`) and the rest the training set
//! (`train[N%:]`), over the documents in corpus order. Deterministic, and the same on every rank.

use std::ops::Range;

use crate::corpus::Corpus;
use crate::error::{Error, Result};

/// The document ranges `(validation, train)` of a corpus of `documents` documents with
/// `percentage` percent held out: the boundary is `percentage × documents / 100` rounded to the
/// nearest document, ties to even (`datasets`' "closest" rounding of percent slices, which
/// run_clm.py's `train[:N%]` uses). Refuses a percentage outside 1..=99 and a split that leaves
/// either side empty.
pub fn validation_split(documents: usize, percentage: u32) -> Result<(Range<usize>, Range<usize>)> {
    if !(1..=99).contains(&percentage) {
        return Err(Error::Text(format!(
            "--validation-split-percentage {percentage} is not in 1..=99; it is the percentage \
             of the documents held out for evaluation"
        )));
    }
    // As datasets computes it: int(round(boundary * num_examples / 100.0)) in float64.
    let boundary = (f64::from(percentage) * documents as f64 / 100.0).round_ties_even() as usize;
    if boundary == 0 {
        return Err(Error::Text(format!(
            "--validation-split-percentage {percentage} of {documents} documents holds out none; \
             raise the percentage, use more documents, or pass --validation-file"
        )));
    }
    if boundary >= documents {
        return Err(Error::Text(format!(
            "--validation-split-percentage {percentage} of {documents} documents leaves none to \
             train on; lower the percentage or use more documents"
        )));
    }
    Ok((0..boundary, boundary..documents))
}

impl Corpus {
    /// Splits the corpus into `(train, validation)` by [`validation_split`], counting its
    /// documents first (one read of the corpus).
    pub fn split_validation(&self, percentage: u32) -> Result<(Corpus, Corpus)> {
        let documents = self.count_documents()?;
        let (validation, train) = validation_split(documents, percentage)?;
        Ok((self.select(train), self.select(validation)))
    }
}
