//! Where gradients are accumulated: every micro-step's gradients, scaled, added into the buffers
//! in place (written on the window's first micro-step, added after), and the element kernels that
//! do it on the CPU (one pass over the data, transposed views read in tiles).

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use super::{GradientBucket, GradientBuffers, Slot};
use crate::cpu_slices::{with_f32, with_f32_mut, with_f32_transposed};
use crate::error::{Error, Result};

impl GradientBuffers {
    /// Adds `scale * grad(p)` into the buffer of every parameter `p` that has a gradient in `grads`.
    /// `params` must be the same (sorted) list the buffers were built from.
    pub fn accumulate(
        &mut self,
        params: &[(String, Var)],
        grads: &GradStore,
        scale: f64,
    ) -> Result<()> {
        self.check_param_count(params)?;
        self.allocate_all()?;
        accumulate_slots(&mut self.slots, params, grads, scale)
    }

    // The overlap worker fills bucket by bucket through `prepare_bucket`; this is that per-bucket
    // form as a method, which the tests compare with `accumulate`.
    /// Adds `scale * grad(p)` into the buffer of every parameter `p` of bucket `bucket` that has a
    /// gradient in `grads`, leaving the other buckets untouched. `params` is the whole sorted list
    /// the buffers were built from. Accumulating every bucket this way gives bitwise the same
    /// buffers as [`accumulate`](Self::accumulate): the same additions in the same order.
    #[cfg(test)]
    pub(crate) fn accumulate_bucket(
        &mut self,
        bucket: usize,
        params: &[(String, Var)],
        grads: &GradStore,
        scale: f64,
    ) -> Result<()> {
        self.check_param_count(params)?;
        let range = self
            .buckets
            .get(bucket)
            .ok_or_else(|| {
                Error::Parameters(format!(
                    "bucket {bucket} does not exist; the buffers have {} buckets",
                    self.buckets.len()
                ))
            })?
            .params();
        self.allocate(bucket)?;
        accumulate_slots(&mut self.slots[range.clone()], &params[range], grads, scale)
    }

    pub(super) fn check_param_count(&self, params: &[(String, Var)]) -> Result<()> {
        if params.len() != self.slots.len() {
            return Err(Error::Parameters(format!(
                "gradient buffers hold {} parameters but {} were given",
                self.slots.len(),
                params.len()
            )));
        }
        Ok(())
    }

    /// Adds `scale * grad` into the buffer of the parameter `name`.
    pub fn accumulate_one(&mut self, name: &str, grad: &Tensor, scale: f64) -> Result<()> {
        let i = *self.index.get(name).ok_or_else(|| {
            Error::Parameters(format!("no gradient buffer for parameter {name:?}"))
        })?;
        let b = self
            .buckets
            .iter()
            .position(|b| b.params.contains(&i))
            .expect("every parameter is in a bucket");
        self.allocate(b)?;
        add_scaled(&mut self.slots[i], grad, scale)
    }

    /// The start of the sync micro-step of [`accumulate_and_reduce`](Self::accumulate_and_reduce):
    /// checks `params`, gives every bucket storage and, when the missing gradients will be filled
    /// with zeros, first records which ones this rank has. Returns the slots to fill (with
    /// [`prepare_bucket`], a bucket's run at a time) and the buckets they belong to.
    pub(crate) fn begin_sync(
        &mut self,
        params: &[(String, Var)],
        grads: &GradStore,
        fill_missing: bool,
    ) -> Result<(&mut [Slot], &[GradientBucket])> {
        self.check_param_count(params)?;
        self.allocate_all()?;
        if fill_missing {
            self.record_local_presence(params, grads)?;
        }
        Ok((&mut self.slots, &self.buckets))
    }

