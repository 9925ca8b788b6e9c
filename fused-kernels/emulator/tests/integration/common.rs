//! What the kernel tests share: the element types, inputs, the CPU reference's tensors, fused-kernels'
//! launch shapes, runs in both scheduling orders, and the comparison with a tolerance.

use candle_core::{DType, Device, Tensor, WithDType};
use fused_kernels_emulator::{launch, Arg, Buffer, Element, Order};
use half::{bf16, f16};

/// An element type the kernels are instantiated for, with what its comparisons need.
pub trait Dt: Element + WithDType {
    /// The kernels' name suffix.
    const SUFFIX: &'static str;
    /// The arithmetic type of the kernels (f32, or f64 for f64).
    type Acc: Dt;
    /// The unit roundoff of the arithmetic type.
    const U: f64;
    /// The spacing of `T` at `x`: how far one rounding of a result to `T` can move it beyond the
    /// arithmetic type's own error (0 when `T` is the arithmetic type).
    fn step(x: f64) -> f64;
}

/// The spacing of a binary float with `bits` significant bits and smallest normal exponent
/// `min_exp` at `x`.
fn spacing(x: f64, bits: i32, min_exp: i32) -> f64 {
    let e = if x == 0.0 || !x.is_finite() {
        min_exp
    } else {
        (x.abs().log2().floor() as i32).max(min_exp)
    };
    2f64.powi(e - (bits - 1))
}

impl Dt for f32 {
    const SUFFIX: &'static str = "f32";
    type Acc = f32;
    const U: f64 = f32::EPSILON as f64 / 2.0;
    fn step(_: f64) -> f64 {
        0.0
    }
}
impl Dt for f64 {
    const SUFFIX: &'static str = "f64";
    type Acc = f64;
    const U: f64 = f64::EPSILON / 2.0;
    fn step(_: f64) -> f64 {
        0.0
    }
}
impl Dt for bf16 {
    const SUFFIX: &'static str = "bf16";
    type Acc = f32;
    const U: f64 = f32::EPSILON as f64 / 2.0;
    fn step(x: f64) -> f64 {
        spacing(x, 8, -126)
    }
}
impl Dt for f16 {
    const SUFFIX: &'static str = "f16";
    type Acc = f32;
    const U: f64 = f32::EPSILON as f64 / 2.0;
    fn step(x: f64) -> f64 {
        spacing(x, 11, -14)
    }
}

/// `<kernel>_<suffix>`.
pub fn name<T: Dt>(kernel: &str) -> String {
    format!("{kernel}_{}", T::SUFFIX)
}

