//! Single-pass update kernels over f32 slices, and the split of one large parameter over threads.
//!
//! Each kernel reads and writes every element of the parameter, its gradient and its optimizer state
//! exactly once, with no temporaries: the tensor-op formulation of the same update makes one full
//! pass (and one allocation) per elementwise operation. Elements are independent, so splitting a
//! parameter into chunks changes nothing in the result, bit for bit.
//!
//! The arithmetic follows PyTorch's single-tensor (non-foreach) implementations operation by
//! operation, in f32, with the per-step scalars computed in f64 and rounded once, as PyTorch does when
//! it passes Python floats to f32 tensor ops.

use std::ops::Range;

use crate::cpu_slices::HalfSliceMut;

/// Parameters with more elements than this are updated by several threads.
pub(crate) const PARALLEL_MIN_ELEMS: usize = 1 << 20;

/// The scalars of one AdamW update of one parameter.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdamWCoefficients {
    /// `1 - lr * weight_decay`: decoupled weight decay.
    pub decay: f32,
    /// `1 - beta1`: the weight of `lerp(m, g, 1 - beta1)`.
    pub one_minus_beta1: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bias_correction2_sqrt: f32,
    /// `eps`, added outside the square root.
    pub eps: f32,
}

impl AdamWCoefficients {
    /// The scalars for the update at step `step` (1-based, already counted).
    pub fn new(lr: f64, beta1: f64, beta2: f64, eps: f64, weight_decay: f64, step: u64) -> Self {
        let t = step as f64;
        let bias_correction1 = 1.0 - beta1.powf(t);
        let bias_correction2 = 1.0 - beta2.powf(t);
        Self {
            decay: (1.0 - lr * weight_decay) as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            step_size: (lr / bias_correction1) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            eps: eps as f32,
        }
    }
}

/// PyTorch's `torch.lerp` for one element: the formula switches at weight 0.5 to stay accurate.
/// `SMALL_WEIGHT` is `|weight| < 0.5`, decided once per update rather than per element.
#[inline(always)]
fn lerp<const SMALL_WEIGHT: bool>(start: f32, end: f32, weight: f32) -> f32 {
    if SMALL_WEIGHT {
        start + weight * (end - start)
    } else {
        end - (end - start) * (1.0 - weight)
    }
}

/// One AdamW update, in place: `p` the parameter, `g` its gradient, `m`/`v` the first and second
/// moments. All four slices have the same length.
pub(crate) fn adamw(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: &AdamWCoefficients) {
    debug_assert!(g.len() == p.len() && m.len() == p.len() && v.len() == p.len());
    if c.one_minus_beta1.abs() < 0.5 {
        adamw_loop::<true>(p, g, m, v, c)
    } else {
        adamw_loop::<false>(p, g, m, v, c)
    }
}

#[inline(always)]
fn adamw_loop<const SMALL_WEIGHT: bool>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    c: &AdamWCoefficients,
) {
    let neg_step_size = -c.step_size;
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        // param.mul_(1 - lr * wd)
        let decayed = *p * c.decay;
        // exp_avg.lerp_(grad, 1 - beta1)
        let m_new = lerp::<SMALL_WEIGHT>(*m, g, c.one_minus_beta1);
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        let v_new = *v * c.beta2 + c.one_minus_beta2 * g * g;
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let denom = v_new.sqrt() / c.bias_correction2_sqrt + c.eps;
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        *p = decayed + neg_step_size * m_new / denom;
        *m = m_new;
        *v = v_new;
    }
}

/// The scalars of one SGD update.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SgdCoefficients {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor; 0 disables the buffer.
    pub momentum: f32,
    /// `1 - dampening`.
    pub one_minus_dampening: f32,
    /// L2 penalty added to the gradient.
    pub weight_decay: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
}

