//! The CUDA launches of `src/cuda/flash_attention.cu`: the tensor-core kernels for bf16/f16 at
//! head dims 64 and 128 (the only CUDA cases the crate sends here: see
//! [`super::fast_on`]).

use super::{Dims, Strides};
use crate::cuda::{cuda_dispatch, launch, output, CudaElement, FLASH_ATTENTION};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig};
use candle_core::{CudaStorage, DType, Result};

/// Threads of every block (`FLASH_THREADS` in the `.cu`).
const THREADS: u32 = 128;

/// Rows per block of the tensor-core kernels (`FLASH_ROWS`).
const ROWS: usize = 64;

/// Largest grid `y` (the batch × heads of a launch).
const MAX_GRID_Y: usize = 65_535;

/// The number of elements of a CUDA storage.
pub(super) fn storage_len(s: &CudaStorage) -> Result<usize> {
    Ok(match s.dtype() {
        DType::F32 => s.as_cuda_slice::<f32>()?.len(),
        DType::F64 => s.as_cuda_slice::<f64>()?.len(),
        DType::BF16 => s.as_cuda_slice::<half::bf16>()?.len(),
        DType::F16 => s.as_cuda_slice::<half::f16>()?.len(),
        other => return Err(crate::element::unsupported("flash_attention", other)),
    })
}

/// Whether `T` at `head_dim` runs on tensor cores.
fn tensor_cores<T: CudaElement>(head_dim: usize) -> bool {
    super::has_tensor_core_kernel(T::DTYPE, head_dim)
}

/// A view of `s`'s elements from `offset`.
fn view<T: CudaElement>(s: &CudaStorage, offset: usize) -> Result<CudaView<'_, T>> {
    let slice = s.as_cuda_slice::<T>()?;
    Ok(slice.slice(offset..))
}

/// An error unless the dtype and head dim have tensor-core kernels and the shape fits the grids.
fn check_launch<T: CudaElement>(dims: Dims) -> Result<()> {
    if dims.batch * dims.tokens == 0 {
        candle_core::bail!(
            "flash_attention on CUDA: B = {} and T = {} leave nothing to compute; the public \
             flash_attention handles empty tensors",
            dims.batch,
            dims.tokens
        );
    }
    if dims.batch * dims.heads > MAX_GRID_Y {
        candle_core::bail!(
            "flash_attention on CUDA: B·H = {} exceeds the {MAX_GRID_Y} blocks of a grid's y \
             dimension; split the batch",
            dims.batch * dims.heads
        );
    }
    if !tensor_cores::<T>(dims.head_dim) {
        candle_core::bail!(
            "flash_attention on CUDA: no kernel for head dim {} in {:?} (the tensor-core kernels \
             take bf16/f16 at head dims 64 and 128; the public flash_attention and the fused \
             layers compute other cases with candle's products)",
            dims.head_dim,
            T::DTYPE
        );
    }
    Ok(())
}

/// A grid of `x` × `y` blocks of [`THREADS`] with `shared` bytes of dynamic shared memory.
fn grid(x: usize, y: usize, shared: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared as u32,
    }
}

/// The forward pass: `o` `[B, T, H, D]` and `lse` `[B, H, T]` (the arithmetic type).
pub(super) fn forward(
    q: (&CudaStorage, Strides),
    k: (&CudaStorage, Strides),
    v: (&CudaStorage, Strides),
    dims: Dims,
    scale: f64,
) -> Result<(CudaStorage, CudaStorage)> {
    fn run<T: CudaElement>(
        (sq, aq): (&CudaStorage, Strides),
        (sk, ak): (&CudaStorage, Strides),
        (sv, av): (&CudaStorage, Strides),
        dims: Dims,
        scale: f64,
    ) -> Result<(CudaStorage, CudaStorage)> {
        check_launch::<T>(dims)?;
        let dev = &sq.device;
        let (qv, kv, vv) = (
            view::<T>(sq, aq.offset)?,
            view::<T>(sk, ak.offset)?,
            view::<T>(sv, av.offset)?,
        );
        let Dims {
            batch,
            tokens,
            heads,
            kv_heads,
            head_dim: d,
        } = dims;
        let [q_sb, q_st, q_sh] = [aq.batch as u64, aq.token as u64, aq.head as u64];
        let [k_sb, k_st, k_sh] = [ak.batch as u64, ak.token as u64, ak.head as u64];
        let [v_sb, v_st, v_sh] = [av.batch as u64, av.token as u64, av.head as u64];
        let (t64, h64, hkv64) = (tokens as u64, heads as u64, kv_heads as u64);
        let mut o = output::<T>(dev, batch * tokens * heads * d)?;
        let mut lse = output::<T::Acc>(dev, batch * heads * tokens)?;
        let cfg = grid(tokens.div_ceil(ROWS), batch * heads, 0);
        macro_rules! forward_mma {
            ($name:literal) => {
                launch!(dev, FLASH_ATTENTION, $name, T, cfg;
                    &qv, &q_sb, &q_st, &q_sh, &kv, &k_sb, &k_st, &k_sh, &vv, &v_sb, &v_st,
                    &v_sh, &mut o, &mut lse, &t64, &h64, &hkv64, &scale)
            };
        }
        if d == 64 {
            forward_mma!("flash_forward_mma_d64");
        } else {
            forward_mma!("flash_forward_mma_d128");
        }
        Ok((
            CudaStorage::wrap_cuda_slice(o, dev.clone()),
            CudaStorage::wrap_cuda_slice(lse, dev.clone()),
        ))
    }
    cuda_dispatch!("flash_attention", q.0, run(q, k, v, dims, scale))
}

