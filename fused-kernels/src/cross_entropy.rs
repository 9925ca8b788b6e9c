//! Weighted, summed cross-entropy from logits: log-softmax, the target's pick, the weights and the
//! sum in one op (PyTorch: `(F.cross_entropy(logits, targets, reduction="none") * weights).sum()`).

#[cfg(feature = "cuda")]
use crate::cuda::{
    cuda_dispatch, input, launch, one_block, output, rows_config, storage, CudaElement,
    CROSS_ENTROPY,
};
use crate::element::{constant, contiguous, dispatch, Element};
use crate::rows::for_each_row;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use num_traits::{Float, One, ToPrimitive, Zero};
use rayon::prelude::*;

/// The summed weighted cross-entropy of `logits` `[n, v]` against `targets` `[n]` (class indices,
/// u32; other integer dtypes are converted) with `weights` `[n]`:
/// `loss = Σ_i w_i · (logsumexp(logits_i) − logits_i[targets_i])`, a scalar.
///
/// A row of weight 0 contributes exactly 0 and is not read past its target check (padding may hold
/// anything). Every target must be `< v`: on the CPU another one is an error naming it; on CUDA
/// it makes the loss (and that row's gradient) NaN, since naming it would need the targets on the
/// host, a synchronization in every step. There is no `ignore_index`: give a row to ignore weight
/// 0 and any class (0), not PyTorch's -100, which a u32 cast turns into a huge index.
///
/// The gradient goes to `logits` only: `d_logits_ij = dloss · w_i · (softmax(logits_i)_j − [j =
/// targets_i])`. The loss is f64 for f64 logits and f32 otherwise (bf16/f16 logits are computed in
/// f32); `weights` may be any float dtype (read as f64).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor, weights: &Tensor) -> Result<Tensor> {
    let (n, v) = match logits.dims() {
        &[n, v] => (n, v),
        dims => candle_core::bail!("cross_entropy: logits must have shape [n, v], got {dims:?}"),
    };
    for (what, t) in [("targets", targets), ("weights", weights)] {
        if t.dims() != [n] {
            candle_core::bail!(
                "cross_entropy: {what} must have shape [{n}] (one per row of logits {:?}), got {:?}",
                logits.dims(),
                t.dims()
            );
        }
    }
    if v == 0 {
        candle_core::bail!("cross_entropy: logits {:?} have no classes", logits.dims());
    }
    let targets = class_indices("cross_entropy", targets)?;
    if !weights.dtype().is_float() {
        candle_core::bail!(
            "cross_entropy: weights must be floats, got {:?}",
            weights.dtype()
        );
    }
    if !crate::element::has_kernel(logits) {
        // candle's gather asserts on the device (CUDA) for a target out of range, which kills the
        // context with no word of the cause: check first, at the price of one read.
        if n > 0 {
            let largest = targets.max_all()?.to_scalar::<u32>()?;
            if largest as usize >= v {
                candle_core::bail!(
                    "cross_entropy: a target is {largest}, which is not a class of logits {:?} \
                     (targets must be below {v})",
                    logits.dims()
                );
            }
        }
        return crate::fallback::cross_entropy(&logits.contiguous()?, &targets, weights);
    }
    // The CUDA kernels read the weights in the loss dtype; the CPU kernel reads any float dtype.
    let weights = if logits.device().is_cuda() {
        let loss_dtype = if logits.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        weights.to_dtype(loss_dtype)?
    } else {
        weights.clone()
    };
    logits
        .contiguous()?
        .apply_op3(&targets, &weights.contiguous()?, CrossEntropy)
}

/// `targets` as contiguous u32 class indices (other integer dtypes converted), or an error naming
/// `op` for a dtype that holds no class indices.
pub(crate) fn class_indices(op: &str, targets: &Tensor) -> Result<Tensor> {
    match targets.dtype() {
        DType::U32 => targets.contiguous(),
        DType::U8 | DType::I64 | DType::I32 | DType::I16 => targets.to_dtype(DType::U32),
        other => candle_core::bail!(
            "{op}: targets must be class indices (u32, or an integer dtype), got {other:?}"
        ),
    }
}