/// One SGD update, in place. `buf` is the momentum buffer (empty when momentum is 0); `first` says
/// that it holds nothing yet, in which case it is set to the gradient, as in PyTorch.
pub(crate) fn sgd(p: &mut [f32], g: &[f32], buf: &mut [f32], first: bool, c: &SgdCoefficients) {
    debug_assert!(g.len() == p.len());
    let neg_lr = -c.lr;
    if c.momentum == 0.0 {
        for (p, &g) in p.iter_mut().zip(g) {
            let d = if c.weight_decay != 0.0 {
                g + c.weight_decay * *p
            } else {
                g
            };
            *p += neg_lr * d;
        }
        return;
    }
    debug_assert!(buf.len() == p.len());
    for ((p, &g), b) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
        // grad = grad.add(param, alpha=weight_decay)
        let d = if c.weight_decay != 0.0 {
            g + c.weight_decay * *p
        } else {
            g
        };
        // buf = clone(grad) on the first step, else buf.mul_(momentum).add_(grad, alpha=1 - dampening)
        let b_new = if first {
            d
        } else {
            *b * c.momentum + c.one_minus_dampening * d
        };
        *b = b_new;
        // grad = grad.add(buf, alpha=momentum) if nesterov else buf
        let step = if c.nesterov {
            d + c.momentum * b_new
        } else {
            b_new
        };
        // param.add_(grad, alpha=-lr)
        *p += neg_lr * step;
    }
}

/// Runs `kernel` over `(p, g, state)`, on several threads when `p` has more than `parallel_min`
/// elements. Every slice of `state` has `p`'s length; each call of `kernel` receives matching
/// chunks of `p`, `g` and every state slice.
///
/// With `copy` (a half-precision copy of the parameter, `p`'s length), the updated values are also
/// written there, rounded to nearest-even ([`HalfSliceMut::round_from`]), in the same pass over
/// memory: `kernel` runs on tiles of [`TILE`] elements and each tile is rounded into `copy` right
/// after its update, while it is still in the L1 cache, so the master weights are read from memory
/// once, not once more by a cast afterwards.
pub(crate) fn apply_split<F>(
    p: &mut [f32],
    g: &[f32],
    state: &mut [&mut [f32]],
    copy: Option<HalfSliceMut<'_>>,
    parallel_min: usize,
    kernel: &F,
) where
    F: Fn(&mut [f32], &[f32], &mut [&mut [f32]]) + Sync,
{
    debug_assert!(g.len() == p.len() && state.iter().all(|s| s.len() == p.len()));
    debug_assert!(copy.as_ref().is_none_or(|c| c.len() == p.len()));
    let n = p.len();
    if n <= parallel_min.max(1) {
        update_chunk(p, g, state, copy, kernel);
        return;
    }
    let parts = rayon::current_num_threads().max(2);
    let chunk = n.div_ceil(parts);
    let mut state_chunks: Vec<_> = state.iter_mut().map(|s| s.chunks_mut(chunk)).collect();
    let mut copy_rest = copy;
    rayon::scope(|scope| {
        for (p, g) in p.chunks_mut(chunk).zip(g.chunks(chunk)) {
            let mut state: Vec<&mut [f32]> = state_chunks
                .iter_mut()
                .map(|chunks| chunks.next().unwrap_or_default())
                .collect();
            let copy = copy_rest.take().map(|c| {
                let (head, tail) = c.split_at_mut(p.len());
                copy_rest = Some(tail);
                head
            });
            scope.spawn(move |_| update_chunk(p, g, &mut state, copy, kernel));
        }
    });
}

/// Elements per tile of an update that writes a half-precision copy: the tile's parameter,
/// gradient and two moments (16 KiB in f32) and its copy stay in a 32 KiB L1 data cache.
pub(crate) const TILE: usize = 1024;

