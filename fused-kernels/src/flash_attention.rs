//! Causal scaled-dot-product attention without the `T × T` score matrix (FlashAttention-2): the
//! keys are visited a tile at a time with an online softmax, the backward pass recomputes the
//! probabilities from the forward's per-row log-sum-exp, and grouped-query heads read their
//! key/value head in place instead of through `repeat_kv` copies.
//!
//! The kernels live in [`cpu`] (rayon over tiles, tile products through `gemm`) and in
//! `src/cuda/flash_attention.cu` (tensor-core kernels for bf16/f16 at head dims 64 and 128, a
//! simple kernel for every other case); [`HeadsView`], [`flash_forward`] and [`flash_backward`]
//! let a fused block run them on heads read in place from a packed QKV projection.

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(test)]
mod tests;

use crate::element::{dispatch, Element};
use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Storage, Tensor};
use std::sync::Mutex;

/// Causal attention `softmax(scale · q kᵀ + mask) v` for `q` `[B, T, H, D]` and `k`, `v`
/// `[B, T, Hkv, D]`: query `i` attends to keys `0..=i`. With `Hkv < H` (grouped-query attention,
/// `H` a multiple of `Hkv`) query head `h` reads key/value head `h / (H / Hkv)`, transformers'
/// `repeat_kv` convention, without copying the key/value heads.
///
/// The result is `[B, T, H, D]`, contiguous, in the dtype of `q`. The inputs may be strided views
/// whose last dimension is contiguous (such as `qkv.narrow(2, 0, H)` of a packed `[B, T, 3, H,
/// D]` projection): they are read in place. The op is trainable: its backward pass returns
/// `dq`, `dk` and `dv` (`dk`/`dv` summed over the query heads of each group) from the saved
/// per-row log-sum-exp, deterministically (the same bits on any number of threads).
///
/// f32, f64, and bf16/f16 (computed in f32). On CUDA (the `cuda` feature), bf16 and f16 with
/// `D` 64 or 128 run on tensor cores; other dtypes and head dims are computed with candle's ops
/// (`T × T` scores through cuBLAS, faster there than a kernel without tensor cores), as on devices
/// without the kernels.
pub fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, softmax_scale: f64) -> Result<Tensor> {
    let dims = check_tensors(q, k, v, softmax_scale)?;
    let (q, k, v) = (unit_last(q)?, unit_last(k)?, unit_last(v)?);
    if q.elem_count() == 0
        || k.elem_count() == 0
        || !crate::element::has_kernel(&q)
        || !fast_on(&q, dims.head_dim)
    {
        return fallback(&q, &k, &v, dims, softmax_scale);
    }
    q.apply_op3(
        &k,
        &v,
        FlashAttention {
            scale: softmax_scale,
            lse: Mutex::new(None),
        },
    )
}

/// Whether the flash kernels are the fast way to compute attention of `q`'s dtype and device and
/// `head_dim`: always on the CPU; on CUDA for the tensor-core kernels (bf16/f16, head dim 64 or
/// 128). Elsewhere materialized scores through cuBLAS beat the simple kernel by far.
pub(crate) fn fast_on(q: &Tensor, head_dim: usize) -> bool {
    match q.device() {
        candle_core::Device::Cpu => true,
        _ => has_tensor_core_kernel(q.dtype(), head_dim),
    }
}

/// Whether the CUDA kernels have a tensor-core version for `dtype` and `head_dim`.
pub(crate) fn has_tensor_core_kernel(dtype: DType, head_dim: usize) -> bool {
    matches!(dtype, DType::BF16 | DType::F16) && matches!(head_dim, 64 | 128)
}

/// The sizes of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dims {
    /// `B`.
    pub(crate) batch: usize,
    /// `T`: queries and keys.
    pub(crate) tokens: usize,
    /// `H`: query heads.
    pub(crate) heads: usize,
    /// `Hkv`: key/value heads, a divisor of `H`.
    pub(crate) kv_heads: usize,
    /// `D`.
    pub(crate) head_dim: usize,
}

