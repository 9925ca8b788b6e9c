//! Where the documents of packed rows are ([`Segments`]): rows of token ids that hold several
//! documents one after another, each numbered by a segment id (from 1 within a row, 0 for
//! padding), as the text crate's `TextBatch` carries them.
//!
//! A document must not see the one before it: each token attends to the earlier tokens of its own
//! document only, its rotary position counts from the document's start, and the loss predicts
//! token `t + 1` from token `t` only when both are in the same document. Rather than masking a
//! `T × T` score matrix, the model runs every document piece as a sequence of its own (the causal
//! attention of a sequence starting at position 0 is exactly that), on the fused kernels the
//! unpacked path uses, and puts the results back at the packed positions.
//!
//! The pieces are batched by length: sorted longest first, a piece joins the current group when it
//! is at least half the group's longest, or when the group's longest is at most
//! [`SHORT_PIECE`] tokens; each group is one batch padded to its longest piece (padding after a
//! piece is never seen by it, attention being causal). So the model computes fewer than twice the
//! real tokens plus [`SHORT_PIECE`] per piece, in as many forward passes as there are groups (at
//! most about `log2(T / SHORT_PIECE) + 2`). Padding tokens (segment 0) are not computed at all.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

/// Groups whose longest piece is at most this many tokens take pieces of any shorter length:
/// padding a short piece costs little, and fewer groups mean fewer passes.
pub const SHORT_PIECE: usize = 64;

/// The document pieces of a batch of packed rows and how the model batches them (see the module
/// docs). Built on the host from the segment ids.
#[derive(Debug, Clone)]
pub struct Segments {
    rows: usize,
    row_len: usize,
    pieces: Vec<Piece>,
    groups: Vec<Group>,
    predicted_per_row: Vec<usize>,
}

/// One document piece: `len` tokens of row `row` from `start`.
#[derive(Debug, Clone, Copy)]
struct Piece {
    row: usize,
    start: usize,
    len: usize,
}

/// Pieces batched together, each padded to `len` tokens.
#[derive(Debug, Clone)]
struct Group {
    len: usize,
    pieces: Vec<usize>,
}

/// One group as the model reads it: `count` sequences of `len` tokens, given as positions in the
/// flattened packed batch `[B · T]`.
#[derive(Debug, Clone)]
pub(crate) struct GroupLayout {
    /// Tokens per sequence (the group's longest piece).
    pub len: usize,
    /// Sequences (pieces) in the group.
    pub count: usize,
    /// `[count · len]`: the packed position of each token of each sequence; the padding slots
    /// after a piece repeat its first position (any token would do: nothing reads them).
    pub tokens: Vec<u32>,
    /// `[count · len]`: the packed position of the token each slot predicts (the next one of the
    /// same piece), or of the piece's first token where the slot predicts nothing.
    pub targets: Vec<u32>,
    /// `[count · len]`: 1 where the slot predicts the next token of its piece, else 0.
    pub weights: Vec<f32>,
}

impl Segments {
    /// The pieces of `segment_ids` `[B, T]` (an integer dtype, on any device: it is read on the
    /// host, which waits for a GPU's queued work). A piece is a run of one non-zero id; each id
    /// must form one run within its row, as packing numbers them (1, 2, ... in order, 0 for
    /// padding).
    pub fn new(segment_ids: &Tensor) -> Result<Self> {
        let (rows, row_len) = match segment_ids.dims() {
            &[b, t] => (b, t),
            dims => bail!("segment_ids has shape {dims:?}; expected [B, T] like input_ids"),
        };
        if !segment_ids.dtype().is_int() {
            bail!(
                "segment_ids has dtype {:?}; expected integer document numbers (u32)",
                segment_ids.dtype()
            );
        }
        let ids = segment_ids
            .to_device(&Device::Cpu)?
            .to_dtype(DType::I64)?
            .to_vec2::<i64>()?;
        let mut pieces = Vec::new();
        let mut predicted_per_row = Vec::with_capacity(rows);
        for (row, ids) in ids.iter().enumerate() {
            let mut predicted = 0;
            let mut seen = std::collections::HashSet::new();
            let mut start = 0;
            while start < row_len {
                let id = ids[start];
                let len = ids[start..].iter().take_while(|&&s| s == id).count();
                if id < 0 {
                    bail!(
                        "segment_ids[{row}, {start}] is {id}; document numbers are 1, 2, ... and \
                         0 marks padding"
                    );
                }
                if id != 0 {
                    if !seen.insert(id) {
                        bail!(
                            "segment_ids row {row}: document {id} appears again at position \
                             {start} after another document; number each document once, as one \
                             contiguous run"
                        );
                    }
                    pieces.push(Piece { row, start, len });
                    predicted += len - 1;
                }
                start += len;
            }
            predicted_per_row.push(predicted);
        }
        let groups = group_by_length(&pieces);
        Ok(Self {
            rows,
            row_len,
            pieces,
            groups,
            predicted_per_row,
        })
    }

