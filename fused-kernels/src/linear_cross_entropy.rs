//! The cross-entropy of a linear layer's logits (a language model's head and its loss) without
//! the batch's logits in f32: rows are processed in chunks, each chunk's logits are computed in
//! the model's dtype, turned into their gradient in place by one kernel, and multiplied into the
//! gradients of the layer's input and weight right away (Liger Kernel's fused linear
//! cross-entropy). The backward pass only scales those gradients by the loss's gradient.

#[cfg(feature = "cuda")]
use crate::cross_entropy::cuda_targets;
use crate::cross_entropy::{class_indices, class_targets, logsumexp, weights_f64};
#[cfg(feature = "cuda")]
use crate::cuda::{
    elements_config, input, launch, one_block, output, rows_config, storage, CudaElement,
    CROSS_ENTROPY, LINEAR_CROSS_ENTROPY,
};
use crate::element::{constant, contiguous, dispatch, Element};
use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, InplaceOp3, Layout, Result, Shape, Storage,
    Tensor,
};
use num_traits::{Float, NumCast, One, ToPrimitive, Zero};
use rayon::prelude::*;
use std::sync::Mutex;

/// Most elements of one chunk of logits (`rows · v`): 64 Mi, 128 MiB in bf16. GPT-2's vocabulary
/// (50 257) gives chunks of 1335 rows, large enough for the matrix products to run at speed.
const CHUNK_ELEMENTS: usize = 1 << 26;

/// The summed, weighted cross-entropy of the logits `x · weightᵀ`:
/// `loss = Σ_i weights_i · (logsumexp(z_i) − z_i[targets_i])` with `z = x · weightᵀ`, a scalar,
/// without ever holding all rows' logits in f32.
///
/// `x` is `[n, c]`, `weight` `[v, c]` (PyTorch's `nn.Linear` layout, no bias), both f32, f64,
/// bf16 or f16; `targets` `[n]` are class indices (u32; other integer dtypes are converted) and
/// `weights` `[n]` floats (0 for padding: such a row adds exactly 0 and no gradient). The loss is
/// f32 (f64 for f64 inputs) and equals [`crate::cross_entropy()`] of the logits
/// `x.matmul(weight.t())` cast to f32: the logits are computed in the inputs' dtype, every
/// row's log-sum-exp and loss in f32.
///
/// The rows are processed in chunks of at most 2²⁶ / v rows (see
/// [`linear_cross_entropy_in_chunks`]). For each chunk, one product gives its logits, one kernel
/// writes each row's loss and overwrites the logits with `w_i · (softmax(z_i) − onehot(t_i))`
/// (in the inputs' dtype), and two products add that chunk's part of `d x = d z · weight` and
/// `d weight = Σ_chunks d zᵀ · x_chunk` (each chunk's product rounded to the inputs' dtype, the
/// chunks summed in f32 for bf16/f16). So the
/// gradients are computed during the forward pass, and only for the inputs that need one
/// (`track_op()`: a frozen head costs no `d weight` product). They are kept with the graph until
/// the backward pass multiplies them by the gradient of the loss (on the device, no
/// synchronization).
///
/// A target must be `< v` where the weight is not 0: on the CPU another one is an error naming
/// it; on CUDA it makes the loss and that row's gradient NaN (see [`crate::cross_entropy()`]).
/// A padding row (weight 0) may hold any target.
///
/// In f16 the gradient `w · (softmax − onehot)` is stored at the loss's own scale, before a
/// loss scaler's factor reaches it: probabilities below f16's subnormal range (6·10⁻⁸) round to
/// 0, and with small weights (a mean over the rows, `1/n`) whole rows can. Use summed losses
/// (weights 1, as the examples do) or bf16, whose range is f32's.
pub fn linear_cross_entropy(
    x: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    weights: &Tensor,
) -> Result<Tensor> {
    let v = weight.dims().first().copied().unwrap_or(1).max(1);
    linear_cross_entropy_in_chunks(x, weight, targets, weights, (CHUNK_ELEMENTS / v).max(1))
}

