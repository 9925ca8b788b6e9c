//! The dataset of the `gpt` workload: windows of a tokenized text, of seeded varying lengths,
//! padded per batch with a mask.
//!
//! Window `i` starts at `i · stride` and holds `len_i` input tokens, `len_i` drawn once, seeded,
//! in `min_len..=context`; its targets are the same tokens shifted by one. A batch is padded to
//! its longest window: padding sits at the end of a row, where causal attention keeps it from
//! influencing any real position, and its mask is 0 so it adds nothing to the loss. The number of
//! real tokens of a batch is what item-weighted accumulation counts.

use std::sync::Arc;

use accelerate_core::data::{Batch, Dataset};
use accelerate_core::{Error, Result};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Windows of a token sequence (see the module docs).
#[derive(Debug, Clone)]
pub struct TextWindows {
    tokens: Arc<Vec<u32>>,
    /// `(start, len)` of every window: inputs `tokens[start..start + len]`, targets one further.
    windows: Vec<(usize, usize)>,
    context: usize,
}

/// One batch: `inputs` and `targets` `[batch, max_len]` (u32), `mask` `[batch, max_len]` (f32,
/// 1 on real tokens, 0 on padding), and `tokens`, the number of real tokens.
#[derive(Debug, Clone)]
pub struct TokenBatch {
    /// Input tokens, padded with token 0.
    pub inputs: Tensor,
    /// Target tokens (the inputs shifted by one), padded with token 0.
    pub targets: Tensor,
    /// 1.0 where a target is real, 0.0 on padding.
    pub mask: Tensor,
    /// Real (non-padding) target tokens in the batch.
    pub tokens: usize,
}

impl Batch for TokenBatch {
    fn to_device(self, device: &Device) -> Result<Self> {
        Ok(Self {
            inputs: self.inputs.to_device(device)?,
            targets: self.targets.to_device(device)?,
            mask: self.mask.to_device(device)?,
            tokens: self.tokens,
        })
    }
}

impl TextWindows {
    /// Windows every `stride` tokens with lengths drawn uniformly from `min_len..=context` with
    /// `seed` (the same on every process). Fails, saying why, when the text is shorter than one
    /// full window (`context + 1` tokens) or the lengths are out of order.
    pub fn new(
        tokens: Vec<u32>,
        context: usize,
        min_len: usize,
        stride: usize,
        seed: u64,
    ) -> Result<Self> {
        if min_len == 0 || min_len > context || stride == 0 {
            return Err(Error::Config(format!(
                "text windows need 1 <= min_len <= context and stride >= 1; got min_len \
                 {min_len}, context {context}, stride {stride}"
            )));
        }
        if tokens.len() < context + 1 {
            return Err(Error::Data(format!(
                "the text holds {} tokens; a window of context {context} needs {} (its inputs \
                 and the next token as the last target)",
                tokens.len(),
                context + 1
            )));
        }
        let count = (tokens.len() - context - 1) / stride + 1;
        // A stream of its own, so the lengths do not repeat the initial weights drawn from the same seed.
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x7E47);
        let windows = (0..count)
            .map(|i| (i * stride, rng.random_range(min_len..=context)))
            .collect();
        Ok(Self {
            tokens: Arc::new(tokens),
            windows,
            context,
        })
    }

    /// The workload's default windows: every `context / 2` tokens, lengths in
    /// `ceil(context / 2)..=context`, so an epoch covers the text about twice.
    pub fn tiled(tokens: Vec<u32>, context: usize, seed: u64) -> Result<Self> {
        let half = context.div_ceil(2).max(1);
        Self::new(tokens, context, half, (context / 2).max(1), seed)
    }

    /// The longest window.
    pub fn context(&self) -> usize {
        self.context
    }

    /// `(start, len)` of window `index`.
    pub fn window(&self, index: usize) -> (usize, usize) {
        self.windows[index]
    }

    /// Which of `windows` (indices) share a token, as input or target, with any of `others`:
    /// the windows to leave out of training when `others` are held out for evaluation, so that
    /// the evaluation never scores text the model was trained on.
    pub fn overlapping(&self, windows: &[usize], others: &[usize]) -> Vec<usize> {
        // Token ranges [start, start + len + 1) of `others`, sorted by start; a window is at
        // most `context` + 1 tokens long, so only those starting less than that before a
        // window's end can reach it.
        let mut held: Vec<(usize, usize)> = others
            .iter()
            .map(|&i| {
                let (start, len) = self.windows[i];
                (start, start + len + 1)
            })
            .collect();
        held.sort_unstable();
        windows
            .iter()
            .copied()
            .filter(|&i| {
                let (start, len) = self.windows[i];
                let end = start + len + 1;
                let first = held.partition_point(|h| h.0 + self.context < start);
                held[first..]
                    .iter()
                    .take_while(|h| h.0 < end)
                    .any(|h| h.1 > start)
            })
            .collect()
    }

    /// Real target tokens over all windows.
    pub fn total_tokens(&self) -> usize {
        self.windows.iter().map(|w| w.1).sum()
    }
}

impl Dataset for TextWindows {
    /// The window's `len + 1` tokens (inputs and the one after the last).
    type Item = Vec<u32>;
    type Batch = TokenBatch;

    fn len(&self) -> usize {
        self.windows.len()
    }