impl Dims {
    /// Query heads per key/value head.
    pub(crate) fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// The shape of the packed gradient `[B, T, H + 2·Hkv, D]`.
    fn packed(&self) -> (usize, usize, usize, usize) {
        (
            self.batch,
            self.tokens,
            self.heads + 2 * self.kv_heads,
            self.head_dim,
        )
    }
}

/// Where element `[b, t, h, 0]` of a `[B, T, heads, D]` view lies in its storage:
/// `offset + b·batch + t·token + h·head`, the `D` elements of a head contiguous from there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Strides {
    /// The element offset of `[0, 0, 0, 0]`.
    pub(crate) offset: usize,
    /// Elements between consecutive batch entries.
    pub(crate) batch: usize,
    /// Elements between consecutive tokens.
    pub(crate) token: usize,
    /// Elements between consecutive heads.
    pub(crate) head: usize,
}

impl Strides {
    /// The strides of a contiguous `[B, T, heads, D]` tensor.
    pub(crate) fn contiguous(tokens: usize, heads: usize, head_dim: usize) -> Self {
        Strides {
            offset: 0,
            batch: tokens * heads * head_dim,
            token: heads * head_dim,
            head: head_dim,
        }
    }

    /// One past the last element a `[batch, tokens, heads, head_dim]` view reads (0 when it reads
    /// none).
    fn end(&self, batch: usize, tokens: usize, heads: usize, head_dim: usize) -> usize {
        if batch == 0 || tokens == 0 || heads == 0 || head_dim == 0 {
            return 0;
        }
        self.offset
            + (batch - 1) * self.batch
            + (tokens - 1) * self.token
            + (heads - 1) * self.head
            + head_dim
    }

    /// The strides of a 4-d layout whose last dimension is contiguous.
    fn of_layout(l: &Layout) -> Self {
        let s = l.stride();
        Strides {
            offset: l.start_offset(),
            batch: s[0],
            token: s[1],
            head: s[2],
        }
    }
}

/// Attention heads read in place from a tensor's storage: element `[b, t, h, d]` of the
/// `[batch, tokens, heads, head_dim]` view is element `offset + b·batch_stride + t·token_stride
/// + h·head_stride + d` of `tensor`'s storage (whatever `tensor`'s own layout). A fused block
/// passes the query, key and value heads of a packed QKV projection this way, without
/// `narrow`ed tensors or copies.
#[derive(Clone, Debug)]
pub(crate) struct HeadsView {
    /// The tensor whose storage holds the heads.
    pub(crate) tensor: Tensor,
    /// The view's element offset into the storage.
    pub(crate) offset: usize,
    /// Elements between batch entries.
    pub(crate) batch_stride: usize,
    /// Elements between tokens.
    pub(crate) token_stride: usize,
    /// Elements between heads.
    pub(crate) head_stride: usize,
    /// `B`.
    pub(crate) batch: usize,
    /// `T`.
    pub(crate) tokens: usize,
    /// The number of heads.
    pub(crate) heads: usize,
    /// `D`, contiguous in the storage.
    pub(crate) head_dim: usize,
}

impl HeadsView {
    /// The view of a `[B, T, heads, D]` tensor (any strides, the last one 1), such as
    /// `qkv.narrow(2, 0, H)`.
    pub(crate) fn new(t: &Tensor) -> Result<Self> {
        let (batch, tokens, heads, head_dim) = t.dims4().map_err(|_| {
            candle_core::Error::Msg(format!(
                "flash_attention: a heads view needs a [B, T, heads, D] tensor, got shape {:?}",
                t.dims()
            ))
        })?;
        let l = t.layout();
        if l.stride()[3] != 1 && head_dim > 1 {
            candle_core::bail!(
                "flash_attention: the head dimension of a heads view must be contiguous, got \
                 strides {:?}; make the tensor contiguous first",
                l.stride()
            );
        }
        let s = Strides::of_layout(l);
        Ok(HeadsView {
            tensor: t.clone(),
            offset: s.offset,
            batch_stride: s.batch,
            token_stride: s.token,
            head_stride: s.head,
            batch,
            tokens,
            heads,
            head_dim,
        })
    }

