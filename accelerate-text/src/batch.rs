//! [`TextBatch`]: a batch of token rows with their document boundaries, as the loaders hand it to a
//! language model.

use accelerate_core::data::Batch;
use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::row::TokenRow;

/// A batch of `B` rows of `T` token ids.
///
/// `segment_ids` numbers the documents within each row from 1, in order, and marks padding with 0.
/// A token `t + 1` is predicted from token `t` only when both have the same non-zero segment id,
/// so attention and the loss stop at document boundaries: a token attends to the earlier tokens
/// of its own segment only, and position ids restart at 0 at each segment start (and at each row
/// start, where a document cut by the previous row continues).
#[derive(Debug, Clone)]
pub struct TextBatch {
    /// Token ids, `[B, T]`, `u32`.
    pub input_ids: Tensor,
    /// Segment ids, `[B, T]`, `u32`: documents from 1 within each row, 0 for padding.
    pub segment_ids: Tensor,
    /// Number of (t, t + 1) pairs with the same non-zero segment id: the predicted tokens, which
    /// a loss averaged over the batch divides by.
    pub predicted: usize,
}

impl TextBatch {
    /// The batch of `rows`, each padded at its end to the longest with `pad_id` (segment 0).
    /// Refuses an empty list and a row whose segment ids do not match its tokens in number.
    pub fn from_rows(rows: &[TokenRow], pad_id: u32) -> Result<Self> {
        if rows.is_empty() {
            return Err(Error::Text(
                "TextBatch::from_rows was given no row; a batch holds at least one".into(),
            ));
        }
        let width = rows.iter().map(TokenRow::len).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(rows.len() * width);
        let mut segments = Vec::with_capacity(rows.len() * width);
        let mut predicted = 0;
        for (i, row) in rows.iter().enumerate() {
            if row.segment_ids.len() != row.input_ids.len() {
                return Err(Error::Text(format!(
                    "row {i} of the batch has {} tokens but {} segment ids; each token needs one",
                    row.input_ids.len(),
                    row.segment_ids.len()
                )));
            }
            ids.extend_from_slice(&row.input_ids);
            ids.resize(ids.len() + width - row.len(), pad_id);
            segments.extend_from_slice(&row.segment_ids);
            segments.resize(segments.len() + width - row.len(), 0);
            predicted += row.predicted();
        }
        let shape = (rows.len(), width);
        Ok(Self {
            input_ids: Tensor::from_vec(ids, shape, &Device::Cpu).map_err(core)?,
            segment_ids: Tensor::from_vec(segments, shape, &Device::Cpu).map_err(core)?,
            predicted,
        })
    }

    /// Number of rows, `B`.
    pub fn rows(&self) -> usize {
        self.input_ids.dims().first().copied().unwrap_or(0)
    }

    /// Tokens per row, `T`.
    pub fn seq_len(&self) -> usize {
        self.input_ids.dims().get(1).copied().unwrap_or(0)
    }
}

fn core(e: candle_core::Error) -> Error {
    Error::Core(e.into())
}

impl Batch for TextBatch {
    fn to_device(self, device: &Device) -> accelerate_core::Result<Self> {
        Ok(Self {
            // Through the runtime's tensor move, which stages GPU-bound copies in pinned memory.
            input_ids: Batch::to_device(self.input_ids, device)?,
            segment_ids: Batch::to_device(self.segment_ids, device)?,
            predicted: self.predicted,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(ids: &[u32], segs: &[u32]) -> TokenRow {
        TokenRow {
            input_ids: ids.to_vec(),
            segment_ids: segs.to_vec(),
        }
    }

    #[test]
    fn rows_are_padded_to_the_longest_and_predicted_pairs_counted_by_hand() {
        let rows = [row(&[5, 6, 7], &[1, 1, 2]), row(&[8], &[1]), row(&[], &[])];
        let b = TextBatch::from_rows(&rows, 99).unwrap();
        assert_eq!((b.rows(), b.seq_len()), (3, 3));
        assert_eq!(
            b.input_ids.to_vec2::<u32>().unwrap(),
            vec![vec![5, 6, 7], vec![8, 99, 99], vec![99, 99, 99]]
        );
        assert_eq!(
            b.segment_ids.to_vec2::<u32>().unwrap(),
            vec![vec![1, 1, 2], vec![1, 0, 0], vec![0, 0, 0]]
        );
        // Row 0: (5,6) same document, (6,7) crosses a boundary; rows 1 and 2 have no pair.
        assert_eq!(b.predicted, 1);
        let moved = b.to_device(&Device::Cpu).unwrap();
        assert_eq!(moved.predicted, 1);
    }

    #[test]
    fn bad_rows_are_refused_naming_the_problem() {
        let e = TextBatch::from_rows(&[], 0).unwrap_err().to_string();
        assert!(e.contains("no row"), "{e}");
        let e = TextBatch::from_rows(&[row(&[1, 2], &[1])], 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("2 tokens but 1 segment ids"), "{e}");
    }
}
