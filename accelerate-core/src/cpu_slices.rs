//! Direct access to the f32 data of CPU tensors, for fused single-pass kernels (optimizer updates,
//! gradient accumulation) that would otherwise allocate a temporary tensor per elementwise op.
//!
//! candle exposes mutable storage only through in-place custom ops; these helpers wrap that in a
//! closure-taking API. They return `Ok(None)` when the tensor is not an f32 CPU tensor laid out
//! contiguously, so callers fall back to (allocating) tensor ops on other devices and dtypes.

use std::sync::Mutex;

use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor};

use crate::error::Result;

/// Runs `f` on the elements of `tensor` in place, if it is a contiguous f32 CPU tensor.
///
/// Views (e.g. a parameter's slice of a flat gradient bucket) are honoured: `f` sees exactly the
/// elements of the view.
pub fn with_f32_mut<R>(tensor: &Tensor, f: impl FnOnce(&mut [f32]) -> R) -> Result<Option<R>> {
    if !tensor.device().is_cpu() || tensor.dtype() != candle_core::DType::F32 {
        return Ok(None);
    }
    let op = ClosureOp {
        f: Mutex::new(Some(f)),
        result: Mutex::new(None),
    };
    tensor.inplace_op1(&op)?;
    let result = op.result.into_inner().unwrap_or_else(|e| e.into_inner());
    Ok(result)
}

/// Runs `f` on the elements of `tensor`, read-only, if it is a contiguous f32 CPU tensor.
pub fn with_f32<R>(tensor: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<Option<R>> {
    if !tensor.device().is_cpu() || tensor.dtype() != candle_core::DType::F32 {
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
    if !tensor.device().is_cpu() || tensor.dtype() != candle_core::DType::F32 || tensor.rank() != 2
    {
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
    result: Mutex<Option<R>>,
}

impl<F: FnOnce(&mut [f32]) -> R, R> InplaceOp1 for ClosureOp<F, R> {
    fn name(&self) -> &'static str {
        "accelerate-cpu-slice"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Ok(());
        };
        let CpuStorage::F32(data) = storage else {
            return Ok(());
        };
        let f = self
            .f
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .expect("closure op runs once");
        let r = f(&mut data[start..end]);
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        Ok(())
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