/// The contiguous u32 targets of a CUDA op (the public function converts them to u32).
#[cfg(feature = "cuda")]
pub(crate) fn cuda_targets<'a>(
    op: &str,
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, u32>> {
    if candle_core::backend::BackendStorage::dtype(s) != DType::U32 {
        candle_core::bail!("{op}: targets must be u32 (the public function converts them)");
    }
    let Some((start, end)) = l.contiguous_offsets() else {
        candle_core::bail!("{op}: targets are not contiguous");
    };
    Ok(s.as_cuda_slice::<u32>()?.slice(start..end))
}

/// The targets as indices, unchecked.
pub(crate) fn class_targets<'a>(op: &str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [u32]> {
    let CpuStorage::U32(t) = s else {
        candle_core::bail!("{op}: targets must be u32 (the public function converts them)");
    };
    let Some((start, end)) = l.contiguous_offsets() else {
        candle_core::bail!("{op}: targets are not contiguous");
    };
    Ok(&t[start..end])
}

/// The targets as indices, each checked against `v` classes.
pub(crate) fn checked_targets<'a>(
    op: &str,
    s: &'a CpuStorage,
    l: &Layout,
    v: usize,
) -> Result<&'a [u32]> {
    let t = class_targets(op, s, l)?;
    if let Some((i, bad)) = t.iter().enumerate().find(|(_, &c)| c as usize >= v) {
        candle_core::bail!("{op}: targets[{i}] = {bad} is not a class of the {v} logits per row");
    }
    Ok(t)
}

/// Float weights (any float dtype) as f64.
pub(crate) fn weights_f64(op: &str, s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    fn read<T: Element>(op: &str, s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
        let w = contiguous::<T>(op, "weights", s, l)?;
        Ok(w.iter()
            .map(|w| w.to_acc().to_f64().unwrap_or(f64::NAN))
            .collect())
    }
    dispatch!(op, s, read(op, s, l))
}

/// `logsumexp` of one row.
#[inline(always)]
pub(crate) fn logsumexp<T: Element>(row: &[T]) -> T::Acc {
    let max = row
        .iter()
        .map(|v| v.to_acc())
        .fold(<T::Acc>::neg_infinity(), Float::max);
    let sum = row.iter().map(|v| (v.to_acc() - max).exp()).sum::<T::Acc>();
    max + sum.ln()
}

/// The forward op.
struct CrossEntropy;