    /// `(B, T)`: the packed batch's shape.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.row_len)
    }

    /// Tokens the causal-LM loss predicts in the batch: the pairs `(t, t + 1)` within one
    /// document, summed over rows (the items of item-weighted accumulation).
    pub fn predicted(&self) -> usize {
        self.predicted_per_row.iter().sum()
    }

    /// [`predicted`](Self::predicted) of each row.
    pub fn predicted_per_row(&self) -> &[usize] {
        &self.predicted_per_row
    }

    /// The document pieces, as `(row, start, len)` in row order.
    pub fn pieces(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        self.pieces.iter().map(|p| (p.row, p.start, p.len))
    }

    /// The forward passes the model makes for the batch: one per group of pieces.
    pub fn passes(&self) -> usize {
        self.groups.len()
    }

    /// `[B, T]` f32 on `device`: 1 at each position whose next token the loss predicts (same
    /// document), else 0 (the last position of every row is 0).
    pub fn next_token_weights(&self, device: &Device) -> candle_core::Result<Tensor> {
        let mut w = vec![0f32; self.rows * self.row_len];
        for p in &self.pieces {
            let at = p.row * self.row_len + p.start;
            w[at..at + p.len - 1].fill(1.0);
        }
        Tensor::from_vec(w, (self.rows, self.row_len), device)
    }

    /// The groups as the model reads them.
    pub(crate) fn layouts(&self) -> Vec<GroupLayout> {
        self.groups
            .iter()
            .map(|g| {
                let n = g.pieces.len() * g.len;
                let (mut tokens, mut targets, mut weights) = (
                    Vec::with_capacity(n),
                    Vec::with_capacity(n),
                    Vec::with_capacity(n),
                );
                for &i in &g.pieces {
                    let p = self.pieces[i];
                    let first = (p.row * self.row_len + p.start) as u32;
                    for slot in 0..g.len {
                        let inside = slot < p.len;
                        let predicts = slot + 1 < p.len;
                        tokens.push(if inside { first + slot as u32 } else { first });
                        targets.push(if predicts {
                            first + slot as u32 + 1
                        } else {
                            first
                        });
                        weights.push(if predicts { 1.0 } else { 0.0 });
                    }
                }
                GroupLayout {
                    len: g.len,
                    count: g.pieces.len(),
                    tokens,
                    targets,
                    weights,
                }
            })
            .collect()
    }

    /// `[B · T]`: where each packed position's result is in the groups' outputs laid end to end
    /// (group by group, `count · len` slots each), or one past their end for padding (the model
    /// puts a row of zeros there).
    pub(crate) fn scatter_index(&self) -> Vec<u32> {
        let computed: usize = self.groups.iter().map(|g| g.pieces.len() * g.len).sum();
        let mut index = vec![computed as u32; self.rows * self.row_len];
        let mut offset = 0;
        for g in &self.groups {
            for (k, &i) in g.pieces.iter().enumerate() {
                let p = self.pieces[i];
                let at = p.row * self.row_len + p.start;
                for slot in 0..p.len {
                    index[at + slot] = (offset + k * g.len + slot) as u32;
                }
            }
            offset += g.pieces.len() * g.len;
        }
        index
    }
}

