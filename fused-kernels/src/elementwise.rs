//! Element-wise loops in the arithmetic type, split over rayon's threads in chunks when the
//! tensor is large enough (the shared body of GELU, SiLU and SwiGLU).

use crate::element::Element;
use rayon::prelude::*;

/// Elements per parallel task.
const CHUNK: usize = 8192;

/// Whether `n` elements are worth splitting over threads.
fn parallel(n: usize) -> bool {
    n >= 4 * CHUNK && rayon::current_num_threads() > 1
}

/// `f(x)` for every element. The output is collected, not zeroed first and overwritten.
pub(crate) fn map_unary<T: Element>(x: &[T], f: impl Fn(T::Acc) -> T::Acc + Send + Sync) -> Vec<T> {
    let one = |x: &T| T::from_acc(f(x.to_acc()));
    if parallel(x.len()) {
        x.par_iter().with_min_len(CHUNK).map(one).collect()
    } else {
        x.iter().map(one).collect()
    }
}

/// `f(a, b)` for every pair of elements (`a` and `b` of one length), collected.
pub(crate) fn map_binary<T: Element>(
    a: &[T],
    b: &[T],
    f: impl Fn(T::Acc, T::Acc) -> T::Acc + Send + Sync,
) -> Vec<T> {
    debug_assert_eq!(a.len(), b.len());
    let one = |(a, b): (&T, &T)| T::from_acc(f(a.to_acc(), b.to_acc()));
    if parallel(a.len()) {
        a.par_iter().zip(b).with_min_len(CHUNK).map(one).collect()
    } else {
        a.iter().zip(b).map(one).collect()
    }
}

/// Two results `f(a, b, c) = (p, q)` for every triple of elements, stored as `[p..., q...]`
/// (length `2 · a.len()`), so that a backward op can return two gradients in one tensor.
pub(crate) fn map_ternary_to_pair<T: Element>(
    a: &[T],
    b: &[T],
    c: &[T],
    f: impl Fn(T::Acc, T::Acc, T::Acc) -> (T::Acc, T::Acc) + Send + Sync,
) -> Vec<T> {
    debug_assert!(a.len() == b.len() && a.len() == c.len());
    let mut out = vec![T::from_acc(num_traits::Zero::zero()); 2 * a.len()];
    let (first, second) = out.split_at_mut(a.len());
    type Chunks<'a, T> = (((&'a mut [T], &'a mut [T]), &'a [T]), (&'a [T], &'a [T]));
    let body = |(((p, q), a), (b, c)): Chunks<'_, T>| {
        for ((((p, q), &a), &b), &c) in p.iter_mut().zip(q.iter_mut()).zip(a).zip(b).zip(c) {
            let (x, y) = f(a.to_acc(), b.to_acc(), c.to_acc());
            *p = T::from_acc(x);
            *q = T::from_acc(y);
        }
    };
    if parallel(a.len()) {
        first
            .par_chunks_mut(CHUNK)
            .zip(second.par_chunks_mut(CHUNK))
            .zip(a.par_chunks(CHUNK))
            .zip(b.par_chunks(CHUNK).zip(c.par_chunks(CHUNK)))
            .for_each(body);
    } else {
        body((((first, second), a), (b, c)));
    }
    out
}
