//! Each rank's own random generator (see [`RankRng`]).

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{Device, Tensor};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Domain tag filling the upper half of the key, so that these streams differ from the data
/// loaders' shuffles and any other ChaCha8 seeded with the same numbers.
const DOMAIN: &[u8; 16] = b"accel-rs rankrng";

/// Domain tag of the generators handed to the user ([`user_chacha`]), so that they never
/// repeat the accelerator's own stream.
const USER_DOMAIN: &[u8; 16] = b"accel-rs userrng";

/// The ChaCha8 key of `(seed, rank)`.
fn key(seed: u64, rank: usize) -> [u8; 32] {
    keyed(seed, rank, DOMAIN)
}

fn keyed(seed: u64, rank: usize, domain: &[u8; 16]) -> [u8; 32] {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&(rank as u64).to_le_bytes());
    key[16..].copy_from_slice(domain);
    key
}

/// A ChaCha8 generator of the user's own, a pure function of `(seed, rank, stream)`: its key is
/// the seed and the rank (little-endian u64s) followed by the tag `accel-rs userrng`, and
/// `stream` is ChaCha's stream number, so one seed gives each rank, and each purpose, a stream
/// of its own that no other generator of the runtime draws.
pub(crate) fn user_chacha(seed: u64, rank: usize, stream: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::from_seed(keyed(seed, rank, USER_DOMAIN));
    rng.set_stream(stream);
    rng
}

/// This rank's generator.
///
/// Each rank's own random generator, owned by the [`Accelerator`](crate::Accelerator) and saved in
/// every checkpoint (`rng_<rank>.json`, like Accelerate's `random_states_<i>.pkl`), so that a model
/// drawing from it (dropout) resumes bitwise.
///
/// candle's CPU `rand`/`randn` draw from an unseedable thread generator, and a GPU generator's
/// position cannot be read back, so neither can be checkpointed: randomness that must survive a
/// resume comes from here. It is ChaCha8 (whose output is fixed by its specification), keyed by the
/// accelerator's seed and the rank, so ranks draw different masks and every run with the same seed
/// draws the same ones. Draws happen on the host; [`RankRng::dropout`] moves its mask to the
/// tensor's device.
///
/// A clone is another handle on the same generator (it draws from, and moves, the one stream), so
/// a model can keep one without borrowing the accelerator.
#[derive(Debug, Clone)]
pub struct RankRng {
    rank: usize,
    inner: Arc<Mutex<ChaCha8Rng>>,
}

/// A generator's exact position: its key, stream and word position (what `rng_<rank>.json` holds).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    /// The rank whose generator it is.
    pub rank: usize,
    /// The 32-byte ChaCha key, in hexadecimal.
    pub key: String,
    /// The ChaCha stream.
    pub stream: u64,
    /// 32-bit words consumed, in decimal (a u128 does not fit a JSON number exactly).
    pub word_pos: String,
    /// The seed the device's own generator was reset to at this point (GPU runs only; see
    /// [`RankRng::device_seed`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_seed: Option<u64>,
}

impl RankRng {
    /// The generator of `rank` for `seed`, at its start.
    pub fn new(seed: u64, rank: usize) -> Self {
        Self {
            rank,
            inner: Arc::new(Mutex::new(ChaCha8Rng::from_seed(key(seed, rank)))),
        }
    }

    /// Restarts this generator as [`new`](Self::new)`(seed, rank)` starts.
    pub(crate) fn reseed(&self, seed: u64) {
        *self.lock() = ChaCha8Rng::from_seed(key(seed, self.rank));
    }

    /// The generator itself, for any draw (`rand`'s `Rng` methods work on it). Hold the guard
    /// briefly: the accelerator takes it to save and load checkpoints.
    pub fn lock(&self) -> MutexGuard<'_, ChaCha8Rng> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next 64 random bits (e.g. to seed another generator).
    pub fn next_u64(&self) -> u64 {
        self.lock().next_u64()
    }