    fn strides(&self) -> Strides {
        Strides {
            offset: self.offset,
            batch: self.batch_stride,
            token: self.token_stride,
            head: self.head_stride,
        }
    }

    /// An error unless the view lies inside a storage of `len` elements.
    fn check_inside(&self, what: &str, len: usize) -> Result<()> {
        let end = self
            .strides()
            .end(self.batch, self.tokens, self.heads, self.head_dim);
        if end > len {
            candle_core::bail!(
                "flash_attention: the {what} heads view (offset {}, strides {:?}, shape [{}, {}, \
                 {}, {}]) reads up to element {end} of a storage of {len} elements",
                self.offset,
                [self.batch_stride, self.token_stride, self.head_stride, 1],
                self.batch,
                self.tokens,
                self.heads,
                self.head_dim
            );
        }
        Ok(())
    }
}

/// The forward pass on heads read in place: the attention output `[B, T, H, D]` (contiguous, in
/// the dtype of `q`) and the log-sum-exp of every query row's scaled scores, `[B, H, T]` (f32;
/// f64 for f64 inputs, so that the backward pass keeps f64's precision). Records no gradient.
pub(crate) fn flash_forward(
    q: &HeadsView,
    k: &HeadsView,
    v: &HeadsView,
    scale: f64,
) -> Result<(Tensor, Tensor)> {
    let dims = check_views(q, k, v, scale)?;
    let (sq, _) = q.tensor.storage_and_layout();
    let (sk, _) = k.tensor.storage_and_layout();
    let (sv, _) = v.tensor.storage_and_layout();
    let (o_shape, lse_shape) = (
        (dims.batch, dims.tokens, dims.heads, dims.head_dim),
        (dims.batch, dims.heads, dims.tokens),
    );
    match (&*sq, &*sk, &*sv) {
        (Storage::Cpu(sq), Storage::Cpu(sk), Storage::Cpu(sv)) => {
            for (view, s, what) in [(q, sq, "query"), (k, sk, "key"), (v, sv, "value")] {
                view.check_inside(what, storage_len(s))?;
            }
            let (o, lse) = cpu_forward(
                (sq, q.strides()),
                (sk, k.strides()),
                (sv, v.strides()),
                dims,
                scale,
            )?;
            let o = Tensor::from_storage(Storage::Cpu(o), o_shape, BackpropOp::none(), false);
            let lse = Tensor::from_storage(Storage::Cpu(lse), lse_shape, BackpropOp::none(), false);
            Ok((o, lse))
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(sq), Storage::Cuda(sk), Storage::Cuda(sv)) => {
            for (view, s, what) in [(q, sq, "query"), (k, sk, "key"), (v, sv, "value")] {
                view.check_inside(what, cuda::storage_len(s)?)?;
            }
            let (o, lse) = cuda::forward(
                (sq, q.strides()),
                (sk, k.strides()),
                (sv, v.strides()),
                dims,
                scale,
            )?;
            let o = Tensor::from_storage(Storage::Cuda(o), o_shape, BackpropOp::none(), false);
            let lse =
                Tensor::from_storage(Storage::Cuda(lse), lse_shape, BackpropOp::none(), false);
            Ok((o, lse))
        }
        _ => Err(no_kernel(q.tensor.device())),
    }
}

