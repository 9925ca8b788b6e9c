//! Direct access to the data of CPU tensors (f32, and bf16/f16 for the half-precision copies of
//! mixed precision), for fused single-pass kernels (optimizer updates, gradient accumulation) that
//! would otherwise allocate a temporary tensor per elementwise op.
//!
//! candle exposes mutable storage only through in-place custom ops; these helpers wrap that in a
//! closure-taking API. They return `Ok(None)` when the tensor is not a CPU tensor of the expected
//! dtype laid out contiguously, so callers fall back to (allocating) tensor ops on other devices
//! and dtypes.

use std::ops::Range;
use std::sync::Mutex;

use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Storage, Tensor};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::error::Result;

/// Runs `f` on the elements of `tensor` in place, if it is a contiguous f32 CPU tensor.
///
/// Views (e.g. a parameter's slice of a flat gradient bucket) are honoured: `f` sees exactly the
/// elements of the view.
pub fn with_f32_mut<R>(tensor: &Tensor, f: impl FnOnce(&mut [f32]) -> R) -> Result<Option<R>> {
    if !tensor.device().is_cpu() || tensor.dtype() != DType::F32 {
        return Ok(None);
    }
    with_storage_mut(tensor, |storage, range| match storage {
        CpuStorage::F32(data) => Some(f(&mut data[range])),
        _ => None,
    })
}

/// The elements of a contiguous bf16 or f16 CPU tensor, mutable: where a fused update writes the
/// half-precision copy of the f32 values it computes.
#[derive(Debug)]
pub(crate) enum HalfSliceMut<'a> {
    /// bfloat16 elements.
    Bf16(&'a mut [bf16]),
    /// IEEE half-precision elements.
    F16(&'a mut [f16]),
}

impl<'a> HalfSliceMut<'a> {
    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            Self::Bf16(xs) => xs.len(),
            Self::F16(xs) => xs.len(),
        }
    }

    /// The first `mid` elements and the rest, as `slice::split_at_mut`.
    pub fn split_at_mut(self, mid: usize) -> (HalfSliceMut<'a>, HalfSliceMut<'a>) {
        match self {
            Self::Bf16(xs) => {
                let (a, b) = xs.split_at_mut(mid);
                (Self::Bf16(a), Self::Bf16(b))
            }
            Self::F16(xs) => {
                let (a, b) = xs.split_at_mut(mid);
                (Self::F16(a), Self::F16(b))
            }
        }
    }

    /// A shorter-lived borrow of the same elements.
    pub fn reborrow(&mut self) -> HalfSliceMut<'_> {
        match self {
            Self::Bf16(xs) => HalfSliceMut::Bf16(xs),
            Self::F16(xs) => HalfSliceMut::F16(xs),
        }
    }

    /// Writes `values` (as many as this slice has elements) rounded to nearest-even, with the
    /// `half` crate's conversions: those of `bf16::from_f32` and `f16::from_f32`, which candle's
    /// `to_dtype` applies on the CPU, so the result is bitwise what casting the f32 tensor would
    /// give. The slice form converts several elements per instruction where the CPU can (F16C).
    pub fn round_from(&mut self, values: &[f32]) {
        match self {
            Self::Bf16(xs) => xs.convert_from_f32_slice(values),
            Self::F16(xs) => xs.convert_from_f32_slice(values),
        }
    }
}

