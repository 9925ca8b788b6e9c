//! Packing: documents (each ending with EOS) concatenated in stream order and cut into rows of
//! exactly `block_size` tokens, as run_clm.py's `group_texts`, keeping the document boundaries as
//! segment ids. A document longer than the rest of a row continues in the next row under a new
//! segment id there; the incomplete last row is dropped.
//!
//! Two forms of the same rule: [`Packer`], incremental (push documents, take finished rows), and
//! [`packed_row`], random access to row `r` of tokens already stored with their document offsets
//! (a token file, or tokens tokenized into memory), for map-style datasets.

use std::collections::VecDeque;

use crate::error::{Error, Result};
use crate::row::TokenRow;

/// Packs documents into rows of `block_size` tokens as they come.
#[derive(Debug, Clone)]
pub struct Packer {
    block_size: usize,
    /// The row being filled (fewer than `block_size` tokens).
    current: TokenRow,
    ready: VecDeque<TokenRow>,
}

impl Packer {
    /// A packer of rows of `block_size` tokens (at least 1).
    pub fn new(block_size: usize) -> Result<Self> {
        check_block_size(block_size)?;
        Ok(Self {
            block_size,
            current: TokenRow::default(),
            ready: VecDeque::new(),
        })
    }

    /// Tokens per row.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Appends one document's token ids (EOS included); the rows it completes become ready. An
    /// empty document adds nothing (no segment).
    pub fn push(&mut self, ids: &[u32]) {
        let mut rest = ids;
        let mut segment = self.current.segment_ids.last().map_or(1, |s| s + 1);
        while !rest.is_empty() {
            let take = (self.block_size - self.current.len()).min(rest.len());
            let (now, later) = rest.split_at(take);
            self.current.input_ids.extend_from_slice(now);
            self.current
                .segment_ids
                .extend(std::iter::repeat_n(segment, take));
            rest = later;
            if self.current.len() == self.block_size {
                let full = std::mem::replace(
                    &mut self.current,
                    TokenRow {
                        input_ids: Vec::with_capacity(self.block_size),
                        segment_ids: Vec::with_capacity(self.block_size),
                    },
                );
                self.ready.push_back(full);
                // The rest of the document continues in the next row as its first segment.
                segment = 1;
            }
        }
    }

    /// The oldest finished row, if any.
    pub fn pop(&mut self) -> Option<TokenRow> {
        self.ready.pop_front()
    }

    /// Finished rows waiting to be taken.
    pub fn ready(&self) -> usize {
        self.ready.len()
    }

    /// Tokens of the incomplete row: what [`Packer::finish`] drops.
    pub fn pending_tokens(&self) -> usize {
        self.current.len()
    }

    /// Ends the stream: the finished rows not taken yet, and the number of tokens of the
    /// incomplete last row, which is dropped (as `group_texts` drops it).
    pub fn finish(self) -> (Vec<TokenRow>, usize) {
        (self.ready.into(), self.current.len())
    }
}

fn check_block_size(block_size: usize) -> Result<()> {
    if block_size == 0 {
        return Err(Error::Text(
            "the block size (tokens per packed row) is 0; pass the context length, e.g. \
             --block-size 1024"
                .into(),
        ));
    }
    Ok(())
}

/// Tokens stored in stream order with the offsets of their documents, read at random.
pub(crate) trait StoredTokens {
    /// Number of tokens.
    fn token_count(&self) -> u64;
    /// Number of documents.
    fn document_count(&self) -> usize;
    /// Where document `doc` starts (`doc` in `0..=document_count`; the last is `token_count`).
    fn document_start(&self, doc: usize) -> Result<u64>;
    /// Appends the tokens `start .. start + len` to `out`.
    fn read_tokens(&self, start: u64, len: usize, out: &mut Vec<u32>) -> Result<()>;
}