    /// ZeRO stage 2's sync micro-step: adds `scale * grad(p)` for every parameter, fills the
    /// missing ones with zeros and hands each bucket, in order, to `reduce_scatter` with this
    /// rank's block as the output; each bucket is allocated only for that and released right
    /// after, so that at most one full bucket exists at a time beyond those a longer window
    /// already filled, and the gradients it took are removed from `grads`. Afterwards every parameter counts as having a gradient (see
    /// [`keep_only_present`](Self::keep_only_present)). Returns whether this rank missed some
    /// parameter's gradient in the window.
    pub(crate) fn accumulate_and_reduce_scatter(
        &mut self,
        params: &[(String, Var)],
        grads: &mut GradStore,
        scale: f64,
        mut reduce_scatter: impl FnMut(&Tensor, &Tensor) -> Result<()>,
    ) -> Result<bool> {
        self.check_param_count(params)?;
        if self.shard.is_none() {
            return Err(Error::Parameters(
                "a reduce-scatter sync on gradient buffers built without a ZeRO partition".into(),
            ));
        }
        self.record_local_presence(params, grads)?;
        let missing_here = self.local_presence.iter().any(|present| !present);
        for b in 0..self.buckets.len() {
            self.allocate(b)?;
            let range = self.buckets[b].params();
            prepare_bucket(
                &mut self.slots[range.clone()],
                &params[range.clone()],
                grads,
                scale,
                true,
            )?;
            // Each backward gradient is dropped once it is in its bucket, so that the next
            // bucket's storage takes the place of gradients already consumed rather than adding
            // to the whole backward pass's.
            for (_, var) in &params[range] {
                grads.remove(var.as_tensor());
            }
            let shard = self.shard.as_mut().expect("checked above");
            reduce_scatter(&self.buckets[b].flat, shard.block(b)?)?;
            self.release(b)?;
        }
        self.shard
            .as_mut()
            .expect("checked above")
            .mark_all_present();
        Ok(missing_here)
    }
}

/// Accumulates into consecutive slots from the matching `params` (same names, same order).
fn accumulate_slots(
    slots: &mut [Slot],
    params: &[(String, Var)],
    grads: &GradStore,
    scale: f64,
) -> Result<()> {
    for (slot, (name, var)) in slots.iter_mut().zip(params) {
        debug_assert_eq!(&slot.name, name);
        if let Some(grad) = grads.get(var.as_tensor()) {
            add_scaled(slot, grad, scale)?;
        }
    }
    Ok(())
}

pub(super) fn fill_missing_slots(slots: &mut [Slot]) -> Result<()> {
    for slot in slots.iter_mut().filter(|s| !s.written) {
        fill(&slot.view, 0.0)?;
        slot.written = true;
    }
    Ok(())
}

/// The sync micro-step's work on a run of slots (one bucket's, or all of them): their gradients
/// accumulated, then (optionally) the missing ones filled with zeros.
pub(crate) fn prepare_bucket(
    slots: &mut [Slot],
    params: &[(String, Var)],
    grads: &GradStore,
    scale: f64,
    fill_missing: bool,
) -> Result<()> {
    accumulate_slots(slots, params, grads, scale)?;
    if fill_missing {
        fill_missing_slots(slots)?;
    }
    Ok(())
}

/// `slot += scale * grad` (or `slot = scale * grad` when the slot is not yet written), in one pass
/// over the data on the CPU, and in one kernel on a GPU.
fn add_scaled(slot: &mut Slot, grad: &Tensor, scale: f64) -> Result<()> {
    if grad.shape() != slot.view.shape() {
        return Err(Error::Parameters(format!(
            "gradient of {:?} has shape {:?}, the parameter has {:?}",
            slot.name,
            grad.shape(),
            slot.view.shape()
        )));
    }
    let overwrite = !slot.written;
    let s = scale as f32;
    // On a GPU: one kernel reads the gradient in its own dtype and layout.
    #[cfg(feature = "cuda")]
    if crate::cuda_accumulate::add_scaled(&slot.view, grad, s, overwrite)? {
        slot.written = true;
        return Ok(());
    }
    let grad = if grad.dtype() != slot.view.dtype() {
        grad.to_dtype(slot.view.dtype())?
    } else {
        grad.clone()
    };
    let mut fused = with_f32(&grad, |g| {
        with_f32_mut(&slot.view, |dst| add_contiguous(dst, g, s, overwrite))
    })?;
    if fused.is_none() {
        // Gradients of transposed uses (every `Linear` weight) come back as transposed views:
        // read them in cache-sized tiles instead of copying them to a contiguous tensor first.
        let (rows, cols) = match slot.view.dims() {
            [r, c] => (*r, *c),
            _ => (0, 0),
        };
        fused = with_f32_transposed(&grad, |g| {
            with_f32_mut(&slot.view, |dst| {
                add_transposed(dst, g, rows, cols, s, overwrite)
            })
        })?;
    }
    match fused {
        Some(Ok(Some(()))) => {}
        Some(Err(e)) => return Err(e),
        _ => {
            let scaled = (grad.contiguous()? * scale)?;
            let new = if overwrite {
                scaled
            } else {
                (slot.view.clone() + scaled)?
            };
            overwrite_view(&slot.view, &new)?;
        }
    }
    slot.written = true;
    Ok(())
}