/// `n` deterministic values in `[lo, hi)` (xorshift from `seed`).
pub fn values(n: usize, seed: u64, lo: f64, hi: f64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            lo + (hi - lo) * ((s >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect()
}

/// An input: the CPU tensor (dtype `T`, so the values are rounded to `T` once) and the same
/// values as `T` for the emulator.
pub struct Input<T: Dt> {
    pub tensor: Tensor,
    pub data: Vec<T>,
}

impl<T: Dt> Input<T> {
    /// `values` of `shape`, rounded to `T`.
    pub fn new(values: Vec<f64>, shape: &[usize]) -> Self {
        let tensor = Tensor::from_vec(values, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(T::DTYPE)
            .unwrap();
        let data = tensor.flatten_all().unwrap().to_vec1::<T>().unwrap();
        Input { tensor, data }
    }

    /// Pseudo-random values in `[lo, hi)`.
    pub fn random(shape: &[usize], seed: u64, lo: f64, hi: f64) -> Self {
        Self::new(values(shape.iter().product(), seed, lo, hi), shape)
    }

    /// The values as f64 (exact).
    pub fn f64s(&self) -> Vec<f64> {
        self.data.iter().map(|v| v.to_f64()).collect()
    }

    /// A device buffer of the values.
    pub fn buffer(&self) -> Buffer<T> {
        Buffer::from_slice(&self.data).unwrap()
    }
}

/// The elements of a CPU tensor as f64.
pub fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The elements of a buffer as f64.
pub fn read<T: Element + WithDType>(b: &Buffer<T>) -> Vec<f64> {
    b.as_slice().iter().map(|v| v.to_f64()).collect()
}

/// A launch shape (1-D, as fused-kernels launches every kernel).
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub grid: u32,
    pub block: u32,
}

/// Launches `kernel` with `shape` and no dynamic shared memory, panicking with the emulator's
/// error.
pub fn run(kernel: &str, shape: Shape, args: &[Arg<'_>], order: Order) {
    if let Err(e) = launch(kernel, shape.grid, shape.block, 0, args, order) {
        panic!("{kernel} with {shape:?} in {order:?} order: {e}");
    }
}

/// Launches `kernel` with `shape` and `shared` bytes of dynamic shared memory, panicking with the
/// emulator's error.
pub fn run_shared(kernel: &str, shape: Shape, shared: usize, args: &[Arg<'_>], order: Order) {
    if let Err(e) = launch(kernel, shape.grid, shape.block, shared, args, order) {
        panic!(
            "{kernel} with {shape:?} and {shared} bytes of shared memory in {order:?} order: {e}"
        );
    }
}

/// fused-kernels' launch shapes, as `fused-kernels/src/cuda.rs` computes them (its functions are
/// private to the `cuda` feature, so they are restated here; a change there must be made here).
pub mod fused {
    use super::Shape;

    const ROW_THREADS: usize = 256;
    const MAX_ROW_BLOCKS: usize = 65_535;
    const PARTIAL_BLOCKS: usize = 512;
    const MAX_PARTIALS: usize = 1 << 24;
    const ELEMENT_THREADS: usize = 256;
    const MAX_ELEMENT_BLOCKS: usize = 4096;

    /// Blocks of the first pass of a reduction over `rows` rows into `len` sums per block.
    pub fn partial_blocks(rows: usize, len: usize) -> usize {
        rows.min(PARTIAL_BLOCKS)
            .min(MAX_PARTIALS / len.max(1))
            .max(1)
    }

    fn row_threads(width: usize) -> u32 {
        width.div_ceil(32).clamp(1, ROW_THREADS / 32) as u32 * 32
    }

    /// One block per row.
    pub fn rows_config(rows: usize, width: usize) -> Shape {
        blocks_over_rows(rows.clamp(1, MAX_ROW_BLOCKS), width)
    }

    /// `blocks` blocks of row threads.
    pub fn blocks_over_rows(blocks: usize, width: usize) -> Shape {
        Shape {
            grid: blocks.max(1) as u32,
            block: row_threads(width),
        }
    }

    /// A grid-stride launch over `n` elements.
    pub fn elements_config(n: usize) -> Shape {
        Shape {
            grid: n.div_ceil(ELEMENT_THREADS).clamp(1, MAX_ELEMENT_BLOCKS) as u32,
            block: ELEMENT_THREADS as u32,
        }
    }

    /// One thread per column.
    pub fn columns_config(len: usize) -> Shape {
        elements_config(len)
    }

    /// One block of 1024 threads.
    pub fn one_block() -> Shape {
        Shape {
            grid: 1,
            block: 1024,
        }
    }

    /// The embedding backward's tiles (`BackwardTiles` of `src/embedding.rs`) for a `[v, c]`
    /// gradient accumulated in values of `acc_bytes` bytes: `(launch, rows per block, columns per
    /// block, dynamic shared memory bytes)`.
    pub fn embedding_backward(
        v: usize,
        c: usize,
        acc_bytes: usize,
    ) -> (Shape, usize, usize, usize) {
        const ACCUMULATOR_BYTES: usize = 40 * 1024;
        const MAX_THREADS: usize = 1024;
        let capacity = ACCUMULATOR_BYTES / acc_bytes;
        let cols = c.clamp(1, capacity);
        let rows = (capacity / cols).clamp(1, v.max(1));
        let blocks = v.div_ceil(rows).max(1) * c.div_ceil(cols).max(1);
        let shape = Shape {
            grid: blocks as u32,
            block: (cols.div_ceil(32) * 32).clamp(32, MAX_THREADS) as u32,
        };
        (shape, rows, cols, rows * cols * acc_bytes)
    }
}

/// Runs `f` in both scheduling orders and checks that they give the same bits: a kernel whose
/// threads race (a missing barrier) computes different results in the two orders. Returns the
/// results of the increasing order.
pub fn in_both_orders(what: &str, f: impl Fn(Order) -> Vec<Vec<f64>>) -> Vec<Vec<f64>> {
    let up = f(Order::Increasing);
    let down = f(Order::Decreasing);
    for (k, (a, b)) in up.iter().zip(&down).enumerate() {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                x.to_bits() == y.to_bits(),
                "{what}: output {k}[{i}] is {x:e} with threads in increasing order but {y:e} in \
                 decreasing order: the kernel's threads race (a missing __syncthreads?)"
            );
        }
    }
    up
}

/// Checks `got` against the CPU's `want`, element by element:
/// `|got − want| ≤ rtol · (|want| + floor_i) + step_T(want)`. `rtol` bounds the arithmetic
/// type's error of the computation (both sides compute the same formula, in different orders
/// where they reduce), `floor_i` is the magnitude that error is relative to where the result can
/// be smaller than its terms (a sum that cancels, a difference), and `step_T` allows one more
/// rounding step of the stored type `T` (the two results may round to neighbours). NaN must be
/// NaN on both sides.
pub fn assert_close<T: Dt>(
    what: &str,
    got: &[f64],
    want: &[f64],
    rtol: f64,
    floor: impl Fn(usize) -> f64,
) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let mut bad = Vec::new();
    let mut worst: f64 = 0.0;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() || g.is_nan() {
            if !(w.is_nan() && g.is_nan()) {
                bad.push(format!("[{i}]: got {g:e}, want {w:e}"));
            }
            continue;
        }
        let allowed = rtol * (w.abs() + floor(i)) + T::step(w);
        let diff = (g - w).abs();
        if allowed > 0.0 {
            worst = worst.max(diff / allowed);
        }
        if diff > allowed {
            bad.push(format!(
                "[{i}]: got {g:e}, want {w:e}, difference {diff:e} > allowed {allowed:e}"
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "{what} ({}): {} of {} elements differ from the CPU reference beyond the tolerance:\n{}",
        T::SUFFIX,
        bad.len(),
        got.len(),
        bad.iter().take(8).cloned().collect::<Vec<_>>().join("\n")
    );
    if std::env::var_os("EMULATOR_TEST_VERBOSE").is_some() {
        eprintln!(
            "{what} ({}): worst difference {worst:.3} of the tolerance",
            T::SUFFIX
        );
    }
}