/// Number of packed rows of `block_size` tokens in `tokens` tokens (the remainder is dropped).
pub fn packed_rows(tokens: u64, block_size: usize) -> usize {
    if block_size == 0 {
        return 0;
    }
    usize::try_from(tokens / block_size as u64).unwrap_or(usize::MAX)
}

/// Row `row` of the packing of `stored` into rows of `block_size` tokens: the same row
/// [`Packer`] makes, found by a binary search of the document offsets.
pub(crate) fn packed_row(
    stored: &impl StoredTokens,
    block_size: usize,
    row: usize,
) -> Result<TokenRow> {
    check_block_size(block_size)?;
    let rows = packed_rows(stored.token_count(), block_size);
    if row >= rows {
        return Err(Error::Text(format!(
            "packed row {row} requested from {rows} rows of {block_size} tokens"
        )));
    }
    let start = row as u64 * block_size as u64;
    let mut input_ids = Vec::with_capacity(block_size);
    stored.read_tokens(start, block_size, &mut input_ids)?;

    // The document holding `start`: the last one starting at or before it (empty documents
    // start where the next one does, so the last such start is a non-empty document's).
    let (mut lo, mut hi) = (0, stored.document_count());
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if stored.document_start(mid)? <= start {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    let mut doc = lo.saturating_sub(1);
    let mut next_start = stored.document_start(doc + 1)?;
    let mut segment = 1;
    let mut segment_ids = Vec::with_capacity(block_size);
    for position in start..start + block_size as u64 {
        if position >= next_start {
            // Skip empty documents: they add no segment.
            while position >= next_start {
                doc += 1;
                next_start = stored.document_start(doc + 1)?;
            }
            segment += 1;
        }
        segment_ids.push(segment);
    }
    Ok(TokenRow {
        input_ids,
        segment_ids,
    })
}

/// Tokens held in memory with their document offsets.
#[derive(Debug, Clone, Default)]
pub(crate) struct MemoryTokens {
    pub tokens: Vec<u32>,
    /// `document_count + 1` offsets, from 0 to `tokens.len()`.
    pub offsets: Vec<u64>,
}

impl MemoryTokens {
    pub fn new() -> Self {
        Self {
            tokens: Vec::new(),
            offsets: vec![0],
        }
    }

    pub fn push(&mut self, ids: &[u32]) {
        self.tokens.extend_from_slice(ids);
        self.offsets.push(self.tokens.len() as u64);
    }
}

impl StoredTokens for MemoryTokens {
    fn token_count(&self) -> u64 {
        self.tokens.len() as u64
    }

    fn document_count(&self) -> usize {
        self.offsets.len() - 1
    }

    fn document_start(&self, doc: usize) -> Result<u64> {
        self.offsets.get(doc).copied().ok_or_else(|| {
            Error::Text(format!(
                "document {doc} requested from {} documents",
                self.document_count()
            ))
        })
    }

    fn read_tokens(&self, start: u64, len: usize, out: &mut Vec<u32>) -> Result<()> {
        let range = usize::try_from(start)
            .ok()
            .and_then(|s| Some(s..s.checked_add(len)?))
            .filter(|r| r.end <= self.tokens.len())
            .ok_or_else(|| {
                Error::Text(format!(
                    "tokens {start}..+{len} requested from {} tokens",
                    self.tokens.len()
                ))
            })?;
        out.extend_from_slice(&self.tokens[range]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// The reference: concatenate everything with each token's document number, cut into rows,
    /// drop the remainder, and number the documents within each row from 1 by counting changes.
    fn naive(docs: &[Vec<u32>], block_size: usize) -> Vec<TokenRow> {
        let flat: Vec<(u32, usize)> = docs
            .iter()
            .enumerate()
            .flat_map(|(d, ids)| ids.iter().map(move |&t| (t, d)))
            .collect();
        flat.chunks_exact(block_size)
            .map(|chunk| {
                let mut segment = 1;
                let mut segment_ids = vec![1];
                for w in chunk.windows(2) {
                    if w[1].1 != w[0].1 {
                        segment += 1;
                    }
                    segment_ids.push(segment);
                }
                TokenRow {
                    input_ids: chunk.iter().map(|&(t, _)| t).collect(),
                    segment_ids,
                }
            })
            .collect()
    }

    fn random_docs(rng: &mut ChaCha8Rng, block_size: usize) -> Vec<Vec<u32>> {
        let n = rng.random_range(0..40);
        let mut next = 0u32;
        (0..n)
            .map(|_| {
                // Empty documents, short ones, and ones longer than two rows.
                let len = match rng.random_range(0..10) {
                    0 => 0,
                    1 => rng.random_range(2 * block_size + 1..4 * block_size + 3),
                    _ => rng.random_range(1..block_size + 3),
                };
                (0..len)
                    .map(|_| {
                        next += 1;
                        next
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn packer_and_random_access_match_the_naive_packing_on_random_documents() {
        let mut rng = ChaCha8Rng::seed_from_u64(32);
        let mut long_docs = 0;
        let mut dropped_some = 0;
        for case in 0..400 {
            let block_size = rng.random_range(1..12);
            let docs = random_docs(&mut rng, block_size);
            long_docs += docs.iter().filter(|d| d.len() > 2 * block_size).count();
            let expected = naive(&docs, block_size);
            let total: usize = docs.iter().map(Vec::len).sum();
            assert_eq!(expected.len(), total / block_size, "case {case}");

            let mut packer = Packer::new(block_size).unwrap();
            let mut rows = Vec::new();
            for d in &docs {
                packer.push(d);
                // Take some rows as they come and leave others for `finish`.
                if rng.random_bool(0.5) {
                    rows.extend(std::iter::from_fn(|| packer.pop()));
                }
            }
            let (rest, dropped) = packer.finish();
            rows.extend(rest);
            assert_eq!(rows, expected, "case {case}: block {block_size}");
            assert_eq!(dropped, total % block_size, "case {case}");
            dropped_some += usize::from(dropped > 0);

            let mut stored = MemoryTokens::new();
            for d in &docs {
                stored.push(d);
            }
            assert_eq!(
                packed_rows(stored.token_count(), block_size),
                expected.len()
            );
            for (r, want) in expected.iter().enumerate() {
                assert_eq!(
                    &packed_row(&stored, block_size, r).unwrap(),
                    want,
                    "case {case}, row {r}"
                );
            }
            assert!(packed_row(&stored, block_size, expected.len()).is_err());
        }
        assert!(
            long_docs > 50 && dropped_some > 50,
            "{long_docs} {dropped_some}"
        );
    }

    #[test]
    fn hand_counted_rows() {
        // Documents [1 2 3], [4 5], [6 7 8 9 10 11 12] (a document longer than two rows of 3),
        // [13], in rows of 3: [1 2 3] [4 5 | 6] [7 8 9] [10 11 12] and [13] dropped.
        let docs: [&[u32]; 4] = [&[1, 2, 3], &[4, 5], &[6, 7, 8, 9, 10, 11, 12], &[13]];
        let mut packer = Packer::new(3).unwrap();
        for d in docs {
            packer.push(d);
        }
        assert_eq!(packer.pending_tokens(), 1);
        let (rows, dropped) = packer.finish();
        let segs: Vec<Vec<u32>> = rows.iter().map(|r| r.segment_ids.clone()).collect();
        assert_eq!(
            segs,
            vec![vec![1, 1, 1], vec![1, 1, 2], vec![1, 1, 1], vec![1, 1, 1]]
        );
        assert_eq!(rows[1].input_ids, vec![4, 5, 6]);
        assert_eq!(rows[1].predicted(), 1);
        assert_eq!(dropped, 1);
        assert!(Packer::new(0)
            .unwrap_err()
            .to_string()
            .contains("block size"));
    }
}