/// [`linear_cross_entropy`] with chunks of `rows_per_chunk` rows (the last one shorter): fewer,
/// larger chunks make larger, faster matrix products; smaller ones hold less memory (one chunk
/// of logits, `rows_per_chunk · v` elements in the inputs' dtype). The loss and gradients do not
/// depend on it beyond the rounding of the matrix products and of the sum over chunks.
pub fn linear_cross_entropy_in_chunks(
    x: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    weights: &Tensor,
    rows_per_chunk: usize,
) -> Result<Tensor> {
    let op = "linear_cross_entropy";
    let (n, c) = match *x.dims() {
        [n, c] => (n, c),
        _ => candle_core::bail!(
            "{op}: x must have shape [rows, in] (reshape a [batch, time, in] input to \
             [batch · time, in]), got {:?}",
            x.dims()
        ),
    };
    let v = match *weight.dims() {
        [v, in_] if in_ == c => v,
        _ => candle_core::bail!(
            "{op}: weight must have shape [classes, {c}] (nn.Linear's [out, in], in = the last \
             dimension of x {:?}), got {:?}",
            x.dims(),
            weight.dims()
        ),
    };
    if v == 0 {
        candle_core::bail!("{op}: weight {:?} has no classes", weight.dims());
    }
    if x.dtype() != weight.dtype() {
        candle_core::bail!(
            "{op}: x is {:?} but weight is {:?}; cast one so both share the model's dtype",
            x.dtype(),
            weight.dtype()
        );
    }
    if !matches!(
        x.dtype(),
        DType::F32 | DType::F64 | DType::BF16 | DType::F16
    ) {
        return Err(crate::element::unsupported(op, x.dtype()));
    }
    for (what, t) in [("targets", targets), ("weights", weights)] {
        if t.dims() != [n] {
            candle_core::bail!(
                "{op}: {what} must have shape [{n}] (one per row of x {:?}), got {:?}",
                x.dims(),
                t.dims()
            );
        }
    }
    if !weights.dtype().is_float() {
        candle_core::bail!("{op}: weights must be floats, got {:?}", weights.dtype());
    }
    if rows_per_chunk == 0 {
        candle_core::bail!("{op}: rows_per_chunk must be at least 1");
    }
    let targets = class_indices(op, targets)?;
    let on_kernel_device = x.device().is_cpu() || (x.device().is_cuda() && cfg!(feature = "cuda"));
    if !on_kernel_device {
        return crate::cross_entropy(&x.matmul(&weight.t()?)?, &targets, weights);
    }
    let weights = weights.to_dtype(loss_dtype(x.dtype()))?.contiguous()?;
    let (need_dx, need_dw) = (x.track_op(), weight.track_op());
    let parts = forward(
        &x.detach(),
        &weight.detach(),
        &targets,
        &weights,
        rows_per_chunk,
        need_dx,
        need_dw,
    )?;
    if !need_dx && !need_dw {
        return Ok(parts.loss);
    }
    x.apply_op3(
        weight,
        &parts.loss,
        LinearCrossEntropy {
            dx: parts.dx,
            dw: parts.dw,
        },
    )
}

/// The dtype of the loss and of the per-row arithmetic for inputs of `dtype`.
fn loss_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The forward pass's results: the loss and the gradients asked for, with respect to a loss
/// gradient of 1 (`dx` `[n, c]` in the inputs' dtype, `dw` `[v, c]` in the loss dtype).
struct Parts {
    loss: Tensor,
    dx: Option<Tensor>,
    dw: Option<Tensor>,
}

/// The chunked forward pass on detached, validated inputs (weights in the loss dtype).
fn forward(
    x: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    weights: &Tensor,
    rows_per_chunk: usize,
    need_dx: bool,
    need_dw: bool,
) -> Result<Parts> {
    let (n, c) = x.dims2()?;
    let v = weight.dim(0)?;
    let model = x.dtype();
    let acc = loss_dtype(model);
    let dev = x.device();
    // candle's CPU product of bf16 matrices widens both whole operands to f32 on every call and
    // rounds the f32 product to bf16: widen x and the weight once instead (not once per chunk and
    // product) and round the products the same way, which gives the same bits.
    let gemm = if dev.is_cpu() && model == DType::BF16 {
        DType::F32
    } else {
        model
    };
    let x = x.contiguous()?.to_dtype(gemm)?;
    let weight = weight.to_dtype(gemm)?;
    let weight_t = weight.t()?;
    let mut row_losses = Vec::new();
    let mut dx_chunks = Vec::new();
    let mut dw: Option<Tensor> = None;
    for start in (0..n).step_by(rows_per_chunk) {
        let len = rows_per_chunk.min(n - start);
        let x_chunk = x.narrow(0, start, len)?;
        let logits = x_chunk.matmul(&weight_t)?.to_dtype(model)?;
        let rows = RowsAndGradient {
            first_row: start,
            ..Default::default()
        };
        logits.inplace_op3(
            &targets.narrow(0, start, len)?,
            &weights.narrow(0, start, len)?,
            &rows,
        )?;
        row_losses.push(rows.take_losses(len)?);
        // `logits` now holds the chunk's d z (in the model's dtype).
        let dz = logits.to_dtype(gemm)?;
        if need_dx {
            dx_chunks.push(dz.matmul(&weight)?.to_dtype(model)?);
        }
        if need_dw {
            let part = dz.t()?.matmul(&x_chunk)?.to_dtype(acc)?;
            dw = Some(match dw {
                None => part,
                Some(sum) => (sum + part)?,
            });
        }
    }
    let loss = if n == 0 {
        Tensor::zeros((), acc, dev)?
    } else {
        Tensor::cat(&row_losses, 0)?.apply_op1_no_bwd(&SumLosses)?
    };
    let dx = match (need_dx, dx_chunks.len()) {
        (false, _) => None,
        (true, 0) => Some(Tensor::zeros((0, c), model, dev)?),
        (true, 1) => dx_chunks.pop(),
        (true, _) => Some(Tensor::cat(&dx_chunks, 0)?),
    };
    let dw = match (need_dw, dw) {
        (false, _) => None,
        (true, Some(dw)) => Some(dw),
        (true, None) => Some(Tensor::zeros((v, c), acc, dev)?),
    };
    Ok(Parts { loss, dx, dw })
}