/// One thread's share of [`apply_split`].
fn update_chunk<F>(
    p: &mut [f32],
    g: &[f32],
    state: &mut [&mut [f32]],
    copy: Option<HalfSliceMut<'_>>,
    kernel: &F,
) where
    F: Fn(&mut [f32], &[f32], &mut [&mut [f32]]),
{
    let Some(mut copy) = copy else {
        kernel(p, g, state);
        return;
    };
    let mut start = 0;
    while start < p.len() {
        let end = (start + TILE).min(p.len());
        with_tile_of_state(state, start..end, |tile_state| {
            kernel(&mut p[start..end], &g[start..end], tile_state)
        });
        let (_, rest) = copy.reborrow().split_at_mut(start);
        let (mut tile_copy, _) = rest.split_at_mut(end - start);
        tile_copy.round_from(&p[start..end]);
        start = end;
    }
}

/// Runs `f` on elements `range` of every slice of `state`, without allocating for the usual one or
/// two state slices (this runs once per tile).
fn with_tile_of_state<R>(
    state: &mut [&mut [f32]],
    range: Range<usize>,
    f: impl FnOnce(&mut [&mut [f32]]) -> R,
) -> R {
    const INLINE: usize = 4;
    let count = state.len();
    if count <= INLINE {
        let mut tile: [&mut [f32]; INLINE] = Default::default();
        for (t, s) in tile.iter_mut().zip(state.iter_mut()) {
            *t = &mut s[range.clone()];
        }
        f(&mut tile[..count])
    } else {
        let mut tile: Vec<&mut [f32]> = state.iter_mut().map(|s| &mut s[range.clone()]).collect();
        f(&mut tile)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo_random(n: usize, seed: u32) -> Vec<f32> {
        let values = crate::optim::test_util::pseudo_random(n, seed);
        values.into_iter().map(|x| x as f32).collect()
    }

    #[test]
    fn split_adamw_equals_unsplit_bit_for_bit() {
        for n in [1usize, 2, 7, 64, 1001] {
            let g = pseudo_random(n, 1);
            let mut p1 = pseudo_random(n, 2);
            let mut m1 = pseudo_random(n, 3);
            let mut v1: Vec<f32> = pseudo_random(n, 4).iter().map(|x| x * x).collect();
            let (mut p2, mut m2, mut v2) = (p1.clone(), m1.clone(), v1.clone());
            let c = AdamWCoefficients::new(1e-2, 0.9, 0.999, 1e-8, 0.1, 3);
            let kernel = |p: &mut [f32], g: &[f32], s: &mut [&mut [f32]]| match s {
                [m, v] => adamw(p, g, m, v, &c),
                _ => unreachable!("two state slices"),
            };
            apply_split(
                &mut p1,
                &g,
                &mut [&mut m1, &mut v1],
                None,
                usize::MAX,
                &kernel,
            );
            apply_split(&mut p2, &g, &mut [&mut m2, &mut v2], None, 0, &kernel);
            assert_eq!(p1, p2, "n = {n}");
            assert_eq!(m1, m2, "n = {n}");
            assert_eq!(v1, v2, "n = {n}");
        }
    }

    #[test]
    fn split_with_empty_state_reaches_every_element() {
        let n = 1003;
        let g = vec![1.0f32; n];
        let mut p = vec![0.0f32; n];
        let c = SgdCoefficients {
            lr: 0.5,
            momentum: 0.0,
            one_minus_dampening: 1.0,
            weight_decay: 0.0,
            nesterov: false,
        };
        apply_split(&mut p, &g, &mut [], None, 0, &|p, g, _| {
            sgd(p, g, &mut [], true, &c)
        });
        assert!(
            p.iter().all(|&x| x == -0.5),
            "every element got p -= 0.5 * 1"
        );
    }

    #[test]
    fn lerp_matches_the_linear_combination() {
        // Both branches of PyTorch's lerp equal start + w (end - start) in exact arithmetic.
        for (s, e, w) in [(1.0f32, 3.0f32, 0.1f32), (1.0, 3.0, 0.9), (-2.0, 2.0, 0.5)] {
            let exact = s as f64 + w as f64 * (e as f64 - s as f64);
            assert!((lerp::<true>(s, e, w) as f64 - exact).abs() < 1e-6);
            assert!((lerp::<false>(s, e, w) as f64 - exact).abs() < 1e-6);
        }
    }
}
