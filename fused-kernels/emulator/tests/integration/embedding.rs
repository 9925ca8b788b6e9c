//! The embedding lookup and its gradient (`embedding.cu`, u32 and i64 ids), against
//! `fused_kernels::embedding` and its gradient through candle's `backward()`.
//!
//! No tolerance: the lookup copies rows, and the kernel and the CPU op both sum each gradient
//! element over its positions in increasing order, from 0, in the arithmetic type, and round once:
//! the same bits. Ids that name no row (CUDA only; the CPU op refuses them) give NaN rows and add
//! nothing to the gradient: checked against the CPU op run on the other positions alone.

use crate::common::{flat, fused, in_both_orders, name, read, run, run_shared, Dt, Input, Shape};
use candle_core::{Device, Tensor, Var};
use fused_kernels_emulator::{Arg, Buffer, Element, Order};

/// (v, c, n): one row of one column; repeated ids in a small table; a 59-row vocabulary whose
/// 3000 ids fall in few blocks (many chunks of ids per block, hot rows); more rows than one tile.
const CASES: [(usize, usize, usize); 4] = [(1, 1, 1), (11, 7, 13), (59, 100, 3000), (300, 33, 500)];

/// `n` ids below `v` in which three ids (0, v − 1, v / 2) take every fourth position, as common
/// tokens do, and the others are spread over the table.
fn ids_for(n: usize, v: usize) -> Vec<u32> {
    crate::common::values(n, 83, 0.0, 1.0)
        .iter()
        .enumerate()
        .map(|(p, x)| match p % 4 {
            0 => [0, v - 1, v / 2][p % 3] as u32,
            _ => ((x * v as f64) as usize).min(v - 1) as u32,
        })
        .collect()
}

/// An id type of the kernels: its name in the kernels' names (`IN_NAMES`) and its conversion.
trait Id: Element {
    const IN_NAMES: &'static str;
    fn from_i64(x: i64) -> Self;
}
impl Id for u32 {
    const IN_NAMES: &'static str = "u32";
    fn from_i64(x: i64) -> Self {
        x as u32
    }
}
impl Id for i64 {
    const IN_NAMES: &'static str = "i64";
    fn from_i64(x: i64) -> Self {
        x
    }
}

/// Asserts that `got` and `want` are the same bits (NaN = NaN).
fn assert_same(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    if let Some(i) = got
        .iter()
        .zip(want)
        .position(|(g, w)| g.to_bits() != w.to_bits() && !(g.is_nan() && w.is_nan()))
    {
        panic!(
            "{what}: [{i}] is {:e}, the CPU op's is {:e}",
            got[i], want[i]
        );
    }
}

/// The kernels' output and gradient for `ids` (as `I`), `table` and `dy`, with the forward launch
/// `fwd`, and the backward launch `bwd` of `rows` × `cols` tiles.
#[allow(clippy::too_many_arguments)]
fn kernels<T: Dt, I: Id>(
    table: &Input<T>,
    dy: &Input<T>,
    ids: &[i64],
    v: usize,
    c: usize,
    fwd: Shape,
    (bwd, rows, cols): (Shape, usize, usize),
    order: Order,
) -> Vec<Vec<f64>> {
    let n = ids.len();
    let ids: Vec<I> = ids.iter().map(|&x| I::from_i64(x)).collect();
    let (tb, gb) = (table.buffer(), dy.buffer());
    let ib = Buffer::from_slice(&ids).unwrap();
    let mut out = Buffer::<T>::poisoned(n * c).unwrap();
    let mut grad = Buffer::<T>::poisoned(v * c).unwrap();
    let (n64, v64, c64) = (n as u64, v as u64, c as u64);
    run(
        &name::<T>(&format!("embedding_{}", I::IN_NAMES)),
        fwd,
        &[
            Arg::ptr(&tb),
            Arg::ptr(&ib),
            Arg::ptr_mut(&mut out),
            Arg::U64(n64),
            Arg::U64(v64),
            Arg::U64(c64),
        ],
        order,
    );
    run_shared(
        &name::<T>(&format!("embedding_backward_{}", I::IN_NAMES)),
        bwd,
        rows * cols * std::mem::size_of::<T::Acc>(),
        &[
            Arg::ptr(&gb),
            Arg::ptr(&ib),
            Arg::ptr_mut(&mut grad),
            Arg::U64(n64),
            Arg::U64(v64),
            Arg::U64(c64),
            Arg::U64(rows as u64),
            Arg::U64(cols as u64),
        ],
        order,
    );
    vec![read(&out), read(&grad)]
}

/// The CPU op's output and table gradient of `Σ embedding(ids, table) · dy`.
fn cpu<T: Dt>(table: &Input<T>, dy: &Tensor, ids: &[u32]) -> (Vec<f64>, Vec<f64>) {
    let ids = Tensor::from_vec(ids.to_vec(), ids.len(), &Device::Cpu).unwrap();
    let tv = Var::from_tensor(&table.tensor).unwrap();
    let out = fused_kernels::embedding(&ids, &tv).unwrap();
    let grads = (&out * dy).unwrap().sum_all().unwrap().backward().unwrap();
    (flat(&out), flat(grads.get(&tv).unwrap()))
}