/// `dst[i][j] (+)= s * src[j][i]` for `dst` `[rows, cols]` and `src` `[cols, rows]`, both
/// row-major, in tiles so that both sides stay in cache.
///
/// Single-threaded on purpose: candle's kernels already keep every core busy, and a second thread
/// pool beside them would compete for the same cores.
fn add_transposed(dst: &mut [f32], src: &[f32], rows: usize, cols: usize, s: f32, overwrite: bool) {
    const TILE: usize = 64;
    for i0 in (0..rows).step_by(TILE) {
        for j0 in (0..cols).step_by(TILE) {
            let j1 = (j0 + TILE).min(cols);
            for i in i0..(i0 + TILE).min(rows) {
                let d = &mut dst[i * cols + j0..i * cols + j1];
                // src[j][i] for j in j0..j1: every `rows`-th element from src[j0][i].
                let column = src[j0 * rows + i..].iter().step_by(rows);
                if overwrite {
                    d.iter_mut().zip(column).for_each(|(d, &x)| *d = x * s);
                } else {
                    d.iter_mut().zip(column).for_each(|(d, &x)| *d += x * s);
                }
            }
        }
    }
}

/// `dst (+)= s * src` elementwise.
fn add_contiguous(dst: &mut [f32], src: &[f32], s: f32, overwrite: bool) {
    if overwrite {
        if s == 1.0 {
            dst.copy_from_slice(src);
        } else {
            dst.iter_mut().zip(src).for_each(|(d, &x)| *d = x * s);
        }
    } else {
        dst.iter_mut().zip(src).for_each(|(d, &x)| *d += x * s);
    }
}

/// Copies `src` into the storage behind `view` (device-generic path).
fn overwrite_view(view: &Tensor, src: &Tensor) -> Result<()> {
    // `slice_set` writes through to the storage shared with the bucket.
    let flat_view = view.flatten_all()?;
    flat_view.slice_set(&src.flatten_all()?.contiguous()?, 0, 0)?;
    Ok(())
}

pub(super) fn fill(view: &Tensor, value: f32) -> Result<()> {
    if with_f32_mut(view, |xs| xs.fill(value))?.is_none() {
        let z = (Tensor::ones(view.shape(), view.dtype(), view.device())? * value as f64)?;
        overwrite_view(view, &z)?;
    }
    Ok(())
}

pub(crate) fn scale_in_place(view: &Tensor, factor: f64) -> Result<()> {
    let f = factor as f32;
    if with_f32_mut(view, |xs| xs.iter_mut().for_each(|x| *x *= f))?.is_none() {
        let scaled = (view.clone() * factor)?;
        overwrite_view(view, &scaled)?;
    }
    Ok(())
}

