//! Loops over the rows of a contiguous tensor, split over rayon's threads only when there is
//! enough work per thread to pay for the split.

use rayon::prelude::*;

/// Elements per rayon task below which a loop stays on the calling thread (a task costs a few
/// microseconds to hand out; 16 Ki elements of a row-wise kernel take tens of microseconds).
const ELEMENTS_PER_TASK: usize = 16 * 1024;

/// Rows per task for rows of `width` elements.
fn rows_per_task(width: usize) -> usize {
    (ELEMENTS_PER_TASK / width.max(1)).max(1)
}

/// Whether `elements` in all are worth splitting over threads.
fn parallel(elements: usize) -> bool {
    elements >= 2 * ELEMENTS_PER_TASK && rayon::current_num_threads() > 1
}

/// Calls `f(row_index, out_row)` for every row of `out` (rows of `width` elements).
pub(crate) fn for_each_row<T: Send>(
    out: &mut [T],
    width: usize,
    f: impl Fn(usize, &mut [T]) + Send + Sync,
) {
    if width == 0 {
        return;
    }
    if parallel(out.len()) {
        out.par_chunks_mut(width)
            .with_min_len(rows_per_task(width))
            .enumerate()
            .for_each(|(i, row)| f(i, row));
    } else {
        out.chunks_mut(width)
            .enumerate()
            .for_each(|(i, row)| f(i, row));
    }
}

/// Sums `f(first_row, end_row, partial)` over blocks of rows: each call adds the contributions of
/// rows `first_row..end_row` into `partial` (`len` zeros). The blocks depend on `rows` and `width`
/// only and their partial sums are added in block order, so the result is the same on any number
/// of threads.
pub(crate) fn sum_over_rows<A>(
    rows: usize,
    width: usize,
    len: usize,
    f: impl Fn(usize, usize, &mut [A]) + Send + Sync,
) -> Vec<A>
where
    A: num_traits::Float + Send + Sync,
{
    let block = rows_per_task(width);
    let blocks = rows.div_ceil(block);
    let partial = |b: usize| {
        let mut acc = vec![A::zero(); len];
        f(b * block, ((b + 1) * block).min(rows), &mut acc);
        acc
    };
    let partials: Vec<Vec<A>> = if parallel(rows * width) {
        (0..blocks).into_par_iter().map(partial).collect()
    } else {
        (0..blocks).map(partial).collect()
    };
    let mut total = vec![A::zero(); len];
    for p in partials {
        for (t, v) in total.iter_mut().zip(p) {
            *t = *t + v;
        }
    }
    total
}

/// `(rows, width)` of a tensor of `dims` seen as rows of its last dimension, or an error naming
/// `op` when it has no dimension.
pub(crate) fn rows_of(op: &str, what: &str, dims: &[usize]) -> candle_core::Result<(usize, usize)> {
    match dims.last() {
        Some(&width) => Ok((dims.iter().product::<usize>() / width.max(1), width)),
        None => candle_core::bail!("{op}: {what} is a scalar, expected at least one dimension"),
    }
}

/// Calls `f(row_index, out_row, partial)` for every row of `out` (rows of `width` elements) and
/// returns the sum of what the calls add into `partial` (`len` zeros per block of rows): a
/// backward pass that writes each row's input gradient and sums a parameter's gradient over rows
/// in one pass. Blocks and their order are as in [`sum_over_rows`]: the sum does not depend on
/// the number of threads.
pub(crate) fn for_each_row_summing<T, A>(
    out: &mut [T],
    width: usize,
    len: usize,
    f: impl Fn(usize, &mut [T], &mut [A]) + Send + Sync,
) -> Vec<A>
where
    T: Send,
    A: num_traits::Float + Send + Sync,
{
    if width == 0 {
        return vec![A::zero(); len];
    }
    let block = rows_per_task(width);
    let partial = |(b, rows): (usize, &mut [T])| {
        let mut acc = vec![A::zero(); len];
        for (i, row) in rows.chunks_mut(width).enumerate() {
            f(b * block + i, row, &mut acc);
        }
        acc
    };
    let partials: Vec<Vec<A>> = if parallel(out.len()) {
        out.par_chunks_mut(block * width)
            .enumerate()
            .map(partial)
            .collect()
    } else {
        out.chunks_mut(block * width)
            .enumerate()
            .map(partial)
            .collect()
    };
    let mut total = vec![A::zero(); len];
    for p in partials {
        for (t, v) in total.iter_mut().zip(p) {
            *t = *t + v;
        }
    }
    total
}