/// The backward pass on heads read in place: from the forward's inputs, its output `o` `[B, T,
/// H, D]`, the output's gradient `d_o` and the log-sum-exp `lse` `[B, H, T]` that
/// [`flash_forward`] returned, the gradients of `q`, `k` and `v` packed into one contiguous
/// `[B, T, H + 2·Hkv, D]` tensor (the query heads, then the key heads, then the value heads: the
/// layout of a packed QKV projection's output), in the dtype of `q`. Deterministic: `dk`/`dv`
/// are summed over each group's query heads in a fixed order, with no atomics.
pub(crate) fn flash_backward(
    q: &HeadsView,
    k: &HeadsView,
    v: &HeadsView,
    o: &Tensor,
    d_o: &Tensor,
    lse: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let dims = check_views(q, k, v, scale)?;
    let o_shape = [dims.batch, dims.tokens, dims.heads, dims.head_dim];
    for (t, what) in [(o, "o"), (d_o, "d_o"), (lse, "lse")] {
        if !t.device().same_device(q.tensor.device()) {
            candle_core::bail!(
                "flash_attention backward: {what} is on {:?}, q on {:?}; move them to one device",
                t.device(),
                q.tensor.device()
            );
        }
    }
    for (t, what) in [(o, "o"), (d_o, "d_o")] {
        if t.dims() != o_shape || t.dtype() != q.tensor.dtype() {
            candle_core::bail!(
                "flash_attention backward: {what} must be {o_shape:?} in {:?} like q, got {:?} in \
                 {:?}",
                q.tensor.dtype(),
                t.dims(),
                t.dtype()
            );
        }
    }
    let lse_dtype = lse_dtype(q.tensor.dtype());
    if lse.dims() != [dims.batch, dims.heads, dims.tokens] || lse.dtype() != lse_dtype {
        candle_core::bail!(
            "flash_attention backward: lse must be [{}, {}, {}] in {lse_dtype:?} (as \
             flash_forward returns it), got {:?} in {:?}",
            dims.batch,
            dims.heads,
            dims.tokens,
            lse.dims(),
            lse.dtype()
        );
    }
    let (o, d_o, lse) = (o.contiguous()?, d_o.contiguous()?, lse.contiguous()?);
    let (sq, _) = q.tensor.storage_and_layout();
    let (sk, _) = k.tensor.storage_and_layout();
    let (sv, _) = v.tensor.storage_and_layout();
    let (so, lo) = o.storage_and_layout();
    let (sdo, ldo) = d_o.storage_and_layout();
    let (slse, llse) = lse.storage_and_layout();
    let offsets = [lo.start_offset(), ldo.start_offset(), llse.start_offset()];
    match (&*sq, &*sk, &*sv, &*so, &*sdo, &*slse) {
        (
            Storage::Cpu(sq),
            Storage::Cpu(sk),
            Storage::Cpu(sv),
            Storage::Cpu(so),
            Storage::Cpu(sdo),
            Storage::Cpu(slse),
        ) => {
            for (view, s, what) in [(q, sq, "query"), (k, sk, "key"), (v, sv, "value")] {
                view.check_inside(what, storage_len(s))?;
            }
            let dqkv = cpu_backward(
                [(sq, q.strides()), (sk, k.strides()), (sv, v.strides())],
                [(so, offsets[0]), (sdo, offsets[1]), (slse, offsets[2])],
                dims,
                scale,
            )?;
            Ok(Tensor::from_storage(
                Storage::Cpu(dqkv),
                dims.packed(),
                BackpropOp::none(),
                false,
            ))
        }
        #[cfg(feature = "cuda")]
        (
            Storage::Cuda(sq),
            Storage::Cuda(sk),
            Storage::Cuda(sv),
            Storage::Cuda(so),
            Storage::Cuda(sdo),
            Storage::Cuda(slse),
        ) => {
            for (view, s, what) in [(q, sq, "query"), (k, sk, "key"), (v, sv, "value")] {
                view.check_inside(what, cuda::storage_len(s)?)?;
            }
            let dqkv = cuda::backward(
                [(sq, q.strides()), (sk, k.strides()), (sv, v.strides())],
                [(so, offsets[0]), (sdo, offsets[1]), (slse, offsets[2])],
                dims,
                scale,
            )?;
            Ok(Tensor::from_storage(
                Storage::Cuda(dqkv),
                dims.packed(),
                BackpropOp::none(),
                false,
            ))
        }
        _ => Err(no_kernel(q.tensor.device())),
    }
}