impl CustomOp3 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross_entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Element>(
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
            s3: &CpuStorage,
            l3: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let logits = contiguous::<T>("cross_entropy", "logits", s1, l1)?;
            let v = l1.dims()[1];
            let targets = checked_targets("cross_entropy", s2, l2, v)?;
            let weights = weights_f64("cross_entropy", s3, l3)?;
            let row_loss = |i: usize| {
                if weights[i] == 0.0 {
                    return <T::Acc>::zero();
                }
                let row = &logits[i * v..(i + 1) * v];
                let w = constant::<T::Acc>(weights[i]);
                w * (logsumexp(row) - row[targets[i] as usize].to_acc())
            };
            // Per-row losses, then one sum in row order: the same result on any thread count.
            let losses: Vec<T::Acc> = if logits.len() >= 1 << 16 && rayon::current_num_threads() > 1
            {
                (0..targets.len()).into_par_iter().map(row_loss).collect()
            } else {
                (0..targets.len()).map(row_loss).collect()
            };
            // Summed in f64: over tens of thousands of rows an f32 running sum loses ~1e-3.
            let total: f64 = losses
                .into_iter()
                .map(|l| l.to_f64().unwrap_or(f64::NAN))
                .sum();
            let storage = match T::DTYPE {
                DType::F64 => CpuStorage::F64(vec![total]),
                _ => CpuStorage::F32(vec![total as f32]),
            };
            Ok((storage, Shape::from(())))
        }
        dispatch!("cross_entropy", s1, run(s1, l1, s2, l2, s3, l3))
    }

    /// Two launches: each row's weighted loss (one block per row), then their sum by one block
    /// (no atomics: the same result on every run).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: CudaElement>(
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            s3: &CudaStorage,
            l3: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let op = "cross_entropy";
            let logits = input::<T>(op, "logits", s1, l1)?;
            let targets = cuda_targets(op, s2, l2)?;
            let weights = input::<T::Acc>(op, "weights (in the loss dtype)", s3, l3)?;
            let (n, v) = (l1.dims()[0], l1.dims()[1]);
            let dev = &s1.device;
            let mut row_loss = output::<T::Acc>(dev, n)?;
            let mut total = output::<T::Acc>(dev, 1)?;
            let (n64, v64) = (n as u64, v as u64);
            launch!(dev, CROSS_ENTROPY, "cross_entropy_rows", T, rows_config(n, v);
                &logits, &targets, &weights, &mut row_loss, &n64, &v64);
            launch!(dev, CROSS_ENTROPY, "cross_entropy_total", T, one_block();
                &row_loss, &n64, &mut total);
            Ok((storage(total, dev), Shape::from(())))
        }
        cuda_dispatch!("cross_entropy", s1, run(s1, l1, s2, l2, s3, l3))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        weights: &Tensor,
        _loss: &Tensor,
        dloss: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let scaled = weights
            .to_dtype(dloss.dtype())?
            .broadcast_mul(dloss)?
            .contiguous()?;
        let grad = logits.apply_op3_no_bwd(targets, &scaled, &CrossEntropyBackward)?;
        Ok((Some(grad), None, None))
    }
}

/// The backward op: `(logits, targets, dloss · weights) → d_logits`.
struct CrossEntropyBackward;

impl CustomOp3 for CrossEntropyBackward {
    fn name(&self) -> &'static str {
        "cross_entropy-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Element>(
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
            s3: &CpuStorage,
            l3: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let op = "cross_entropy-backward";
            let logits = contiguous::<T>(op, "logits", s1, l1)?;
            let v = l1.dims()[1];
            let targets = checked_targets(op, s2, l2, v)?;
            let scaled = weights_f64(op, s3, l3)?;
            let mut out = vec![T::from_acc(<T::Acc>::zero()); logits.len()];
            for_each_row(&mut out, v, |i, grad| {
                if scaled[i] == 0.0 {
                    return;
                }
                let row = &logits[i * v..(i + 1) * v];
                let lse = logsumexp(row);
                let w = constant::<T::Acc>(scaled[i]);
                let t = targets[i] as usize;
                for (j, (g, x)) in grad.iter_mut().zip(row).enumerate() {
                    let p = (x.to_acc() - lse).exp();
                    *g = T::from_acc(if j == t {
                        w * (p - <T::Acc>::one())
                    } else {
                        w * p
                    });
                }
            });
            Ok((T::storage(out), l1.shape().clone()))
        }
        dispatch!("cross_entropy-backward", s1, run(s1, l1, s2, l2, s3, l3))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: CudaElement>(
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            s3: &CudaStorage,
            l3: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let op = "cross_entropy-backward";
            let logits = input::<T>(op, "logits", s1, l1)?;
            let targets = cuda_targets(op, s2, l2)?;
            let scaled = input::<T::Acc>(op, "dloss · weights (in the loss dtype)", s3, l3)?;
            let (n, v) = (l1.dims()[0], l1.dims()[1]);
            let dev = &s1.device;
            let mut grad = output::<T>(dev, n * v)?;
            let (n64, v64) = (n as u64, v as u64);
            launch!(dev, CROSS_ENTROPY, "cross_entropy_backward", T, rows_config(n, v);
                &logits, &targets, &scaled, &mut grad, &n64, &v64);
            Ok((storage(grad, dev), l1.shape().clone()))
        }
        cuda_dispatch!("cross_entropy-backward", s1, run(s1, l1, s2, l2, s3, l3))
    }
}