    /// Training-mode dropout of `x`: each element is zeroed with probability `p` and the others
    /// are scaled by `1 / (1 - p)` (PyTorch's `nn.Dropout`). The mask is drawn on the host from
    /// this generator, one 32-bit draw per element in row-major order, and built in `x`'s dtype on
    /// `x`'s device. `p` 0 returns `x` unchanged without drawing; `p` must be in `[0, 1)`.
    pub fn dropout(&self, x: &Tensor, p: f64) -> Result<Tensor> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::Config(format!(
                "dropout probability {p} is outside [0, 1): 0 keeps everything, values near 1 \
                 drop almost everything"
            )));
        }
        if p == 0.0 {
            return Ok(x.clone());
        }
        // Dropped when the draw, read as a fraction of 2^32, is below p.
        let threshold = (p * 4_294_967_296.0) as u64;
        let scale = (1.0 / (1.0 - p)) as f32;
        let n = x.elem_count();
        let mask: Vec<f32> = {
            let mut rng = self.lock();
            (0..n)
                .map(|_| {
                    if u64::from(rng.next_u32()) < threshold {
                        0.0
                    } else {
                        scale
                    }
                })
                .collect()
        };
        let mask = Tensor::from_vec(mask, x.dims(), &Device::Cpu)?
            .to_dtype(x.dtype())?
            .to_device(x.device())?;
        Ok((x * mask)?)
    }

    /// A seed for the device's own generator that is a pure function of this generator's
    /// position (it draws from a copy, so the position does not move). The accelerator resets a
    /// GPU's generator to it whenever it saves or loads a checkpoint, so that candle's device
    /// `rand`/`randn` also continue alike in a resumed run and in an uninterrupted one.
    pub fn device_seed(&self) -> u64 {
        self.lock().clone().next_u64()
    }

    /// The generator's exact position.
    pub fn state(&self) -> RngState {
        let rng = self.lock();
        RngState {
            rank: self.rank,
            key: rng.get_seed().iter().map(|b| format!("{b:02x}")).collect(),
            stream: rng.get_stream(),
            word_pos: rng.get_word_pos().to_string(),
            device_seed: None,
        }
    }

    /// Checks `state` and returns the generator it describes (nothing changes here).
    pub fn parse_state(&self, state: &RngState) -> std::result::Result<ChaCha8Rng, String> {
        if state.rank != self.rank {
            return Err(format!(
                "it holds rank {}'s generator, but this is rank {}",
                state.rank, self.rank
            ));
        }
        let hex = state.key.as_bytes();
        if hex.len() != 64 {
            return Err(format!(
                "the key has {} hexadecimal digits instead of 64",
                hex.len()
            ));
        }
        let mut key = [0u8; 32];
        for (i, pair) in hex.chunks(2).enumerate() {
            let digits = std::str::from_utf8(pair).map_err(|e| e.to_string())?;
            key[i] = u8::from_str_radix(digits, 16)
                .map_err(|_| format!("the key holds {digits:?}, which is not hexadecimal"))?;
        }
        let word_pos: u128 = state
            .word_pos
            .parse()
            .map_err(|_| format!("word_pos {:?} is not a number", state.word_pos))?;
        let mut rng = ChaCha8Rng::from_seed(key);
        rng.set_stream(state.stream);
        rng.set_word_pos(word_pos);
        Ok(rng)
    }

    /// A copy of the generator at its current position, for [`restore`](Self::restore) to rewind
    /// to (e.g. to draw a recomputed block's dropout masks again).
    pub fn snapshot(&self) -> ChaCha8Rng {
        self.lock().clone()
    }

    /// Moves the generator to `rng` (a [`snapshot`](Self::snapshot), or a state checked by
    /// [`parse_state`](Self::parse_state)); every handle on it draws from there on.
    pub fn restore(&self, rng: ChaCha8Rng) {
        *self.lock() = rng;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    #[test]
    fn a_restored_state_continues_the_same_stream() {
        let a = RankRng::new(7, 1);
        for _ in 0..13 {
            a.next_u64();
        }
        let saved = a.state();
        let later: Vec<u64> = (0..5).map(|_| a.next_u64()).collect();
        let b = RankRng::new(7, 1);
        assert_ne!(b.next_u64(), later[0], "a fresh generator is elsewhere");
        let json = serde_json::to_string(&saved).unwrap();
        b.restore(
            b.parse_state(&serde_json::from_str(&json).unwrap())
                .unwrap(),
        );
        let again: Vec<u64> = (0..5).map(|_| b.next_u64()).collect();
        assert_eq!(again, later);
        // Another rank's state is refused.
        assert!(RankRng::new(7, 0)
            .parse_state(&saved)
            .unwrap_err()
            .contains("rank 1"));
    }

    #[test]
    fn a_snapshot_rewinds_every_handle_to_the_same_draws() {
        let a = RankRng::new(5, 0);
        let handle = a.clone();
        let x = Tensor::ones((4, 8), DType::F32, &Device::Cpu).unwrap();
        let before = a.snapshot();
        let first = a.dropout(&x, 0.5).unwrap().to_vec2::<f32>().unwrap();
        // The clone shares the stream: it continues past the first mask.
        let second = handle.dropout(&x, 0.5).unwrap().to_vec2::<f32>().unwrap();
        assert_ne!(first, second);
        let after = a.snapshot();
        handle.restore(before);
        assert_eq!(a.dropout(&x, 0.5).unwrap().to_vec2::<f32>().unwrap(), first);
        a.restore(after);
        let fresh = RankRng::new(5, 0);
        for _ in 0..(2 * 32) {
            fresh.lock().next_u32();
        }
        assert_eq!(
            a.next_u64(),
            fresh.next_u64(),
            "restored to after two masks"
        );
    }

    #[test]
    fn ranks_and_seeds_draw_different_streams() {
        let first = |seed, rank| RankRng::new(seed, rank).next_u64();
        assert_ne!(first(0, 0), first(0, 1));
        assert_ne!(first(0, 0), first(1, 0));
        assert_eq!(first(3, 2), first(3, 2));
    }

    #[test]
    fn dropout_zeroes_about_p_and_scales_the_rest() {
        let rng = RankRng::new(1, 0);
        let x = Tensor::ones((100, 100), DType::F32, &Device::Cpu).unwrap();
        let y = rng.dropout(&x, 0.25).unwrap();
        let v = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let zeros = v.iter().filter(|&&a| a == 0.0).count();
        // 10000 draws with p = 0.25: 2500 expected, standard deviation about 43.
        assert!((2300..2700).contains(&zeros), "{zeros}");
        assert!(v.iter().all(|&a| a == 0.0 || a == (1.0f32 / 0.75)));
        assert_eq!(
            rng.dropout(&x, 0.0).unwrap().to_vec2::<f32>().unwrap(),
            x.to_vec2::<f32>().unwrap()
        );
        assert!(rng.dropout(&x, 1.0).is_err());
    }
}