/// The op whose value is the loss and whose backward pass scales the gradients the forward pass
/// computed: `(x, weight, loss) → loss`.
struct LinearCrossEntropy {
    /// `d loss / d x` for a loss gradient of 1, when `x` needs a gradient.
    dx: Option<Tensor>,
    /// `d loss / d weight` for a loss gradient of 1 (in the loss dtype), when `weight` needs one.
    dw: Option<Tensor>,
}

impl CustomOp3 for LinearCrossEntropy {
    fn name(&self) -> &'static str {
        "linear_cross_entropy"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        loss: &CpuStorage,
        loss_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok((loss.try_clone(loss_layout)?, Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        loss: &CudaStorage,
        loss_layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        Ok((loss.try_clone(loss_layout)?, Shape::from(())))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _loss: &Tensor,
        _res: &Tensor,
        dloss: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dloss = dloss.contiguous()?;
        let scaled = |g: &Option<Tensor>, dtype: DType| -> Result<Option<Tensor>> {
            g.as_ref()
                .map(|g| g.apply_op2_no_bwd(&dloss, &Scale { out: dtype }))
                .transpose()
        };
        Ok((
            scaled(&self.dx, x.dtype())?,
            scaled(&self.dw, weight.dtype())?,
            None,
        ))
    }
}

/// The in-place op on one chunk of logits `[rows, v]` (with the chunk's targets and weights):
/// writes each row's weighted loss into its own buffer (taken with
/// [`RowsAndGradient::take_losses`]) and overwrites the logits with their gradient
/// `w_i · (softmax(z_i) − onehot(t_i))`.
#[derive(Default)]
struct RowsAndGradient {
    /// The index of the chunk's first row among all rows (for error messages).
    first_row: usize,
    /// The per-row losses (loss dtype) of the last run.
    losses: Mutex<Option<Storage>>,
}

impl RowsAndGradient {
    /// The per-row losses `[rows]` of the last run, as a tensor.
    fn take_losses(&self, rows: usize) -> Result<Tensor> {
        let storage = self
            .losses
            .lock()
            .map_err(|_| candle_core::Error::Msg("linear_cross_entropy: a poisoned lock".into()))?
            .take()
            .ok_or_else(|| {
                candle_core::Error::Msg("linear_cross_entropy: the row kernel did not run".into())
            })?;
        Ok(Tensor::from_storage(
            storage,
            rows,
            BackpropOp::none(),
            false,
        ))
    }

    /// Keeps the losses of this run.
    fn keep(&self, losses: Storage) -> Result<()> {
        *self.losses.lock().map_err(|_| {
            candle_core::Error::Msg("linear_cross_entropy: a poisoned lock".into())
        })? = Some(losses);
        Ok(())
    }
}

impl InplaceOp3 for RowsAndGradient {
    fn name(&self) -> &'static str {
        "linear_cross_entropy-rows"
    }