fn check<T: Dt>(v: usize, c: usize, n: usize) {
    let table = Input::<T>::random(&[v, c], 81, -1.0, 1.0);
    let dy = Input::<T>::random(&[n, c], 82, -1.0, 1.0);
    let ids = ids_for(n, v);
    let (want_out, want_grad) = cpu(&table, &dy.tensor, &ids);
    let ids: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
    let (ours, rows, cols, _) = fused::embedding_backward(v, c, std::mem::size_of::<T::Acc>());
    // Another tiling: 3 rows by 5 columns per block (column tiles), 64 threads (fewer than the
    // columns of a wide tile would have), several blocks of the forward's grid-stride loop.
    let (r2, c2) = (3.min(v), 5.min(c));
    let other = (
        Shape {
            grid: (v.div_ceil(r2) * c.div_ceil(c2)) as u32,
            block: 64,
        },
        r2,
        c2,
    );
    for (fwd, bwd) in [
        (fused::elements_config(n * c), (ours, rows, cols)),
        (Shape { grid: 3, block: 96 }, other),
    ] {
        let what = format!("embedding [{v}, {c}] × {n} ids, {fwd:?}, backward {bwd:?}");
        for kind in ["u32", "i64"] {
            let what = format!("{what}, {kind} ids");
            let got = in_both_orders(&what, |order| match kind {
                "u32" => kernels::<T, u32>(&table, &dy, &ids, v, c, fwd, bwd, order),
                _ => kernels::<T, i64>(&table, &dy, &ids, v, c, fwd, bwd, order),
            });
            assert_same(&format!("{what}: rows"), &got[0], &want_out);
            assert_same(&format!("{what}: d_table"), &got[1], &want_grad);
        }
    }
}

/// Ids that name no row: negative (i64) or `>= v`. Their output rows are NaN; the gradient is
/// the CPU op's over the other positions.
fn out_of_range_ids<T: Dt>() {
    let (v, c) = (7, 5);
    let ids: Vec<i64> = vec![3, -1, 6, 7, 3, 1_000_000, 0, 3];
    let bad = |i: i64| i < 0 || i >= v as i64;
    let n = ids.len();
    let table = Input::<T>::random(&[v, c], 84, -1.0, 1.0);
    let dy = Input::<T>::random(&[n, c], 85, -1.0, 1.0);
    let good: Vec<usize> = (0..n).filter(|&p| !bad(ids[p])).collect();
    let good_ids: Vec<u32> = good.iter().map(|&p| ids[p] as u32).collect();
    let good_rows = Tensor::from_vec(
        good.iter().map(|&p| p as u32).collect::<Vec<_>>(),
        good.len(),
        &Device::Cpu,
    )
    .unwrap();
    let good_dy = dy.tensor.index_select(&good_rows, 0).unwrap();
    let (rows_out, want_grad) = cpu(&table, &good_dy, &good_ids);
    let (shape, rows, cols, _) = fused::embedding_backward(v, c, std::mem::size_of::<T::Acc>());
    let fwd = fused::elements_config(n * c);
    for kind in ["u32", "i64"] {
        let what = format!("embedding with ids {ids:?} as {kind}");
        let got = match kind {
            // As u32, −1 is 4 294 967 295: also outside the table.
            "u32" => kernels::<T, u32>(
                &table,
                &dy,
                &ids,
                v,
                c,
                fwd,
                (shape, rows, cols),
                Order::Increasing,
            ),
            _ => kernels::<T, i64>(
                &table,
                &dy,
                &ids,
                v,
                c,
                fwd,
                (shape, rows, cols),
                Order::Increasing,
            ),
        };
        for (p, &id) in ids.iter().enumerate() {
            let row = &got[0][p * c..(p + 1) * c];
            if bad(id) {
                assert!(row.iter().all(|x| x.is_nan()), "{what}: row {p} {row:?}");
            } else {
                let k = good.iter().position(|&q| q == p).unwrap();
                assert_same(
                    &format!("{what}: row {p}"),
                    row,
                    &rows_out[k * c..(k + 1) * c],
                );
            }
        }
        assert_same(&format!("{what}: d_table"), &got[1], &want_grad);
    }
}

macro_rules! tests {
    ($($test:ident, $bad:ident: $t:ty;)*) => {$(
        #[test]
        fn $test() {
            for (v, c, n) in CASES {
                check::<$t>(v, c, n);
            }
        }

        #[test]
        fn $bad() {
            out_of_range_ids::<$t>();
        }
    )*};
}
tests! {
    embedding_f32, embedding_out_of_range_f32: f32;
    embedding_f64, embedding_out_of_range_f64: f64;
    embedding_bf16, embedding_out_of_range_bf16: half::bf16;
    embedding_f16, embedding_out_of_range_f16: half::f16;
}