/// Runs `f` on the elements of `tensor` in place, if it is a contiguous bf16 or f16 CPU tensor.
pub(crate) fn with_half_mut<R>(
    tensor: &Tensor,
    f: impl FnOnce(HalfSliceMut<'_>) -> R,
) -> Result<Option<R>> {
    if !tensor.device().is_cpu() || !matches!(tensor.dtype(), DType::BF16 | DType::F16) {
        return Ok(None);
    }
    with_storage_mut(tensor, |storage, range| match storage {
        CpuStorage::BF16(data) => Some(f(HalfSliceMut::Bf16(&mut data[range]))),
        CpuStorage::F16(data) => Some(f(HalfSliceMut::F16(&mut data[range]))),
        _ => None,
    })
}

/// Runs `f` on the storage behind `tensor` and the range of its elements, in place, if the tensor
/// is laid out contiguously (candle hands out mutable storage only inside an in-place op); `f`
/// returns `None` for a storage it does not handle.
fn with_storage_mut<R>(
    tensor: &Tensor,
    f: impl FnOnce(&mut CpuStorage, Range<usize>) -> Option<R>,
) -> Result<Option<R>> {
    let op = ClosureOp {
        f: Mutex::new(Some(f)),
        result: Mutex::new(None),
    };
    tensor.inplace_op1(&op)?;
    let result = op.result.into_inner().unwrap_or_else(|e| e.into_inner());
    Ok(result.flatten())
}

/// Runs `f` on the elements of `tensor`, read-only, if it is a contiguous f32 CPU tensor.
pub fn with_f32<R>(tensor: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<Option<R>> {
    if !tensor.device().is_cpu() || tensor.dtype() != DType::F32 {
        return Ok(None);
    }
    let (storage, layout) = tensor.storage_and_layout();
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Ok(None);
    };
    match &*storage {
        Storage::Cpu(CpuStorage::F32(data)) => Ok(Some(f(&data[start..end]))),
        _ => Ok(None),
    }
}

/// Runs `f` on the elements of a transposed 2-D f32 CPU tensor — the layout candle gives the
/// gradient of every `Linear` weight, `[rows, cols]` with strides `[1, rows]` — as the contiguous
/// `[cols, rows]` matrix it views. Returns `Ok(None)` for any other layout.
pub fn with_f32_transposed<R>(tensor: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<Option<R>> {
    if !tensor.device().is_cpu() || tensor.dtype() != DType::F32 || tensor.rank() != 2 {
        return Ok(None);
    }
    let (storage, layout) = tensor.storage_and_layout();
    let (rows, cols) = (layout.dims()[0], layout.dims()[1]);
    if layout.stride() != [1, rows] {
        return Ok(None);
    }
    let start = layout.start_offset();
    match &*storage {
        Storage::Cpu(CpuStorage::F32(data)) if data.len() >= start + rows * cols => {
            Ok(Some(f(&data[start..start + rows * cols])))
        }
        _ => Ok(None),
    }
}

struct ClosureOp<F, R> {
    f: Mutex<Option<F>>,
    result: Mutex<Option<Option<R>>>,
}

impl<F: FnOnce(&mut CpuStorage, Range<usize>) -> Option<R>, R> InplaceOp1 for ClosureOp<F, R> {
    fn name(&self) -> &'static str {
        "accelerate-cpu-slice"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Ok(());
        };
        let f = self
            .f
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .expect("closure op runs once");
        let r = f(storage, start..end);
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        Ok(())
    }
}

/// Whether every element of `tensor` is finite (no inf, no NaN): over the f32 slice where there
/// is one, else through an f64 sum, which is finite exactly when every element is.
pub fn all_finite(tensor: &Tensor) -> Result<bool> {
    match with_f32(tensor, |xs| xs.iter().all(|x| x.is_finite()))? {
        Some(finite) => Ok(finite),
        None => Ok(tensor
            .to_dtype(candle_core::DType::F64)?
            .sum_all()?
            .to_scalar::<f64>()?
            .is_finite()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn writes_through_a_view_only_touch_the_view() {
        let flat = Tensor::zeros(6, candle_core::DType::F32, &Device::Cpu).unwrap();
        let view = flat.narrow(0, 2, 3).unwrap().reshape((3, 1)).unwrap();
        let touched = with_f32_mut(&view, |xs| {
            for x in xs.iter_mut() {
                *x = 7.0;
            }
            xs.len()
        })
        .unwrap();
        assert_eq!(touched, Some(3));
        assert_eq!(
            flat.to_vec1::<f32>().unwrap(),
            vec![0.0, 0.0, 7.0, 7.0, 7.0, 0.0]
        );
        let sum = with_f32(&view, |xs| xs.iter().sum::<f32>()).unwrap();
        assert_eq!(sum, Some(21.0));
    }

    #[test]
    fn a_transposed_matrix_is_read_as_the_matrix_it_views() {
        let m = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &Device::Cpu).unwrap();
        let t = m.t().unwrap();
        let seen = with_f32_transposed(&t, |xs| xs.to_vec()).unwrap();
        assert_eq!(seen, Some(vec![1., 2., 3., 4., 5., 6.]));
        assert_eq!(with_f32_transposed(&m, |xs| xs.len()).unwrap(), None);
    }

    #[test]
    fn non_contiguous_and_other_dtypes_are_declined() {
        let t = Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert_eq!(with_f32(&t.t().unwrap(), |xs| xs.len()).unwrap(), None);
        let d = Tensor::zeros(3, candle_core::DType::F64, &Device::Cpu).unwrap();
        assert_eq!(with_f32_mut(&d, |xs| xs.len()).unwrap(), None);
    }
}
