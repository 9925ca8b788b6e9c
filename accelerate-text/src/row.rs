//! [`TokenRow`]: one row of a batch before collation: token ids and the document each belongs to.

/// One row of token ids with their segment ids: documents numbered from 1 in the order they
/// appear in the row, 0 for padding (see [`TextBatch`](crate::TextBatch)).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TokenRow {
    /// The token ids.
    pub input_ids: Vec<u32>,
    /// The segment id of each token (as many as `input_ids`).
    pub segment_ids: Vec<u32>,
}

impl TokenRow {
    /// A row holding one document (segment 1 throughout).
    pub fn single(input_ids: Vec<u32>) -> Self {
        let segment_ids = vec![1; input_ids.len()];
        Self {
            input_ids,
            segment_ids,
        }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    /// Whether the row holds no token.
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }

    /// Pairs of neighbouring tokens of the same document: the tokens this row trains the model
    /// to predict (a token is predicted from the one before it only within a document).
    pub fn predicted(&self) -> usize {
        self.segment_ids
            .windows(2)
            .filter(|w| w[0] == w[1] && w[0] != 0)
            .count()
    }
}
