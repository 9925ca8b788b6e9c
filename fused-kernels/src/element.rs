//! The element types the kernels take, and how a kernel reads its inputs out of candle's storage.
//!
//! Every kernel is generic over [`Element`]: f32 and f64 compute in their own precision, bf16 and
//! f16 are widened to f32 for the arithmetic and rounded once when stored.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, Layout, Result, Tensor};
use half::{bf16, f16};
use num_traits::Float;

/// A floating-point element of a tensor, with the type its arithmetic is done in.
pub(crate) trait Element: Copy + Send + Sync + 'static {
    /// The precision of the arithmetic: f32 for f32, bf16 and f16; f64 for f64.
    type Acc: Float + Send + Sync + std::iter::Sum + std::fmt::Debug + 'static;
    /// candle's name of the type.
    const DTYPE: DType;
    /// Widens to the arithmetic type.
    fn to_acc(self) -> Self::Acc;
    /// Rounds from the arithmetic type.
    fn from_acc(a: Self::Acc) -> Self;
    /// The storage's elements when it holds this type.
    fn slice(storage: &CpuStorage) -> Option<&[Self]>;
    /// The storage's elements, writable (for in-place ops), when it holds this type.
    fn slice_mut(storage: &mut CpuStorage) -> Option<&mut [Self]>;
    /// Wraps elements into storage.
    fn storage(values: Vec<Self>) -> CpuStorage;
    /// `n` zeros from the allocator's zeroed memory (no pass writing them).
    fn zeros(n: usize) -> Vec<Self>;
}

macro_rules! element {
    ($t:ty, $acc:ty, $variant:ident, $to:expr, $from:expr) => {
        impl Element for $t {
            type Acc = $acc;
            const DTYPE: DType = DType::$variant;
            #[inline(always)]
            fn to_acc(self) -> $acc {
                $to(self)
            }
            #[inline(always)]
            fn from_acc(a: $acc) -> Self {
                $from(a)
            }
            fn slice(storage: &CpuStorage) -> Option<&[Self]> {
                match storage {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(storage: &mut CpuStorage) -> Option<&mut [Self]> {
                match storage {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn storage(values: Vec<Self>) -> CpuStorage {
                CpuStorage::$variant(values)
            }
            fn zeros(n: usize) -> Vec<Self> {
                bytemuck::zeroed_vec(n)
            }
        }
    };
}

element!(f32, f32, F32, |x| x, |a| a);
element!(f64, f64, F64, |x| x, |a| a);
element!(bf16, f32, BF16, bf16::to_f32, bf16::from_f32);
element!(f16, f32, F16, f16::to_f32, f16::from_f32);

/// `x` as the arithmetic type `A` (a constant of a formula).
#[inline(always)]
pub(crate) fn constant<A: Float>(x: f64) -> A {
    A::from(x).expect("a float constant fits f32 and f64")
}

/// The contiguous elements of the input `what` of `op`, or an error naming the dtype or layout
/// problem. The public functions make their inputs contiguous, so the layout error means the op
/// was applied directly.
pub(crate) fn contiguous<'a, T: Element>(
    op: &str,
    what: &str,
    storage: &'a CpuStorage,
    layout: &Layout,
) -> Result<&'a [T]> {
    let values = T::slice(storage).ok_or_else(|| {
        candle_core::Error::Msg(format!(
            "{op}: {what} has dtype {:?}, expected {:?} like the first input",
            storage.dtype(),
            T::DTYPE
        ))
    })?;
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&values[start..end]),
        None => candle_core::bail!(
            "{op}: {what} is not contiguous (shape {:?}, strides {:?}); call the public function, \
             which makes its inputs contiguous",
            layout.dims(),
            layout.stride()
        ),
    }
}

/// Whether the kernels run on the device of `x`: the CPU always; a CUDA device with the `cuda`
/// feature, for a tensor with elements (an empty one takes the fallback, which launches nothing).
/// Elsewhere the public functions compute the formula with candle's ops ([`crate::fallback`]).
pub(crate) fn has_kernel(x: &Tensor) -> bool {
    match x.device() {
        Device::Cpu => true,
        Device::Cuda(_) => cfg!(feature = "cuda") && x.elem_count() > 0,
        _ => false,
    }
}

/// The error for a dtype the kernels do not compute in.
pub(crate) fn unsupported(op: &str, dtype: DType) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "{op}: dtype {dtype:?} is not supported; use f32, f64, bf16 or f16"
    ))
}

/// Calls the generic kernel `$f::<T>(args)` with `T` the element type of `$storage`.
macro_rules! dispatch {
    ($op:expr, $storage:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $storage {
            candle_core::CpuStorage::F32(_) => $f::<f32>($($arg),*),
            candle_core::CpuStorage::F64(_) => $f::<f64>($($arg),*),
            candle_core::CpuStorage::BF16(_) => $f::<half::bf16>($($arg),*),
            candle_core::CpuStorage::F16(_) => $f::<half::f16>($($arg),*),
            other => Err($crate::element::unsupported(
                $op,
                candle_core::backend::BackendStorage::dtype(other),
            )),
        }
    };
}
pub(crate) use dispatch;