/// The dtype of the saved log-sum-exp for inputs of `dtype`: the arithmetic type.
pub(crate) fn lse_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn no_kernel(device: &Device) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "flash_attention: no kernel for {device:?} (the CPU always; CUDA with the `cuda` feature); \
         the public flash_attention computes the formula with candle's ops there"
    ))
}

fn storage_len(s: &CpuStorage) -> usize {
    match s {
        CpuStorage::F32(v) => v.len(),
        CpuStorage::F64(v) => v.len(),
        CpuStorage::BF16(v) => v.len(),
        CpuStorage::F16(v) => v.len(),
        // Other dtypes were refused before any storage is read.
        _ => 0,
    }
}

/// The trainable op: `(q, k, v) → o`, keeping the log-sum-exp for its backward pass.
struct FlashAttention {
    scale: f64,
    /// The forward's per-row log-sum-exp `[B, H, T]`, set by the forward pass.
    lse: Mutex<Option<Tensor>>,
}

impl FlashAttention {
    fn keep(&self, lse: Tensor) {
        // A poisoned lock only means another thread panicked while holding it; the value is
        // replaced whole, so it cannot be half-written.
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
    }
}

/// The sizes of `(q, k, v)` layouts the public function checked.
fn dims_of_layouts(lq: &Layout, lk: &Layout) -> Dims {
    let (q, k) = (lq.dims(), lk.dims());
    Dims {
        batch: q[0],
        tokens: q[1],
        heads: q[2],
        kv_heads: k[2],
        head_dim: q[3],
    }
}

impl CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "flash_attention"
    }

    fn cpu_fwd(
        &self,
        sq: &CpuStorage,
        lq: &Layout,
        sk: &CpuStorage,
        lk: &Layout,
        sv: &CpuStorage,
        lv: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = dims_of_layouts(lq, lk);
        let (o, lse) = cpu_forward(
            (sq, Strides::of_layout(lq)),
            (sk, Strides::of_layout(lk)),
            (sv, Strides::of_layout(lv)),
            dims,
            self.scale,
        )?;
        self.keep(Tensor::from_storage(
            Storage::Cpu(lse),
            (dims.batch, dims.heads, dims.tokens),
            BackpropOp::none(),
            false,
        ));
        Ok((o, lq.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sq: &candle_core::CudaStorage,
        lq: &Layout,
        sk: &candle_core::CudaStorage,
        lk: &Layout,
        sv: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = dims_of_layouts(lq, lk);
        let (o, lse) = cuda::forward(
            (sq, Strides::of_layout(lq)),
            (sk, Strides::of_layout(lk)),
            (sv, Strides::of_layout(lv)),
            dims,
            self.scale,
        )?;
        self.keep(Tensor::from_storage(
            Storage::Cuda(lse),
            (dims.batch, dims.heads, dims.tokens),
            BackpropOp::none(),
            false,
        ));
        Ok((o, lq.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        d_o: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = self
            .lse
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| {
                candle_core::Error::Msg(
                    "flash_attention backward: the forward pass saved no log-sum-exp".into(),
                )
            })?;
        let (h, hkv) = (q.dim(2)?, k.dim(2)?);
        let dqkv = flash_backward(
            &HeadsView::new(q)?,
            &HeadsView::new(k)?,
            &HeadsView::new(v)?,
            o,
            d_o,
            &lse,
            self.scale,
        )?;
        Ok((
            Some(dqkv.narrow(2, 0, h)?),
            Some(dqkv.narrow(2, h, hkv)?),
            Some(dqkv.narrow(2, h + hkv, hkv)?),
        ))
    }
}

/// The CPU forward on three storages with their strides: `(o, lse)`.
fn cpu_forward(
    q: (&CpuStorage, Strides),
    k: (&CpuStorage, Strides),
    v: (&CpuStorage, Strides),
    dims: Dims,
    scale: f64,
) -> Result<(CpuStorage, CpuStorage)> {
    fn run<T: Element>(
        q: (&CpuStorage, Strides),
        k: (&CpuStorage, Strides),
        v: (&CpuStorage, Strides),
        dims: Dims,
        scale: f64,
    ) -> Result<(CpuStorage, CpuStorage)>
    where
        T::Acc: cpu::Arith,
    {
        let (o, lse) = cpu::forward::<T>(
            source(q, "q")?,
            source(k, "k")?,
            source(v, "v")?,
            dims,
            scale,
        );
        Ok((T::storage(o), cpu::Arith::storage(lse)))
    }
    dispatch!("flash_attention", q.0, run(q, k, v, dims, scale))
}

/// The CPU backward: the packed `dqkv` from `q`, `k`, `v` with their strides and the contiguous
/// `o`, `d_o`, `lse` with their offsets.
fn cpu_backward(
    qkv: [(&CpuStorage, Strides); 3],
    saved: [(&CpuStorage, usize); 3],
    dims: Dims,
    scale: f64,
) -> Result<CpuStorage> {
    fn run<T: Element>(
        qkv: [(&CpuStorage, Strides); 3],
        saved: [(&CpuStorage, usize); 3],
        dims: Dims,
        scale: f64,
    ) -> Result<CpuStorage>
    where
        T::Acc: cpu::Arith,
    {
        let n = dims.batch * dims.tokens * dims.heads * dims.head_dim;
        let rows = dims.batch * dims.heads * dims.tokens;
        let o = elements::<T>(saved[0].0, "o")?;
        let d_o = elements::<T>(saved[1].0, "d_o")?;
        let lse = <T::Acc as cpu::Arith>::slice(saved[2].0).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "flash_attention backward: lse has dtype {:?}, expected {:?}",
                saved[2].0.dtype(),
                lse_dtype(T::DTYPE)
            ))
        })?;
        let dqkv = cpu::backward::<T>(
            [
                source(qkv[0], "q")?,
                source(qkv[1], "k")?,
                source(qkv[2], "v")?,
            ],
            &o[saved[0].1..saved[0].1 + n],
            &d_o[saved[1].1..saved[1].1 + n],
            &lse[saved[2].1..saved[2].1 + rows],
            dims,
            scale,
        );
        Ok(T::storage(dqkv))
    }
    dispatch!("flash_attention", qkv[0].0, run(qkv, saved, dims, scale))
}