    fn get(&self, index: usize) -> Result<Vec<u32>> {
        let &(start, len) = self.windows.get(index).ok_or_else(|| {
            Error::Data(format!(
                "window {index} requested from a dataset of {} windows",
                self.windows.len()
            ))
        })?;
        Ok(self.tokens[start..start + len + 1].to_vec())
    }

    fn collate(&self, items: Vec<Vec<u32>>) -> Result<TokenBatch> {
        let rows = items.len();
        let width = items.iter().map(|w| w.len() - 1).max().ok_or_else(|| {
            Error::Data("an empty batch of text windows cannot be collated".into())
        })?;
        let mut inputs = vec![0u32; rows * width];
        let mut targets = vec![0u32; rows * width];
        let mut mask = vec![0f32; rows * width];
        let mut tokens = 0;
        for (r, w) in items.iter().enumerate() {
            let len = w.len() - 1;
            let row = r * width;
            inputs[row..row + len].copy_from_slice(&w[..len]);
            targets[row..row + len].copy_from_slice(&w[1..]);
            mask[row..row + len].fill(1.0);
            tokens += len;
        }
        Ok(TokenBatch {
            inputs: Tensor::from_vec(inputs, (rows, width), &Device::Cpu)?,
            targets: Tensor::from_vec(targets, (rows, width), &Device::Cpu)?,
            mask: Tensor::from_vec(mask, (rows, width), &Device::Cpu)?,
            tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_tile_the_text_with_seeded_lengths_in_range() {
        let tokens: Vec<u32> = (0..101).collect();
        let a = TextWindows::tiled(tokens.clone(), 10, 3).unwrap();
        // Starts 0, 5, ..., 90: the last full window [90, 100] still has its next token, 100.
        assert_eq!(a.len(), 19);
        assert_eq!(a.window(18).0, 90);
        let lens: Vec<usize> = (0..a.len()).map(|i| a.window(i).1).collect();
        assert!(lens.iter().all(|&l| (5..=10).contains(&l)), "{lens:?}");
        assert!(lens.iter().any(|&l| l != lens[0]), "lengths vary: {lens:?}");
        let b = TextWindows::tiled(tokens.clone(), 10, 3).unwrap();
        assert_eq!(
            lens,
            (0..b.len()).map(|i| b.window(i).1).collect::<Vec<_>>()
        );
        let c = TextWindows::tiled(tokens, 10, 4).unwrap();
        assert_ne!(
            lens,
            (0..c.len()).map(|i| c.window(i).1).collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_batch_pads_to_its_longest_window_and_masks_the_padding() {
        let tokens: Vec<u32> = (10..40).collect();
        let ds = TextWindows::new(tokens, 6, 2, 4, 0).unwrap();
        let items = vec![vec![10, 11, 12], vec![20, 21, 22, 23, 24]];
        let b = ds.collate(items).unwrap();
        assert_eq!(b.tokens, 2 + 4);
        assert_eq!(
            b.inputs.to_vec2::<u32>().unwrap(),
            vec![vec![10, 11, 0, 0], vec![20, 21, 22, 23]]
        );
        assert_eq!(
            b.targets.to_vec2::<u32>().unwrap(),
            vec![vec![11, 12, 0, 0], vec![21, 22, 23, 24]]
        );
        assert_eq!(
            b.mask.to_vec2::<f32>().unwrap(),
            vec![vec![1.0, 1.0, 0.0, 0.0], vec![1.0; 4]]
        );
        let (start, len) = ds.window(2);
        let item = ds.get(2).unwrap();
        assert_eq!(item.len(), len + 1);
        assert_eq!(item[0], 10 + start as u32);
    }

    #[test]
    fn a_text_shorter_than_one_window_is_refused() {
        let e = TextWindows::tiled((0..10).collect(), 10, 0).unwrap_err();
        assert!(e.to_string().contains("needs 11"), "{e}");
        assert!(TextWindows::tiled((0..11).collect(), 10, 0).is_ok());
        assert!(TextWindows::new((0..50).collect(), 10, 11, 5, 0).is_err());
    }

    #[test]
    fn overlapping_windows_are_those_sharing_a_token_with_a_held_out_one() {
        let a = TextWindows::tiled((0..101).collect(), 10, 3).unwrap();
        let all: Vec<usize> = (0..a.len()).collect();
        let held = [4usize, 11];
        // By brute force over token ranges [start, start + len + 1): inputs and targets.
        let range = |i: usize| {
            let (s, l) = a.window(i);
            s..s + l + 1
        };
        let expected: Vec<usize> = all
            .iter()
            .copied()
            .filter(|&i| {
                held.iter()
                    .any(|&h| range(i).start < range(h).end && range(h).start < range(i).end)
            })
            .collect();
        let found = a.overlapping(&all, &held);
        assert_eq!(found, expected);
        // Every window overlaps itself and, at stride 5 with lengths of at least 5, the
        // neighbours on each side; far windows do not.
        for h in held {
            for i in [h - 1, h, h + 1] {
                assert!(found.contains(&i), "{i} in {found:?}");
            }
        }
        assert!(!found.contains(&0) && !found.contains(&18), "{found:?}");
        assert!(a.overlapping(&all, &[]).is_empty());
    }
}
