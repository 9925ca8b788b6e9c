//! Synthetic token data that a Rust benchmark and its PyTorch counterpart can both produce,
//! token for token: the SplitMix64 stream of a seed, each output taken modulo the vocabulary.
//!
//! SplitMix64 is a stateless function of the position in the stream (the state after `i + 1`
//! steps is `seed + (i + 1) · γ`), so any rank can produce any row without producing the rows
//! before it, and a few lines of NumPy produce the same ids (see `benchmarks/torch_step.py`).

/// SplitMix64's increment γ (the golden ratio in 64-bit fixed point).
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// Output `index` (from 0) of SplitMix64 seeded with `seed`: Vigna's reference `next()` called
/// `index + 1` times on a generator whose state started at `seed`.
pub fn splitmix64(seed: u64, index: u64) -> u64 {
    let mut z = seed.wrapping_add(index.wrapping_add(1).wrapping_mul(GAMMA));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Tokens `start..start + count` of the synthetic stream of `seed`: ids in `0..vocab`, uniform
/// up to a bias of `vocab / 2⁶⁴` (nothing at vocabulary sizes).
pub fn tokens(seed: u64, start: u64, count: usize, vocab: usize) -> Vec<u32> {
    assert!(
        vocab > 0 && vocab <= u32::MAX as usize,
        "vocabulary size {vocab}"
    );
    (0..count as u64)
        .map(|i| (splitmix64(seed, start + i) % vocab as u64) as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_is_vignas_splitmix64() {
        // The first outputs of the reference implementation (splitmix64.c) with state 0, as
        // published with it and reproduced by every port.
        assert_eq!(splitmix64(0, 0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(0, 1), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(splitmix64(0, 2), 0x06C4_5D18_8009_454F);
        // A seed only moves the start of the same sequence of states: seed γ is seed 0 one step on.
        assert_eq!(splitmix64(GAMMA, 0), splitmix64(0, 1));
    }

    #[test]
    fn tokens_are_in_the_vocabulary_and_roughly_uniform() {
        let vocab = 10;
        let t = tokens(7, 1000, 100_000, vocab);
        let mut counts = [0usize; 10];
        for &x in &t {
            counts[x as usize] += 1;
        }
        // Each count is Binomial(100000, 0.1): standard deviation ~95; 6 of them is 570.
        for c in counts {
            assert!((9_430..=10_570).contains(&c), "{counts:?}");
        }
        // Any window of the stream is the same wherever it is asked for.
        assert_eq!(tokens(7, 1010, 5, vocab), t[10..15].to_vec());
    }
}