    /// Rows split over threads; each row is the CPU cross-entropy kernel's arithmetic (the same
    /// loss and gradient as [`crate::cross_entropy()`] of these logits).
    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<()> {
        fn run<T: Element>(
            op: &RowsAndGradient,
            s1: &mut CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
            s3: &CpuStorage,
            l3: &Layout,
        ) -> Result<()> {
            // The targets' errors reach the user: name the public function.
            let name = "linear_cross_entropy";
            let &[n, v] = l1.dims() else {
                candle_core::bail!("{name}: logits must be [rows, v], got {:?}", l1.dims());
            };
            let Some((start, end)) = l1.contiguous_offsets() else {
                candle_core::bail!("{name}: logits are not contiguous");
            };
            let targets = class_targets(name, s2, l2)?;
            let weights = weights_f64(name, s3, l3)?;
            // A padding row (weight 0) may hold any target (transformers' -100 included).
            if let Some((i, bad)) = targets
                .iter()
                .zip(&weights)
                .enumerate()
                .find(|(_, (&t, &w))| w != 0.0 && t as usize >= v)
                .map(|(i, (t, _))| (i, t))
            {
                candle_core::bail!(
                    "{name}: targets[{}] = {bad} is not a class of the {v} logits per row",
                    op.first_row + i
                );
            }
            let Some(all) = T::slice_mut(s1) else {
                candle_core::bail!("{name}: the logits are not {:?}", T::DTYPE);
            };
            let logits = &mut all[start..end];
            let mut losses = vec![<T::Acc>::zero(); n];
            let body = |(i, (row, loss)): (usize, (&mut [T], &mut T::Acc))| {
                if weights[i] == 0.0 {
                    row.fill(T::from_acc(<T::Acc>::zero()));
                    return;
                }
                let w = constant::<T::Acc>(weights[i]);
                let t = targets[i] as usize;
                let lse = logsumexp(row);
                *loss = w * (lse - row[t].to_acc());
                for (j, g) in row.iter_mut().enumerate() {
                    let p = (g.to_acc() - lse).exp();
                    *g = T::from_acc(if j == t {
                        w * (p - <T::Acc>::one())
                    } else {
                        w * p
                    });
                }
            };
            if logits.len() >= 1 << 16 && rayon::current_num_threads() > 1 {
                logits
                    .par_chunks_mut(v)
                    .zip(losses.par_iter_mut())
                    .with_min_len((16 * 1024 / v).max(1))
                    .enumerate()
                    .for_each(body);
            } else {
                logits
                    .chunks_mut(v)
                    .zip(losses.iter_mut())
                    .enumerate()
                    .for_each(body);
            }
            let losses = if T::DTYPE == DType::F64 {
                CpuStorage::F64(
                    losses
                        .iter()
                        .map(|l| l.to_f64().unwrap_or(f64::NAN))
                        .collect(),
                )
            } else {
                CpuStorage::F32(
                    losses
                        .iter()
                        .map(|l| l.to_f32().unwrap_or(f32::NAN))
                        .collect(),
                )
            };
            op.keep(Storage::Cpu(losses))
        }
        dispatch!(
            "linear_cross_entropy-rows",
            s1,
            run(self, s1, l1, s2, l2, s3, l3)
        )
    }

    /// One block per row (`cross_entropy_rows_grad` of `linear_cross_entropy.cu`).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<()> {
        fn run<T: CudaElement>(
            op: &RowsAndGradient,
            s1: &mut CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            s3: &CudaStorage,
            l3: &Layout,
        ) -> Result<()> {
            let name = "linear_cross_entropy-rows";
            let &[n, v] = l1.dims() else {
                candle_core::bail!("{name}: logits must be [rows, v], got {:?}", l1.dims());
            };
            let Some((start, end)) = l1.contiguous_offsets() else {
                candle_core::bail!("{name}: logits are not contiguous");
            };
            let targets = cuda_targets(name, s2, l2)?;
            let weights = input::<T::Acc>(name, "weights (in the loss dtype)", s3, l3)?;
            let dev = s1.device.clone();
            let mut losses = output::<T::Acc>(&dev, n)?;
            let mut logits = s1.as_cuda_slice_mut::<T>()?.slice_mut(start..end);
            let (n64, v64) = (n as u64, v as u64);
            launch!(dev, LINEAR_CROSS_ENTROPY, "cross_entropy_rows_grad", T, rows_config(n, v);
                &mut logits, &targets, &weights, &mut losses, &n64, &v64);
            op.keep(Storage::Cuda(storage(losses, &dev)))
        }
        crate::cuda::cuda_dispatch!(
            "linear_cross_entropy-rows",
            &*s1,
            run(self, s1, l1, s2, l2, s3, l3)
        )
    }
}

/// `[rows] → []`: the sum of the per-row losses (f32 or f64), added in f64 in row order on the
/// CPU (as [`crate::cross_entropy()`] adds them) and by one block on CUDA (no atomics).
struct SumLosses;

impl CustomOp1 for SumLosses {
    fn name(&self) -> &'static str {
        "linear_cross_entropy-sum"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("linear_cross_entropy-sum: the losses are not contiguous");
        };
        let total = match s {
            CpuStorage::F32(v) => CpuStorage::F32(vec![v[start..end]
                .iter()
                .map(|&l| l as f64)
                .sum::<f64>() as f32]),
            CpuStorage::F64(v) => CpuStorage::F64(vec![v[start..end].iter().sum()]),
            other => candle_core::bail!(
                "linear_cross_entropy-sum: losses must be f32 or f64, got {:?}",
                other.dtype()
            ),
        };
        Ok((total, Shape::from(())))
    }

    /// One block (`cross_entropy_total` of `cross_entropy.cu`).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        fn run<T: CudaElement>(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let losses = input::<T>("linear_cross_entropy-sum", "losses", s, l)?;
            let n64 = l.shape().elem_count() as u64;
            let dev = &s.device;
            let mut total = output::<T>(dev, 1)?;
            launch!(dev, CROSS_ENTROPY, "cross_entropy_total", T, one_block();
                &losses, &n64, &mut total);
            Ok((storage(total, dev), Shape::from(())))
        }
        match s.dtype() {
            DType::F32 => run::<f32>(s, l),
            DType::F64 => run::<f64>(s, l),
            other => candle_core::bail!(
                "linear_cross_entropy-sum: losses must be f32 or f64, got {other:?}"
            ),
        }
    }
}