/// The backward pass: the packed `dqkv` `[B, T, H + 2·Hkv, D]` from `q`, `k`, `v` with their
/// strides and the contiguous `o`, `d_o` `[B, T, H, D]` and `lse` `[B, H, T]` at their offsets.
pub(super) fn backward(
    qkv: [(&CudaStorage, Strides); 3],
    saved: [(&CudaStorage, usize); 3],
    dims: Dims,
    scale: f64,
) -> Result<CudaStorage> {
    fn run<T: CudaElement>(
        [(sq, aq), (sk, ak), (sv, av)]: [(&CudaStorage, Strides); 3],
        [(so, oo), (sdo, odo), (slse, olse)]: [(&CudaStorage, usize); 3],
        dims: Dims,
        scale: f64,
    ) -> Result<CudaStorage> {
        check_launch::<T>(dims)?;
        let dev = &sq.device;
        let Dims {
            batch,
            tokens,
            heads,
            kv_heads,
            head_dim: d,
        } = dims;
        let (qv, kv, vv) = (
            view::<T>(sq, aq.offset)?,
            view::<T>(sk, ak.offset)?,
            view::<T>(sv, av.offset)?,
        );
        let n = batch * tokens * heads * d;
        let rows = batch * heads * tokens;
        let o = so.as_cuda_slice::<T>()?.slice(oo..oo + n);
        let d_o = sdo.as_cuda_slice::<T>()?.slice(odo..odo + n);
        let lse = slse.as_cuda_slice::<T::Acc>()?.slice(olse..olse + rows);
        let [q_sb, q_st, q_sh] = [aq.batch as u64, aq.token as u64, aq.head as u64];
        let [k_sb, k_st, k_sh] = [ak.batch as u64, ak.token as u64, ak.head as u64];
        let [v_sb, v_st, v_sh] = [av.batch as u64, av.token as u64, av.head as u64];
        let (t64, h64, hkv64, d64) = (tokens as u64, heads as u64, kv_heads as u64, d as u64);
        let rows64 = rows as u64;

        // Δ = rowsum(dO ∘ O): one warp per row, 8 warps per block.
        let mut delta = output::<T::Acc>(dev, rows)?;
        let delta_cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(8).clamp(1, 4096) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(dev, FLASH_ATTENTION, "flash_delta", T, delta_cfg;
            &o, &d_o, &mut delta, &rows64, &t64, &h64, &d64);

        // Every element is written: dq by the blocks of every query row, dk/dv by those of every
        // key row.
        let mut dqkv = output::<T>(dev, batch * tokens * (heads + 2 * kv_heads) * d)?;
        let q_cfg = grid(tokens.div_ceil(ROWS), batch * heads, 0);
        let kv_cfg = grid(tokens.div_ceil(ROWS), batch * kv_heads, 0);
        macro_rules! backward_mma {
            ($dq:literal, $dkv:literal) => {
                launch!(dev, FLASH_ATTENTION, $dq, T, q_cfg;
                    &qv, &q_sb, &q_st, &q_sh, &kv, &k_sb, &k_st, &k_sh, &vv, &v_sb, &v_st,
                    &v_sh, &d_o, &lse, &delta, &mut dqkv, &t64, &h64, &hkv64, &scale);
                launch!(dev, FLASH_ATTENTION, $dkv, T, kv_cfg;
                    &qv, &q_sb, &q_st, &q_sh, &kv, &k_sb, &k_st, &k_sh, &vv, &v_sb, &v_st,
                    &v_sh, &d_o, &lse, &delta, &mut dqkv, &t64, &h64, &hkv64, &scale);
            };
        }
        if d == 64 {
            backward_mma!("flash_dq_mma_d64", "flash_dkv_mma_d64");
        } else {
            backward_mma!("flash_dq_mma_d128", "flash_dkv_mma_d128");
        }
        Ok(CudaStorage::wrap_cuda_slice(dqkv, dev.clone()))
    }
    cuda_dispatch!("flash_attention", qkv[0].0, run(qkv, saved, dims, scale))
}