pub(super) fn clamp_in_place(view: &Tensor, limit: f64) -> Result<()> {
    let l = limit as f32;
    // f32::clamp keeps NaN, as torch.clamp does.
    if with_f32_mut(view, |xs| xs.iter_mut().for_each(|x| *x = x.clamp(-l, l)))?.is_none() {
        // candle's clamp is a maximum then a minimum, which turn NaN into a bound (fmaxf/fminf
        // on CUDA, a comparison on the CPU): NaN is put back where it was.
        let clamped = view.clamp(-limit, limit)?;
        let nan = view.ne(view)?;
        overwrite_view(view, &nan.where_cond(view, &clamped)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grads::test_fixtures::*;
    use candle_core::{DType, Device};

    /// On a GPU a gradient of any float dtype and layout is added into its f32 buffer by one
    /// kernel, as the formula says: each element widened exactly to f32, times the scale in f32,
    /// written on the window's first micro-step and added after.
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a GPU (scripts/gpu-build.sh build, then run on a GPU machine)"]
    fn a_gradient_of_any_dtype_and_layout_is_added_on_the_gpu_in_one_kernel() {
        let cuda = Device::new_cuda(0).expect("a GPU (this test is ignored without one)");
        let values = |n: usize, seed: u32| -> Vec<f32> {
            let mut x = seed.wrapping_mul(2654435761);
            (0..n)
                .map(|_| {
                    x = x.wrapping_mul(1664525).wrapping_add(1013904223);
                    ((x >> 8) as f32 / (1u32 << 23) as f32 - 1.0) * 3.0
                })
                .collect()
        };
        // A [4, 6] gradient in six layouts: contiguous, contiguous at an offset (rows 1..5 of a
        // [5, 6]: the linear kernel with a start offset), transposed, a narrowed view (an offset
        // and a row stride), a permuted 3-D tensor, and one row broadcast (stride 0); each made
        // from a flat base of `len` elements.
        let view = |what: &str, t: &Tensor| -> Tensor {
            match what {
                "contiguous" => t.reshape((4, 6)).unwrap(),
                "offset" => t.reshape((5, 6)).unwrap().narrow(0, 1, 4).unwrap(),
                "transposed" => t.reshape((6, 4)).unwrap().t().unwrap(),
                "narrowed" => t.reshape((4, 8)).unwrap().narrow(1, 2, 6).unwrap(),
                "broadcast" => t.reshape((1, 6)).unwrap().broadcast_as((4, 6)).unwrap(),
                _ => t.reshape((2, 3, 4)).unwrap().permute((2, 0, 1)).unwrap(),
            }
        };
        let layouts = [
            ("contiguous", 24),
            ("offset", 30),
            ("transposed", 24),
            ("narrowed", 32),
            ("permuted", 24),
            ("broadcast", 6),
        ];
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for (what, len) in layouts {
                let make = |seed| {
                    let base = Tensor::from_vec(values(len, seed), len, &Device::Cpu)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap();
                    view(what, &base.to_device(&cuda).unwrap())
                };
                let (g1, g2) = (make(1), make(2));
                let shape = g1.shape().clone();
                let param = Var::zeros(&shape, DType::F32, &cuda).unwrap();
                let mut buffers = GradientBuffers::new(&[("w".into(), param)], 1 << 20).unwrap();
                let before = crate::cuda_accumulate::launches();
                let linear_before = crate::cuda_accumulate::linear_launches();
                buffers.accumulate_one("w", &g1, 0.5).unwrap();
                buffers.accumulate_one("w", &g2, 0.25).unwrap();
                assert_eq!(crate::cuda_accumulate::launches() - before, 2, "{what}");
                // Only the contiguous gradients are one linear run (the permuted one merges to
                // two dimensions, the others stay two).
                let linear = crate::cuda_accumulate::linear_launches() - linear_before;
                let contiguous = what == "contiguous" || what == "offset";
                assert_eq!(linear, if contiguous { 2 } else { 0 }, "{what}");
                // The formula, on the host: exact widening, then f32 arithmetic.
                let host = |g: &Tensor| -> Vec<f32> {
                    g.to_device(&Device::Cpu)
                        .unwrap()
                        .to_dtype(DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap()
                };
                let want: Vec<u32> = host(&g1)
                    .iter()
                    .zip(host(&g2))
                    .map(|(a, b)| (a * 0.5f32 + b * 0.25f32).to_bits())
                    .collect();
                let got: Vec<u32> = host(buffers.get("w").unwrap())
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                assert_eq!(got, want, "{dtype:?}, {what}");
            }
        }
    }

    /// The clamp of the tensor path (any dtype, any device), taken here by f64 tensors, on the
    /// CPU and, built with `cuda` on a machine with a GPU, on the GPU (where candle's clamp, made
    /// of fmaxf/fminf, would turn NaN into a bound): PyTorch's `clamp` written out, NaN kept,
    /// infinities clamped.
    #[test]
    fn clamp_in_place_keeps_nan_on_the_tensor_path() {
        #[allow(unused_mut)]
        let mut devices = vec![Device::Cpu];
        #[cfg(feature = "cuda")]
        if let Ok(gpu) = Device::new_cuda(0) {
            devices.push(gpu);
        }
        for device in devices {
            let values = [f64::NAN, 3.0, -3.0, 0.5, f64::INFINITY, f64::NEG_INFINITY];
            let t = Tensor::new(&values, &device).unwrap();
            clamp_in_place(&t, 1.0).unwrap();
            let got = t.to_vec1::<f64>().unwrap();
            assert!(got[0].is_nan(), "{device:?}: {got:?}");
            assert_eq!(got[1..], [1.0, -1.0, 0.5, 1.0, -1.0], "{device:?}");
        }
    }

    #[test]
    fn accumulating_bucket_by_bucket_equals_accumulating_all_bitwise() {
        let params = model();
        let micro_steps = [(grads(&params, 1), 0.25), (grads(&params, 2), 0.75)];
        let mut whole = GradientBuffers::new(&params, SMALL_CAP).unwrap();
        let mut by_bucket = GradientBuffers::new(&params, SMALL_CAP).unwrap();
        let n = whole.buckets().len();
        assert_eq!(n, 6, "the cap splits the model into six buckets");
        // Overwrite, then add: two micro-steps with different gradients and scales.
        for (micro_step, scale) in &micro_steps {
            whole.accumulate(&params, micro_step, *scale).unwrap();
            for b in 0..n {
                by_bucket
                    .accumulate_bucket(b, &params, micro_step, *scale)
                    .unwrap();
            }
        }
        assert_eq!(flats(&whole), flats(&by_bucket));
        assert!(by_bucket.get("l0.weight").is_some());
        assert!(by_bucket.get("unused").is_none(), "no gradient stays None");

        // One bucket alone touches nothing else.
        let mut one = GradientBuffers::new(&params, SMALL_CAP).unwrap();
        let first = &micro_steps[0].0;
        one.accumulate_bucket(1, &params, first, 1.0).unwrap();
        let names: Vec<String> = one.names().map(str::to_string).collect();
        for (b, bucket) in one.buckets().iter().enumerate() {
            for i in bucket.params() {
                assert_eq!(
                    one.get(&names[i]).is_some(),
                    b == 1,
                    "{} in bucket {b}",
                    names[i]
                );
            }
        }
        assert!(one.accumulate_bucket(n, &params, first, 1.0).is_err());
    }

    #[test]
    fn accumulation_of_large_matrices_matches_the_formula() {
        // 600 x 500: many tiles, with partial tiles at both edges (600 and 500 are not multiples
        // of 32).
        let (rows, cols) = (600usize, 500usize);
        let var = Var::zeros((rows, cols), DType::F32, &Device::Cpu).unwrap();
        let mut g = GradientBuffers::new(&[("w".into(), var)], usize::MAX).unwrap();
        let src: Vec<f32> = (0..rows * cols).map(|k| (k % 97) as f32 - 48.0).collect();
        // src is the [cols, rows] matrix; its transpose is the gradient [rows, cols].
        let grad_t = Tensor::from_vec(src.clone(), (cols, rows), &Device::Cpu)
            .unwrap()
            .t()
            .unwrap();
        let grad_c = grad_t.contiguous().unwrap();
        g.accumulate_one("w", &grad_t, 0.5).unwrap();
        g.accumulate_one("w", &grad_c, 0.25).unwrap();
        let got = g.get("w").unwrap().to_vec2::<f32>().unwrap();
        for i in (0..rows).step_by(37) {
            for j in (0..cols).step_by(29) {
                assert_eq!(got[i][j], 0.75 * src[j * rows + i], "({i}, {j})");
            }
        }
    }

    #[test]
    fn scaled_sums_of_plain_and_transposed_gradients() {
        let mut g = GradientBuffers::new(&vars(), 1 << 20).unwrap();
        let m = [[1f32, 2., 3.], [4., 5., 6.]];
        let plain = Tensor::new(&m, &Device::Cpu).unwrap();
        // The same values reached through a transposed view of a [3, 2] matrix.
        let transposed = Tensor::new(&[[1f32, 4.], [2., 5.], [3., 6.]], &Device::Cpu)
            .unwrap()
            .t()
            .unwrap();
        assert!(!transposed.is_contiguous());
        g.accumulate_one("a", &plain, 0.5).unwrap();
        g.accumulate_one("a", &transposed, 2.0).unwrap();
        let got = g.get("a").unwrap().to_vec2::<f32>().unwrap();
        let want: Vec<Vec<f32>> = m
            .iter()
            .map(|r| r.iter().map(|x| 2.5 * x).collect())
            .collect();
        assert_eq!(got, want);
        assert!(g.get("b").is_none(), "no gradient yet is PyTorch's None");
        g.fill_missing_with_zeros().unwrap();
        assert_eq!(g.get("b").unwrap().to_vec1::<f32>().unwrap(), vec![0.0; 4]);
        let norm = g.global_norm().unwrap();
        let want_norm = (2.5f64 * 2.5 * (1. + 4. + 9. + 16. + 25. + 36.)).sqrt();
        assert!((norm - want_norm).abs() < 1e-9, "{norm} vs {want_norm}");
        g.zero();
        assert!(!g.any_written());
        // After zero the next gradient overwrites instead of adding.
        g.accumulate_one("a", &plain, 1.0).unwrap();
        assert_eq!(
            g.get("a").unwrap().to_vec2::<f32>().unwrap()[1],
            vec![4., 5., 6.]
        );
    }
}
