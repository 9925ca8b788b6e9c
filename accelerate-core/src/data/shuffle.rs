//! The sample order of an epoch: a permutation determined only by `(seed, epoch)`.
//!
//! Every rank computes the same permutation independently, so no order has to be broadcast. The
//! generator is ChaCha8, whose output is fixed by its specification, and the permutation is a
//! Fisher-Yates shuffle driven by our own unbiased bounded sampling (rather than `rand`'s
//! `SliceRandom`, whose value stream may change between `rand` versions), so an order is
//! reproducible across platforms, compilers and dependency upgrades.

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Domain tag filling the upper half of the ChaCha key, so that these streams differ from any other
/// use of ChaCha8 seeded with the same numbers.
const KEY_TAG: &[u8; 16] = b"accelerate-rs/ep";

/// The ChaCha8 key of `(seed, epoch)`: seed and epoch occupy separate bytes, so distinct pairs never
/// share a stream (unlike adding the epoch to the seed, where seed 1 epoch 0 equals seed 0 epoch 1).
fn key(seed: u64, epoch: u64) -> [u8; 32] {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&epoch.to_le_bytes());
    key[16..].copy_from_slice(KEY_TAG);
    key
}

/// A uniformly distributed integer in `0..bound` (`bound > 0`), without modulo bias.
///
/// Lemire's multiply-and-reject method: the high word of `x * bound` is uniform once the low words
/// that would over-represent some results are rejected.
fn uniform_below(rng: &mut ChaCha8Rng, bound: u64) -> u64 {
    debug_assert!(bound > 0);
    let mut product = u128::from(rng.next_u64()) * u128::from(bound);
    let mut low = product as u64;
    if low < bound {
        let threshold = bound.wrapping_neg() % bound;
        while low < threshold {
            product = u128::from(rng.next_u64()) * u128::from(bound);
            low = product as u64;
        }
    }
    (product >> 64) as u64
}

/// The indices `0..len` permuted by the stream of `(seed, epoch)`.
pub fn shuffled_indices(len: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    let mut rng = ChaCha8Rng::from_seed(key(seed, epoch));
    for i in (1..len).rev() {
        let j = uniform_below(&mut rng, i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn is_permutation(order: &[usize]) -> bool {
        let mut sorted = order.to_vec();
        sorted.sort_unstable();
        sorted == (0..order.len()).collect::<Vec<_>>()
    }

    #[test]
    fn orders_are_permutations_fixed_by_seed_and_epoch() {
        for len in [0, 1, 2, 7, 100] {
            let a = shuffled_indices(len, 42, 3);
            assert!(is_permutation(&a), "len {len}: {a:?}");
            assert_eq!(a, shuffled_indices(len, 42, 3));
        }
        let base = shuffled_indices(100, 42, 3);
        assert_ne!(base, shuffled_indices(100, 42, 4), "another epoch");
        assert_ne!(base, shuffled_indices(100, 43, 3), "another seed");
        assert_ne!(base, (0..100).collect::<Vec<_>>());
        // seed + epoch is not what identifies a stream.
        assert_ne!(shuffled_indices(100, 1, 0), shuffled_indices(100, 0, 1));
    }

    #[test]
    fn every_permutation_of_three_is_about_equally_likely() {
        // 6000 epochs, 6 permutations: each count is Binomial(6000, 1/6), mean 1000 and standard
        // deviation 28.9. A biased shuffle (e.g. drawing j from 0..i instead of 0..=i, or a
        // modulo-biased draw) makes some permutations impossible or far off.
        let mut counts: HashMap<Vec<usize>, usize> = HashMap::new();
        for epoch in 0..6000 {
            *counts.entry(shuffled_indices(3, 7, epoch)).or_default() += 1;
        }
        assert_eq!(counts.len(), 6, "{counts:?}");
        for (perm, count) in &counts {
            assert!((850..=1150).contains(count), "{perm:?} drawn {count} times");
        }
    }

    #[test]
    fn bounded_draws_are_uniform_for_a_bound_that_is_not_a_power_of_two() {
        // 7000 draws below 7: each value Binomial(7000, 1/7), mean 1000, standard deviation 29.3.
        let mut rng = ChaCha8Rng::from_seed(key(5, 0));
        let mut counts = [0usize; 7];
        for _ in 0..7000 {
            counts[uniform_below(&mut rng, 7) as usize] += 1;
        }
        for (value, count) in counts.iter().enumerate() {
            assert!((850..=1150).contains(count), "{value} drawn {count} times");
        }
    }
}