/// The groups of `pieces` (see the module docs): longest first, ties in row order.
fn group_by_length(pieces: &[Piece]) -> Vec<Group> {
    let mut order: Vec<usize> = (0..pieces.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(pieces[i].len));
    let mut groups: Vec<Group> = Vec::new();
    for i in order {
        let len = pieces[i].len;
        match groups.last_mut() {
            Some(g) if 2 * len >= g.len || g.len <= SHORT_PIECE => g.pieces.push(i),
            _ => groups.push(Group {
                len,
                pieces: vec![i],
            }),
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segments(rows: &[&[u32]]) -> Result<Segments> {
        let rows: Vec<Vec<u32>> = rows.iter().map(|r| r.to_vec()).collect();
        Segments::new(&Tensor::new(rows, &Device::Cpu)?)
    }

    #[test]
    fn pieces_and_predicted_tokens_follow_the_document_boundaries() {
        let s = segments(&[&[1, 1, 1, 2, 2, 3], &[1, 1, 1, 1, 0, 0], &[0; 6]]).unwrap();
        let pieces: Vec<_> = s.pieces().collect();
        assert_eq!(
            pieces,
            [(0, 0, 3), (0, 3, 2), (0, 5, 1), (1, 0, 4)],
            "padding is no piece"
        );
        // Row 0: 2 + 1 + 0 pairs inside documents; row 1: 3; row 2: none.
        assert_eq!(s.predicted_per_row(), [3, 3, 0]);
        assert_eq!(s.predicted(), 6);
        let w = s.next_token_weights(&Device::Cpu).unwrap();
        assert_eq!(
            w.to_vec2::<f32>().unwrap(),
            [[1., 1., 0., 1., 0., 0.], [1., 1., 1., 0., 0., 0.], [0.; 6]]
        );
    }

    #[test]
    fn the_layout_reads_each_piece_from_its_start_and_puts_it_back_in_place() {
        let s = segments(&[&[1, 1, 2, 2, 2], &[1, 1, 1, 0, 0]]).unwrap();
        // One group (all short) of three pieces of at most 3 tokens.
        let layouts = s.layouts();
        assert_eq!(layouts.len(), 1);
        let g = &layouts[0];
        assert_eq!((g.len, g.count), (3, 3));
        // Longest first, ties in row order: (0, 2, 3), (1, 0, 3), (0, 0, 2).
        assert_eq!(g.tokens, [2, 3, 4, 5, 6, 7, 0, 1, 0]);
        assert_eq!(g.targets, [3, 4, 2, 6, 7, 5, 1, 0, 0]);
        assert_eq!(g.weights, [1., 1., 0., 1., 1., 0., 1., 0., 0.]);
        // Packed position -> slot; padding -> one past the 9 slots.
        assert_eq!(s.scatter_index(), [6, 7, 0, 1, 2, 3, 4, 5, 9, 9]);
        // Every computed token lands where it was read from.
        let scatter = s.scatter_index();
        for (slot, &pos) in g.tokens.iter().enumerate() {
            if scatter[pos as usize] == slot as u32 {
                continue;
            }
            // A padding slot (it repeats a piece's first position).
            assert_eq!(g.weights[slot], 0.0);
        }
    }

    #[test]
    fn pieces_are_grouped_by_length_within_a_factor_of_two() {
        let mut row = vec![1u32; 300];
        row.extend([2; 100]);
        row.extend([3; 160]);
        row.extend([4; 40]);
        row.extend([5; 10]);
        let s = segments(&[&row]).unwrap();
        let groups: Vec<(usize, usize)> = s.layouts().iter().map(|g| (g.len, g.count)).collect();
        // 300 and 160 (>= 150); 100 (< 150, starts a group); 40 (< 50) starts one, and 10 joins
        // it because 40 <= SHORT_PIECE.
        assert_eq!(groups, [(300, 2), (100, 1), (40, 2)]);
        assert_eq!(s.passes(), 3);
    }

    #[test]
    fn bad_segment_ids_are_refused_naming_the_problem() {
        let e = segments(&[&[1, 1, 2, 1]]).unwrap_err().to_string();
        assert!(
            e.contains("document 1 appears again at position 3") && e.contains("contiguous"),
            "{e}"
        );
        let e = Segments::new(&Tensor::new(&[1u32, 2], &Device::Cpu).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("[B, T]"), "{e}");
        let e = Segments::new(&Tensor::new(&[[1f32]], &Device::Cpu).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("F32") && e.contains("integer"), "{e}");
        let e = Segments::new(&Tensor::new(&[[1i64, -1]], &Device::Cpu).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("is -1"), "{e}");
    }
}