/// `(g, s) → g · s[0]` in dtype `out`, computed in the arithmetic type: a kept gradient (in
/// `out`, or in the arithmetic type of `out`) times the loss's gradient `s` (a scalar in the loss
/// dtype), rounded once.
struct Scale {
    out: DType,
}

impl CustomOp2 for Scale {
    fn name(&self) -> &'static str {
        "linear_cross_entropy-scale"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<X: Element, T: Element>(
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let name = "linear_cross_entropy-scale";
            let g = contiguous::<X>(name, "gradient", s1, l1)?;
            let k = match weights_f64(name, s2, l2)?.as_slice() {
                &[k] => constant::<T::Acc>(k),
                other => candle_core::bail!("{name}: dloss has {} elements, not 1", other.len()),
            };
            let one = |x: &X| {
                let x: T::Acc = NumCast::from(x.to_acc()).unwrap_or_else(<T::Acc>::nan);
                T::from_acc(x * k)
            };
            let out: Vec<T> = if g.len() >= 1 << 15 && rayon::current_num_threads() > 1 {
                g.par_iter().with_min_len(8192).map(one).collect()
            } else {
                g.iter().map(one).collect()
            };
            Ok((T::storage(out), l1.shape().clone()))
        }
        use half::{bf16, f16};
        match (s1.dtype(), self.out) {
            (DType::F32, DType::F32) => run::<f32, f32>(s1, l1, s2, l2),
            (DType::F64, DType::F64) => run::<f64, f64>(s1, l1, s2, l2),
            (DType::BF16, DType::BF16) => run::<bf16, bf16>(s1, l1, s2, l2),
            (DType::F16, DType::F16) => run::<f16, f16>(s1, l1, s2, l2),
            (DType::F32, DType::BF16) => run::<f32, bf16>(s1, l1, s2, l2),
            (DType::F32, DType::F16) => run::<f32, f16>(s1, l1, s2, l2),
            (from, to) => {
                candle_core::bail!("linear_cross_entropy-scale: cannot scale {from:?} into {to:?}")
            }
        }
    }

    /// One grid-stride launch (`scale` or `scale_acc` of `linear_cross_entropy.cu`).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: CudaElement>(
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let name = "linear_cross_entropy-scale";
            let k = input::<T::Acc>(name, "dloss (in the loss dtype)", s2, l2)?;
            let n = l1.shape().elem_count();
            let dev = &s1.device;
            let mut y = output::<T>(dev, n)?;
            let n64 = n as u64;
            if s1.dtype() == T::DTYPE {
                let g = input::<T>(name, "gradient", s1, l1)?;
                launch!(dev, LINEAR_CROSS_ENTROPY, "scale", T, elements_config(n);
                    &g, &k, &mut y, &n64);
            } else {
                let g = input::<T::Acc>(name, "gradient (in the loss dtype)", s1, l1)?;
                launch!(dev, LINEAR_CROSS_ENTROPY, "scale_acc", T, elements_config(n);
                    &g, &k, &mut y, &n64);
            }
            Ok((storage(y, dev), l1.shape().clone()))
        }
        match self.out {
            DType::F32 => run::<f32>(s1, l1, s2, l2),
            DType::F64 => run::<f64>(s1, l1, s2, l2),
            DType::BF16 => run::<half::bf16>(s1, l1, s2, l2),
            DType::F16 => run::<half::f16>(s1, l1, s2, l2),
            other => Err(crate::element::unsupported(
                "linear_cross_entropy-scale",
                other,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// `n` pseudo-random values in `[-1, 1)` (xorshift from `seed`).
    fn values(n: usize, seed: u64) -> Vec<f64> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 11) as f64 / (1u64 << 52) as f64 - 1.0
            })
            .collect()
    }

    fn f64s(t: &Tensor) -> Vec<f64> {
        t.to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// A problem: `n` rows of `c` against `v` classes; padding (weight 0) on rows 2 and 7, the
    /// last class as target of rows 1 and 6.
    struct Problem {
        n: usize,
        c: usize,
        v: usize,
        x: Vec<f64>,
        w: Vec<f64>,
        targets: Vec<u32>,
        weights: Vec<f64>,
    }

    fn problem(n: usize, c: usize, v: usize, seed: u64) -> Problem {
        let targets = (0..n)
            .map(|i| match i % 5 {
                1 => (v - 1) as u32,
                _ => ((i * 7919 + 3) % v) as u32,
            })
            .collect();
        let weights = (0..n)
            .map(|i| {
                if i % 5 == 2 {
                    0.0
                } else {
                    [1.0, 0.5, 2.0][i % 3]
                }
            })
            .collect();
        Problem {
            n,
            c,
            v,
            // Logits of a few units: a softmax that is neither flat nor one-hot.
            x: values(n * c, seed).iter().map(|x| x * 2.0).collect(),
            w: values(v * c, seed + 1).iter().map(|x| x * 1.5).collect(),
            targets,
            weights,
        }
    }

    /// The loss and its gradients with respect to `x` and `w` by naive f64 loops, from the
    /// inputs as given (the caller rounds them to the dtype under test first).
    fn naive(p: &Problem, x: &[f64], w: &[f64]) -> (f64, Vec<f64>, Vec<f64>) {
        let (n, c, v) = (p.n, p.c, p.v);
        let mut loss = 0.0;
        let mut dx = vec![0.0; n * c];
        let mut dw = vec![0.0; v * c];
        for i in 0..n {
            let z: Vec<f64> = (0..v)
                .map(|k| (0..c).map(|j| x[i * c + j] * w[k * c + j]).sum())
                .collect();
            let max = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + z.iter().map(|z| (z - max).exp()).sum::<f64>().ln();
            let t = p.targets[i] as usize;
            let wi = p.weights[i];
            if wi == 0.0 {
                continue;
            }
            loss += wi * (lse - z[t]);
            for k in 0..v {
                let dz = wi * ((z[k] - lse).exp() - if k == t { 1.0 } else { 0.0 });
                for j in 0..c {
                    dx[i * c + j] += dz * w[k * c + j];
                    dw[k * c + j] += dz * x[i * c + j];
                }
            }
        }
        (loss, dx, dw)
    }

    /// Loss and gradients of `scale · linear_cross_entropy` (chunks of `rows`) in `dtype`.
    fn fused(p: &Problem, dtype: DType, rows: usize, scale: f64) -> (f64, Vec<f64>, Vec<f64>) {
        let dev = Device::Cpu;
        let x = Var::from_tensor(
            &Tensor::from_vec(p.x.clone(), (p.n, p.c), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        let w = Var::from_tensor(
            &Tensor::from_vec(p.w.clone(), (p.v, p.c), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        let targets = Tensor::new(p.targets.as_slice(), &dev).unwrap();
        let weights = Tensor::new(p.weights.as_slice(), &dev)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let loss =
            linear_cross_entropy_in_chunks(x.as_tensor(), w.as_tensor(), &targets, &weights, rows)
                .unwrap();
        assert_eq!(loss.dtype(), loss_dtype(dtype));
        let grads = (&loss * scale).unwrap().backward().unwrap();
        let dx = grads.get(x.as_tensor()).unwrap();
        let dw = grads.get(w.as_tensor()).unwrap();
        assert_eq!((dx.dtype(), dw.dtype()), (dtype, dtype));
        (f64s(&loss)[0], f64s(dx), f64s(dw))
    }

    /// `a` within `tol` of `b`, relative to the largest magnitude of `b` (at least 1).
    fn assert_close(what: &str, a: &[f64], b: &[f64], tol: f64) {
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        let scale = b.iter().fold(1f64, |m, v| m.max(v.abs()));
        for (k, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= tol * scale,
                "{what}[{k}]: {x} vs {y} (tolerance {tol:e} × {scale})"
            );
        }
    }

    /// The inputs rounded to `dtype`, as f64.
    fn rounded(v: &[f64], dtype: DType) -> Vec<f64> {
        f64s(
            &Tensor::new(v, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
    }

    #[test]
    fn loss_and_gradients_equal_naive_loops_for_any_chunking() {
        // Odd shapes; chunks of 1 row, 4 rows (the last one short), all rows, more than all.
        let p = problem(13, 7, 37, 1);
        // The tolerances: f64 to rounding; f32 to a few ulps of sums of ~40 terms; bf16 to the
        // rounding of the logits (2⁻⁹ of a few units) and of the gradients' products.
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-6), (DType::BF16, 3e-2)] {
            let (x, w) = (rounded(&p.x, dtype), rounded(&p.w, dtype));
            let (loss, dx, dw) = naive(&p, &x, &w);
            for rows in [1, 4, 13, 100] {
                let what = format!("{dtype:?}, chunks of {rows}");
                let (l, gx, gw) = fused(&p, dtype, rows, 1.0);
                assert_close(&format!("{what}: loss"), &[l], &[loss], tol);
                assert_close(&format!("{what}: dx"), &gx, &dx, tol);
                assert_close(&format!("{what}: dw"), &gw, &dw, tol);
            }
        }
    }

    #[test]
    fn the_loss_gradient_scales_the_kept_gradients() {
        // backward of 0.37 · loss: the kept gradients times 0.37 (in f32 for the bf16 weight's
        // f32 sum, rounded once).
        let p = problem(9, 5, 11, 2);
        for (dtype, tol) in [(DType::F32, 2e-6), (DType::BF16, 2e-2)] {
            let (x, w) = (rounded(&p.x, dtype), rounded(&p.w, dtype));
            let (_, dx, dw) = naive(&p, &x, &w);
            let scaled = |g: &[f64]| g.iter().map(|g| g * 0.37).collect::<Vec<_>>();
            let (_, gx, gw) = fused(&p, dtype, 4, 0.37);
            assert_close(&format!("{dtype:?} dx"), &gx, &scaled(&dx), tol);
            assert_close(&format!("{dtype:?} dw"), &gw, &scaled(&dw), tol);
        }
    }

    #[test]
    fn equals_the_unfused_candle_path_and_chunking_changes_nothing_in_f32() {
        // The unfused path: candle's matmul, a cast to f32, fused_kernels::cross_entropy, all
        // differentiated by candle.
        let p = problem(50, 16, 203, 3);
        let dev = Device::Cpu;
        for dtype in [DType::F32, DType::BF16] {
            let x = Var::from_tensor(
                &Tensor::from_vec(p.x.clone(), (p.n, p.c), &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            )
            .unwrap();
            let w = Var::from_tensor(
                &Tensor::from_vec(p.w.clone(), (p.v, p.c), &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            )
            .unwrap();
            let targets = Tensor::new(p.targets.as_slice(), &dev).unwrap();
            let weights = Tensor::new(p.weights.as_slice(), &dev)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let logits = x
                .as_tensor()
                .matmul(&w.as_tensor().t().unwrap())
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let loss = crate::cross_entropy(&logits, &targets, &weights).unwrap();
            let g = loss.backward().unwrap();
            let want = (
                f64s(&loss),
                f64s(g.get(x.as_tensor()).unwrap()),
                f64s(g.get(w.as_tensor()).unwrap()),
            );
            let (l, gx, gw) = fused(&p, dtype, usize::MAX, 1.0);
            // One chunk: the same logits, the same row arithmetic, the same f64 sum.
            assert_eq!(l, want.0[0], "{dtype:?}: loss");
            // The gradients round d z to the dtype before the products, as the unfused path.
            let tol = if dtype == DType::F32 { 1e-6 } else { 1e-2 };
            assert_close(&format!("{dtype:?} dx"), &gx, &want.1, tol);
            assert_close(&format!("{dtype:?} dw"), &gw, &want.2, tol);
            if dtype == DType::F32 {
                let (l7, gx7, gw7) = fused(&p, dtype, 7, 1.0);
                assert_close("chunks of 7: loss", &[l7], &[l], 1e-6);
                assert_close("chunks of 7: dx", &gx7, &gx, 1e-6);
                assert_close("chunks of 7: dw", &gw7, &gw, 1e-6);
            }
        }
    }

    #[test]
    fn the_same_bits_on_one_and_on_four_threads() {
        // 600 rows of 300 classes: past the threshold of the threaded row loop.
        let p = problem(600, 8, 300, 4);
        let pool = |k| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(k)
                .build()
                .unwrap()
        };
        for dtype in [DType::F32, DType::BF16] {
            let one = pool(1).install(|| fused(&p, dtype, 250, 1.0));
            let four = pool(4).install(|| fused(&p, dtype, 250, 1.0));
            assert_eq!(one, four, "{dtype:?}");
        }
    }

    #[test]
    fn frozen_inputs_get_no_gradient_and_no_product() {
        let p = problem(6, 4, 9, 5);
        let dev = Device::Cpu;
        let x = Tensor::from_vec(p.x.clone(), (p.n, p.c), &dev).unwrap();
        let w = Tensor::from_vec(p.w.clone(), (p.v, p.c), &dev).unwrap();
        let targets = Tensor::new(p.targets.as_slice(), &dev).unwrap();
        let weights = Tensor::new(p.weights.as_slice(), &dev).unwrap();
        let (loss, want_dx, want_dw) = naive(&p, &p.x, &p.w);
        // A frozen head: x trains, weight does not.
        let xv = Var::from_tensor(&x).unwrap();
        let l = linear_cross_entropy(xv.as_tensor(), &w, &targets, &weights).unwrap();
        let g = l.backward().unwrap();
        assert!(g.get(&w).is_none());
        assert_close("dx", &f64s(g.get(xv.as_tensor()).unwrap()), &want_dx, 1e-12);
        // Frozen inputs: weight trains, x does not.
        let wv = Var::from_tensor(&w).unwrap();
        let l = linear_cross_entropy(&x, wv.as_tensor(), &targets, &weights).unwrap();
        let g = l.backward().unwrap();
        assert!(g.get(&x).is_none());
        assert_close("dw", &f64s(g.get(wv.as_tensor()).unwrap()), &want_dw, 1e-12);
        // Neither: a plain loss, no graph.
        let l = linear_cross_entropy(&x, &w, &targets, &weights).unwrap();
        assert!(!l.track_op());
        assert_close("loss", &f64s(&l), &[loss], 1e-12);
        // And the forward pass computes only the gradients asked for.
        let weights = weights.to_dtype(DType::F64).unwrap();
        let parts = forward(&x, &w, &targets, &weights, 4, true, false).unwrap();
        assert!(parts.dx.is_some() && parts.dw.is_none());
        let parts = forward(&x, &w, &targets, &weights, 4, false, true).unwrap();
        assert!(parts.dx.is_none() && parts.dw.is_some());
    }

    #[test]
    fn padding_rows_add_nothing_and_no_rows_give_zero() {
        let p = problem(10, 3, 5, 6);
        let dev = Device::Cpu;
        let mut q = problem(10, 3, 5, 6);
        // Padding rows hold huge values and an arbitrary class: weight 0 ignores them.
        for i in [2, 7] {
            for j in 0..q.c {
                q.x[i * q.c + j] = 1e30;
            }
        }
        let (l, gx, gw) = fused(&p, DType::F32, 3, 1.0);
        let (lq, gxq, gwq) = fused(&q, DType::F32, 3, 1.0);
        assert_eq!(l, lq);
        assert_eq!(gw, gwq);
        for i in [2, 7] {
            assert!(gxq[i * q.c..(i + 1) * q.c].iter().all(|&g| g == 0.0));
        }
        assert_eq!(gx, gxq);
        let x = Var::from_tensor(&Tensor::zeros((0, 3), DType::F32, &dev).unwrap()).unwrap();
        let w = Var::from_tensor(&Tensor::ones((5, 3), DType::F32, &dev).unwrap()).unwrap();
        let none = Tensor::zeros(0, DType::U32, &dev).unwrap();
        let loss = linear_cross_entropy(
            x.as_tensor(),
            w.as_tensor(),
            &none,
            &none.to_dtype(DType::F32).unwrap(),
        )
        .unwrap();
        assert_eq!(loss.to_scalar::<f32>().unwrap(), 0.0);
        let g = loss.backward().unwrap();
        assert_eq!(g.get(x.as_tensor()).unwrap().dims(), [0, 3]);
        assert_eq!(f64s(g.get(w.as_tensor()).unwrap()), vec![0.0; 15]);
    }

    #[test]
    fn bad_inputs_are_refused_naming_the_problem() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((4, 3), DType::F32, &dev).unwrap();
        let w = Tensor::zeros((5, 3), DType::F32, &dev).unwrap();
        let t = Tensor::new(&[0u32, 1, 2, 4], &dev).unwrap();
        let wt = Tensor::ones(4, DType::F32, &dev).unwrap();
        let err = |r: Result<Tensor>| r.map(|t| t.dims().to_vec()).unwrap_err().to_string();
        let narrow = Tensor::zeros((5, 2), DType::F32, &dev).unwrap();
        let e = err(linear_cross_entropy(&x, &narrow, &t, &wt));
        assert!(
            e.contains("weight must have shape [classes, 3]") && e.contains("[5, 2]"),
            "{e}"
        );
        let e = err(linear_cross_entropy(
            &x.reshape((2, 2, 3)).unwrap(),
            &w,
            &t,
            &wt,
        ));
        assert!(
            e.contains("x must have shape [rows, in]") && e.contains("[2, 2, 3]"),
            "{e}"
        );
        let e = err(linear_cross_entropy(
            &x,
            &w.to_dtype(DType::BF16).unwrap(),
            &t,
            &wt,
        ));
        assert!(e.contains("F32") && e.contains("BF16"), "{e}");
        let e = err(linear_cross_entropy(
            &x,
            &w,
            &t.narrow(0, 0, 3).unwrap(),
            &wt,
        ));
        assert!(
            e.contains("targets must have shape [4]") && e.contains("[3]"),
            "{e}"
        );
        let bad = Tensor::new(&[0u32, 1, 5, 2], &dev).unwrap();
        let e = err(linear_cross_entropy(&x, &w, &bad, &wt));
        assert!(
            e.contains("targets[2] = 5") && e.contains("5 logits"),
            "{e}"
        );
        // The index counts all rows, not the chunk's.
        let e = err(linear_cross_entropy_in_chunks(&x, &w, &bad, &wt, 2));
        assert!(e.contains("targets[2] = 5"), "{e}");
        // A padding row may hold any target (transformers' -100, as i64): the loss is the other
        // rows' alone.
        let ignore = Tensor::new(&[0i64, 1, -100, 2], &dev).unwrap();
        let padding = Tensor::new(&[1f32, 1., 0., 1.], &dev).unwrap();
        let with = linear_cross_entropy(&x, &w, &ignore, &padding).unwrap();
        let kept = [0usize, 1, 3].map(|i| x.get(i).unwrap());
        let without = linear_cross_entropy(
            &Tensor::stack(&kept, 0).unwrap(),
            &w,
            &Tensor::new(&[0u32, 1, 2], &dev).unwrap(),
            &Tensor::ones(3, DType::F32, &dev).unwrap(),
        )
        .unwrap();
        assert_eq!(
            with.to_scalar::<f32>().unwrap(),
            without.to_scalar::<f32>().unwrap()
        );
        let e = err(linear_cross_entropy_in_chunks(&x, &w, &t, &wt, 0));
        assert!(e.contains("rows_per_chunk"), "{e}");
        let e = err(linear_cross_entropy(&x, &w, &t, &t));
        assert!(e.contains("weights must be floats"), "{e}");
    }
}