fn elements<'a, T: Element>(s: &'a CpuStorage, what: &str) -> Result<&'a [T]> {
    T::slice(s).ok_or_else(|| {
        candle_core::Error::Msg(format!(
            "flash_attention: {what} has dtype {:?}, expected {:?} like q",
            s.dtype(),
            T::DTYPE
        ))
    })
}

fn source<'a, T: Element>(
    (s, at): (&'a CpuStorage, Strides),
    what: &str,
) -> Result<cpu::Source<'a, T>> {
    Ok(cpu::Source {
        data: elements::<T>(s, what)?,
        at,
    })
}

/// `x` itself when its last dimension is contiguous, else a contiguous copy.
fn unit_last(x: &Tensor) -> Result<Tensor> {
    let l = x.layout();
    if l.stride()[3] == 1 || l.dims()[3] <= 1 {
        Ok(x.clone())
    } else {
        x.contiguous()
    }
}

/// Checks the public function's arguments: `[B, T, H, D]`, `[B, T, Hkv, D]` twice, `Hkv`
/// dividing `H`, one dtype and device, a finite scale.
fn check_tensors(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Dims> {
    for (t, what, names) in [
        (q, "q", "[B, T, H, D]"),
        (k, "k", "[B, T, Hkv, D]"),
        (v, "v", "[B, T, Hkv, D]"),
    ] {
        if t.rank() != 4 {
            candle_core::bail!(
                "flash_attention: {what} must have shape {names} (batch, tokens, heads, head \
                 dim), got {:?}",
                t.dims()
            );
        }
    }
    let (b, t, h, d) = q.dims4()?;
    let hkv = k.dim(2)?;
    if k.dims() != v.dims() || k.dims() != [b, t, hkv, d] {
        candle_core::bail!(
            "flash_attention: k and v must both be [B, T, Hkv, D] with q's B = {b}, T = {t}, D = \
             {d}; got q {:?}, k {:?}, v {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    let dims = Dims {
        batch: b,
        tokens: t,
        heads: h,
        kv_heads: hkv,
        head_dim: d,
    };
    check_common(
        dims,
        [q.dtype(), k.dtype(), v.dtype()],
        [q.device(), k.device(), v.device()],
        scale,
    )?;
    Ok(dims)
}

/// Checks the internal functions' views like [`check_tensors`].
fn check_views(q: &HeadsView, k: &HeadsView, v: &HeadsView, scale: f64) -> Result<Dims> {
    let shape = |x: &HeadsView| [x.batch, x.tokens, x.heads, x.head_dim];
    if shape(k) != shape(v) || [k.batch, k.tokens, k.head_dim] != [q.batch, q.tokens, q.head_dim] {
        candle_core::bail!(
            "flash_attention: the key and value views must both be [B, T, Hkv, D] with the query \
             view's B, T and D; got q {:?}, k {:?}, v {:?}",
            shape(q),
            shape(k),
            shape(v)
        );
    }
    let dims = Dims {
        batch: q.batch,
        tokens: q.tokens,
        heads: q.heads,
        kv_heads: k.heads,
        head_dim: q.head_dim,
    };
    check_common(
        dims,
        [q.tensor.dtype(), k.tensor.dtype(), v.tensor.dtype()],
        [q.tensor.device(), k.tensor.device(), v.tensor.device()],
        scale,
    )?;
    Ok(dims)
}

fn check_common(dims: Dims, dtypes: [DType; 3], devices: [&Device; 3], scale: f64) -> Result<()> {
    let (h, hkv) = (dims.heads, dims.kv_heads);
    if dims.head_dim == 0 {
        candle_core::bail!("flash_attention: the head dimension D is 0; a head needs at least one");
    }
    if hkv == 0 || h % hkv != 0 {
        candle_core::bail!(
            "flash_attention: the {h} query heads must be a multiple of the {hkv} key/value heads \
             (grouped-query attention shares each key/value head among H / Hkv query heads)"
        );
    }
    if dtypes[1] != dtypes[0] || dtypes[2] != dtypes[0] {
        candle_core::bail!(
            "flash_attention: q, k and v must share one dtype, got {:?}, {:?}, {:?}",
            dtypes[0],
            dtypes[1],
            dtypes[2]
        );
    }
    if !matches!(
        dtypes[0],
        DType::F32 | DType::F64 | DType::BF16 | DType::F16
    ) {
        return Err(crate::element::unsupported("flash_attention", dtypes[0]));
    }
    if !devices[1].same_device(devices[0]) || !devices[2].same_device(devices[0]) {
        candle_core::bail!(
            "flash_attention: q, k and v must be on one device, got {:?}, {:?}, {:?}",
            devices[0],
            devices[1],
            devices[2]
        );
    }
    if !scale.is_finite() {
        candle_core::bail!("flash_attention: softmax_scale must be finite, got {scale}");
    }
    Ok(())
}

/// The formula with candle's ops (`T × T` scores, `repeat_kv` copies), for devices without a
/// kernel and for empty tensors.
fn fallback(q: &Tensor, k: &Tensor, v: &Tensor, dims: Dims, scale: f64) -> Result<Tensor> {
    let Dims {
        batch: b,
        tokens: t,
        heads: h,
        kv_heads: hkv,
        head_dim: d,
    } = dims;
    let group = dims.group();
    // [B, T, Hkv, D] -> [B, H, T, D], each key/value head repeated for its group's query heads.
    let expand = |x: &Tensor| -> Result<Tensor> {
        x.transpose(1, 2)?
            .unsqueeze(2)?
            .broadcast_as((b, hkv, group, t, d))?
            .reshape((b, h, t, d))
    };
    let q = q.transpose(1, 2)?.contiguous()?;
    let (k, v) = (expand(k)?, expand(v)?);
    let p = crate::causal_softmax(&q.matmul(&k.t()?)?, scale)?;
    p.matmul(&v)?.transpose(1, 2)?.contiguous()
}
