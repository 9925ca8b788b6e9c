//! Embedding lookup (`table[ids]`, candle's `Embedding::forward`, PyTorch's `F.embedding`) whose
//! gradient is a deterministic scatter-add accumulated in f32: candle's backward goes through
//! `index_add`, which on CUDA adds with atomics in the table's dtype (bf16 sums rounded at every
//! add, in an order that changes from run to run).

#[cfg(feature = "cuda")]
use crate::cuda::{cuda_dispatch, input, launch, output, storage, CudaElement, EMBEDDING};
use crate::element::{contiguous, dispatch, Element};
use crate::rows::for_each_row;
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use num_traits::Zero;

/// The rows of `table` `[v, c]` named by `ids` `[...]`: an output `[..., c]` whose row `p` is
/// `table[ids[p]]`.
///
/// `ids` are token indices: u32, i64 (PyTorch's) or u8 are read as they are, i16/i32 are widened
/// to i64 (a negative id is then reported as negative, not as a wrapped u32). `table` is f32,
/// f64, bf16 or f16.
///
/// Gradient (to `table` only): `d_table[r] = Σ_{p : ids[p] = r} dy[p]`, a dense `[v, c]` tensor
/// (zeros for rows no id names), accumulated in f32 (f64 for f64) over the positions in
/// increasing order and rounded once to the table's dtype. No atomics: the same bits on every
/// run, on any number of threads, and the same bits on the CPU and on CUDA.
///
/// On the CPU the op works on the distinct rows the ids name (gathered with candle's
/// `index_select`, whose backward writes the dense gradient in one pass); the sums are the same.
///
/// An id that is not a row of the table (negative or `>= v`) is an error naming it on the CPU.
/// On CUDA it gives a NaN output row (so the loss shows it) and adds nothing to the gradient:
/// naming it would need the ids on the host, a synchronization in every training step.
pub fn embedding(ids: &Tensor, table: &Tensor) -> Result<Tensor> {
    let (v, c) = match *table.dims() {
        [v, c] => (v, c),
        _ => candle_core::bail!(
            "embedding: table must have shape [rows, width], got {:?}",
            table.dims()
        ),
    };
    let ids = match ids.dtype() {
        DType::U32 | DType::I64 => ids.contiguous()?,
        // u8 stays u8 on the CPU (read as is); CUDA kernels read u32 or i64.
        DType::U8 if ids.device().is_cpu() => ids.contiguous()?,
        DType::U8 => ids.to_dtype(DType::U32)?,
        DType::I16 | DType::I32 => ids.to_dtype(DType::I64)?,
        other => candle_core::bail!(
            "embedding: ids must be token indices (u32, i64, u8, or i16/i32), got {other:?}"
        ),
    };
    let on_kernel_device = match table.device() {
        candle_core::Device::Cpu => true,
        // Empty tensors take candle's ops, which launch nothing.
        candle_core::Device::Cuda(_) => {
            cfg!(feature = "cuda") && ids.elem_count() > 0 && table.elem_count() > 0
        }
        _ => false,
    };
    if !on_kernel_device {
        let mut dims = ids.dims().to_vec();
        dims.push(c);
        return table.index_select(&ids.flatten_all()?, 0)?.reshape(dims);
    }
    if table.device().is_cpu() {
        // candle adds a custom op's gradient into a zero tensor of its input's shape, one more
        // pass over the whole [v, c] table (a slow one in bf16), where the backward of its
        // `index_select` adds rows straight into the zero table. So on the CPU the op runs on the
        // distinct rows the ids name, gathered by `index_select`: its backward sums each row's
        // positions in f32 in order as always, and candle then adds each sum once into zeros
        // (exactly), the dense part done once, by candle.
        let (distinct, inverse) = distinct_rows(&ids, v, c)?;
        let rows = table.index_select(&distinct, 0)?;
        return rows.apply_op2(
            &inverse,
            Embedding {
                v: distinct.elem_count(),
                c,
            },
        );
    }
    table.contiguous()?.apply_op2(&ids, Embedding { v, c })
}

/// The distinct rows the CPU ids name, increasing (`[u]`, u32), and each id's index among them
/// (the shape of `ids`, u32), or an error naming the first id that is not a row of the table
/// `[v, c]`.
fn distinct_rows(ids: &Tensor, v: usize, c: usize) -> Result<(Tensor, Tensor)> {
    let flat: Vec<i64> = ids.flatten_all()?.to_dtype(DType::I64)?.to_vec1()?;
    // slot[r]: the index of row r among the distinct rows, u32::MAX for rows no id names.
    let mut slot = vec![u32::MAX; v];
    for (p, &id) in flat.iter().enumerate() {
        match usize::try_from(id).ok().filter(|&r| r < v) {
            Some(r) => slot[r] = 0,
            None => candle_core::bail!(
                "embedding: ids[{p}] = {id} (of the flattened ids {:?}) is not a row of the table \
                 [{v}, {c}]; token ids must be in 0..{v}",
                ids.dims()
            ),
        }
    }
    let mut distinct = Vec::new();
    for (r, s) in slot.iter_mut().enumerate() {
        if *s != u32::MAX {
            *s = distinct.len() as u32;
            distinct.push(r as u32);
        }
    }
    let inverse: Vec<u32> = flat.iter().map(|&id| slot[id as usize]).collect();
    let n = distinct.len();
    Ok((
        Tensor::from_vec(distinct, n, ids.device())?,
        Tensor::from_vec(inverse, ids.dims(), ids.device())?,
    ))
}

/// A token id type the CPU kernels read.
trait TokenId: Copy + Send + Sync + std::fmt::Display + 'static {
    /// The ids of the storage when it holds this type.
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    /// The row of a table of `v` rows this id names, if any.
    fn row(self, v: usize) -> Option<usize>;
}

impl TokenId for u32 {
    fn slice(s: &CpuStorage) -> Option<&[Self]> {
        match s {
            CpuStorage::U32(ids) => Some(ids),
            _ => None,
        }
    }
    #[inline(always)]
    fn row(self, v: usize) -> Option<usize> {
        ((self as usize) < v).then_some(self as usize)
    }
}

impl TokenId for i64 {
    fn slice(s: &CpuStorage) -> Option<&[Self]> {
        match s {
            CpuStorage::I64(ids) => Some(ids),
            _ => None,
        }
    }
    #[inline(always)]
    fn row(self, v: usize) -> Option<usize> {
        usize::try_from(self).ok().filter(|&r| r < v)
    }
}

impl TokenId for u8 {
    fn slice(s: &CpuStorage) -> Option<&[Self]> {
        match s {
            CpuStorage::U8(ids) => Some(ids),
            _ => None,
        }
    }
    #[inline(always)]
    fn row(self, v: usize) -> Option<usize> {
        ((self as usize) < v).then_some(self as usize)
    }
}

/// Calls `$f::<T, I>(args)` with `I` the id type of the CPU storage `$ids`.
macro_rules! with_ids {
    ($op:expr, $ids:expr, $f:ident::<$t:ty>($($arg:expr),* $(,)?)) => {
        match $ids {
            CpuStorage::U32(_) => $f::<$t, u32>($($arg),*),
            CpuStorage::I64(_) => $f::<$t, i64>($($arg),*),
            CpuStorage::U8(_) => $f::<$t, u8>($($arg),*),
            other => candle_core::bail!(
                "{}: ids must be u32, i64 or u8 (the public function converts them), got {:?}",
                $op,
                candle_core::backend::BackendStorage::dtype(other)
            ),
        }
    };
}

/// The contiguous ids of a CPU op, each checked to name one of the `v` rows of a table of
/// width `c`.
fn checked_ids<'a, I: TokenId>(
    op: &str,
    s: &'a CpuStorage,
    l: &Layout,
    v: usize,
    c: usize,
) -> Result<&'a [I]> {
    let Some(all) = I::slice(s) else {
        candle_core::bail!("{op}: ids changed dtype");
    };
    let Some((start, end)) = l.contiguous_offsets() else {
        candle_core::bail!("{op}: ids are not contiguous");
    };
    let ids = &all[start..end];
    if let Some((p, bad)) = ids.iter().enumerate().find(|(_, id)| id.row(v).is_none()) {
        candle_core::bail!(
            "{op}: ids[{p}] = {bad} (of the flattened ids {:?}) is not a row of the table \
             [{v}, {c}]; token ids must be in 0..{v}",
            l.dims()
        );
    }
    Ok(ids)
}

/// The forward op: `(table [v, c], ids [...]) → [..., c]`.
struct Embedding {
    /// Rows of the table.
    v: usize,
    /// Width of the table.
    c: usize,
}

impl Embedding {
    /// The output shape for ids of `ids_dims`.
    fn out_shape(&self, ids_dims: &[usize]) -> Shape {
        let mut dims = ids_dims.to_vec();
        dims.push(self.c);
        Shape::from(dims)
    }
}

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Element, I: TokenId>(
            op: &Embedding,
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let table = contiguous::<T>("embedding", "table", s1, l1)?;
            let ids = checked_ids::<I>("embedding", s2, l2, op.v, op.c)?;
            let c = op.c;
            // One sequential copy: a memory-bound gather gains little from threads, and
            // building the vector row by row writes each element once.
            let mut out = Vec::with_capacity(ids.len() * c);
            for id in ids {
                if let Some(r) = id.row(op.v) {
                    out.extend_from_slice(&table[r * c..(r + 1) * c]);
                }
            }
            Ok((T::storage(out), op.out_shape(l2.dims())))
        }
        fn table_typed<T: Element>(
            op: &Embedding,
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            with_ids!("embedding", s2, run::<T>(op, s1, l1, s2, l2))
        }
        dispatch!("embedding", s1, table_typed(self, s1, l1, s2, l2))
    }

    /// One thread per output element.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: CudaElement>(
            op: &Embedding,
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let table = input::<T>("embedding", "table", s1, l1)?;
            let n = l2.shape().elem_count();
            let dev = &s1.device;
            let mut out = output::<T>(dev, n * op.c)?;
            let (n64, v64, c64) = (n as u64, op.v as u64, op.c as u64);
            let cfg = crate::cuda::elements_config(n * op.c);
            match cuda_ids("embedding", s2, l2)? {
                CudaIds::U32(ids) => launch!(dev, EMBEDDING, "embedding_u32", T, cfg;
                    &table, &ids, &mut out, &n64, &v64, &c64),
                CudaIds::I64(ids) => launch!(dev, EMBEDDING, "embedding_i64", T, cfg;
                    &table, &ids, &mut out, &n64, &v64, &c64),
            }
            Ok((storage(out, dev), op.out_shape(l2.dims())))
        }
        cuda_dispatch!("embedding", s1, run(self, s1, l1, s2, l2))
    }

    fn bwd(
        &self,
        _table: &Tensor,
        ids: &Tensor,
        _out: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = dy.contiguous()?.apply_op2_no_bwd(
            ids,
            &EmbeddingBackward {
                v: self.v,
                c: self.c,
            },
        )?;
        Ok((Some(grad), None))
    }
}

/// The backward op: `(dy [..., c], ids [...]) → d_table [v, c]`.
struct EmbeddingBackward {
    /// Rows of the table.
    v: usize,
    /// Width of the table.
    c: usize,
}

impl CustomOp2 for EmbeddingBackward {
    fn name(&self) -> &'static str {
        "embedding-backward"
    }

    /// A counting sort of the positions by id (stable: each row's positions stay in increasing
    /// order), then every table row sums its positions' rows of `dy` in that order, rows split
    /// over threads (a row's sum is never split, so the threads change nothing).
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Element, I: TokenId>(
            op: &EmbeddingBackward,
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            let name = "embedding-backward";
            let (v, c) = (op.v, op.c);
            let dy = contiguous::<T>(name, "dy", s1, l1)?;
            let ids = checked_ids::<I>(name, s2, l2, v, c)?;
            if dy.len() != ids.len() * c {
                candle_core::bail!(
                    "{name}: dy {:?} is not one row of {c} per id of {:?}",
                    l1.dims(),
                    l2.dims()
                );
            }
            // first[r]..first[r + 1]: where row r's positions are in `positions`.
            let mut first = vec![0usize; v + 1];
            for id in ids {
                if let Some(r) = id.row(v) {
                    first[r + 1] += 1;
                }
            }
            for r in 0..v {
                first[r + 1] += first[r];
            }
            let mut next = first.clone();
            let mut positions = vec![0usize; ids.len()];
            for (p, id) in ids.iter().enumerate() {
                if let Some(r) = id.row(v) {
                    positions[next[r]] = p;
                    next[r] += 1;
                }
            }
            // Zeroed by the allocator: the rows no id names are never written.
            let mut grad = T::zeros(v * c);
            for_each_row(&mut grad, c, |r, row| {
                let mine = &positions[first[r]..first[r + 1]];
                if mine.is_empty() {
                    return;
                }
                let mut acc = vec![<T::Acc>::zero(); c];
                for &p in mine {
                    for (a, d) in acc.iter_mut().zip(&dy[p * c..(p + 1) * c]) {
                        *a = *a + d.to_acc();
                    }
                }
                for (g, a) in row.iter_mut().zip(acc) {
                    *g = T::from_acc(a);
                }
            });
            Ok((T::storage(grad), Shape::from((v, c))))
        }
        fn dy_typed<T: Element>(
            op: &EmbeddingBackward,
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            with_ids!("embedding-backward", s2, run::<T>(op, s1, l1, s2, l2))
        }
        dispatch!("embedding-backward", s1, dy_typed(self, s1, l1, s2, l2))
    }

    /// One launch: each block owns `R` rows by `W` columns of the gradient (see `embedding.cu`).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn run<T: CudaElement>(
            op: &EmbeddingBackward,
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let name = "embedding-backward";
            let dy = input::<T>(name, "dy", s1, l1)?;
            let n = l2.shape().elem_count();
            let (v, c) = (op.v, op.c);
            let dev = &s1.device;
            let mut grad = output::<T>(dev, v * c)?;
            let tiles = BackwardTiles::new(v, c, std::mem::size_of::<T::Acc>());
            let cfg = tiles.launch(std::mem::size_of::<T::Acc>());
            let (n64, v64, c64) = (n as u64, v as u64, c as u64);
            let (rows64, cols64) = (tiles.rows as u64, tiles.cols as u64);
            match cuda_ids(name, s2, l2)? {
                CudaIds::U32(ids) => launch!(dev, EMBEDDING, "embedding_backward_u32", T, cfg;
                    &dy, &ids, &mut grad, &n64, &v64, &c64, &rows64, &cols64),
                CudaIds::I64(ids) => launch!(dev, EMBEDDING, "embedding_backward_i64", T, cfg;
                    &dy, &ids, &mut grad, &n64, &v64, &c64, &rows64, &cols64),
            }
            Ok((storage(grad, dev), Shape::from((v, c))))
        }
        cuda_dispatch!("embedding-backward", s1, run(self, s1, l1, s2, l2))
    }
}

/// Most bytes of dynamic shared memory a CUDA backward block accumulates in: with the kernel's
/// 4.2 KiB of static shared memory, within the 48 KiB a block gets without an opt-in.
#[cfg(any(feature = "cuda", test))]
const ACCUMULATOR_BYTES: usize = 40 * 1024;

/// Most threads of a CUDA backward block (`EMBEDDING_MAX_THREADS` of `embedding.cu`).
#[cfg(any(feature = "cuda", test))]
const MAX_THREADS: usize = 1024;

/// How the CUDA backward pass splits the gradient `[v, c]` over blocks: `rows` table rows by
/// `cols` columns each, as many rows as the accumulators hold (`ACCUMULATOR_BYTES / c` values
/// of the arithmetic type; one row of at most that many columns when `c` is wider).
#[cfg(any(feature = "cuda", test))]
#[derive(Debug, Clone, Copy, PartialEq)]
struct BackwardTiles {
    /// Table rows per block.
    rows: usize,
    /// Columns per block.
    cols: usize,
    /// Blocks over the rows.
    row_blocks: usize,
    /// Blocks over the columns.
    col_blocks: usize,
}

#[cfg(any(feature = "cuda", test))]
impl BackwardTiles {
    /// The tiles of a `[v, c]` gradient accumulated in values of `acc_bytes` bytes.
    fn new(v: usize, c: usize, acc_bytes: usize) -> Self {
        let capacity = ACCUMULATOR_BYTES / acc_bytes;
        let cols = c.clamp(1, capacity);
        let rows = (capacity / cols).clamp(1, v.max(1));
        BackwardTiles {
            rows,
            cols,
            row_blocks: v.div_ceil(rows).max(1),
            col_blocks: c.div_ceil(cols).max(1),
        }
    }

    /// Its launch: a 1-D grid of `row_blocks · col_blocks` blocks (the row tiles of the first
    /// column tile, then of the second, ...), each a whole number of warps, one thread per column
    /// up to [`MAX_THREADS`], with `rows · cols` accumulators of `acc_bytes` bytes as its dynamic
    /// shared memory.
    #[cfg(feature = "cuda")]
    fn launch(&self, acc_bytes: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((self.row_blocks * self.col_blocks) as u32, 1, 1),
            block_dim: (
                (self.cols.div_ceil(32) * 32).clamp(32, MAX_THREADS) as u32,
                1,
                1,
            ),
            shared_mem_bytes: (self.rows * self.cols * acc_bytes) as u32,
        }
    }
}

/// The ids of a CUDA op, in one of the two types its kernels read.
#[cfg(feature = "cuda")]
enum CudaIds<'a> {
    U32(CudaView<'a, u32>),
    I64(CudaView<'a, i64>),
}

/// The contiguous ids of a CUDA op (the public function converts them to u32 or i64).
#[cfg(feature = "cuda")]
fn cuda_ids<'a>(op: &str, s: &'a CudaStorage, l: &Layout) -> Result<CudaIds<'a>> {
    let Some((start, end)) = l.contiguous_offsets() else {
        candle_core::bail!("{op}: ids are not contiguous");
    };
    match candle_core::backend::BackendStorage::dtype(s) {
        DType::U32 => Ok(CudaIds::U32(s.as_cuda_slice::<u32>()?.slice(start..end))),
        DType::I64 => Ok(CudaIds::I64(s.as_cuda_slice::<i64>()?.slice(start..end))),
        other => candle_core::bail!(
            "{op}: ids must be u32 or i64 on CUDA (the public function converts them), got \
             {other:?}"
        ),
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

    /// The gradient of `Σ embedding(ids, table) · r` by naive loops: for each row of the table,
    /// the f64 sum of `r`'s rows at the positions naming it.
    fn naive_grad(ids: &[usize], r: &[f64], v: usize, c: usize) -> Vec<f64> {
        let mut g = vec![0f64; v * c];
        for (p, &id) in ids.iter().enumerate() {
            for j in 0..c {
                g[id * c + j] += r[p * c + j];
            }
        }
        g
    }

    /// Output and table gradient of `Σ embedding(ids, table) · r` for a table of `dtype`.
    fn run(
        ids: &Tensor,
        table: &[f64],
        r: &[f64],
        v: usize,
        c: usize,
        dtype: DType,
    ) -> (Vec<f64>, Vec<f64>) {
        let dev = Device::Cpu;
        let table = Var::from_tensor(
            &Tensor::from_vec(table.to_vec(), (v, c), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        let out = embedding(ids, table.as_tensor()).unwrap();
        let r = Tensor::from_vec(r.to_vec(), out.dims(), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let grads = (&out * &r).unwrap().sum_all().unwrap().backward().unwrap();
        (f64s(&out), f64s(grads.get(table.as_tensor()).unwrap()))
    }

    #[test]
    fn rows_and_gradients_equal_naive_loops_with_repeated_ids() {
        // Odd sizes; ids repeated (row 3 five times, row 0 twice, the last row), rows never named.
        let (v, c) = (11, 7);
        let ids_v: Vec<usize> = vec![3, 0, 3, 10, 3, 5, 0, 3, 3, 10, 2, 7, 1];
        let dims = [ids_v.len()];
        let table = values(v * c, 1);
        let r = values(ids_v.len() * c, 2);
        let dev = Device::Cpu;
        let as_u32: Vec<u32> = ids_v.iter().map(|&i| i as u32).collect();
        let as_i64: Vec<i64> = ids_v.iter().map(|&i| i as i64).collect();
        let as_u8: Vec<u8> = ids_v.iter().map(|&i| i as u8).collect();
        let id_tensors = [
            Tensor::from_vec(as_u32, &dims, &dev).unwrap(),
            Tensor::from_vec(as_i64, &dims, &dev).unwrap(),
            Tensor::from_vec(as_u8, &dims, &dev).unwrap(),
            // i32 ids, widened to i64.
            Tensor::from_vec(
                ids_v.iter().map(|&i| i as i64).collect::<Vec<_>>(),
                &dims,
                &dev,
            )
            .unwrap()
            .to_dtype(DType::I32)
            .unwrap(),
        ];
        let want_grad = naive_grad(&ids_v, &r, v, c);
        for ids in &id_tensors {
            for (dtype, tol) in [(DType::F64, 1e-15), (DType::F32, 1e-6), (DType::BF16, 1e-2)] {
                let (out, grad) = run(ids, &table, &r, v, c, dtype);
                // The output is the table's rows, exactly (in the dtype's rounding).
                let rounded = f64s(
                    &Tensor::from_vec(table.clone(), (v, c), &dev)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap(),
                );
                for (p, &id) in ids_v.iter().enumerate() {
                    assert_eq!(
                        out[p * c..(p + 1) * c],
                        rounded[id * c..(id + 1) * c],
                        "{dtype:?} {:?}: row {p}",
                        ids.dtype()
                    );
                }
                for (k, (g, w)) in grad.iter().zip(&want_grad).enumerate() {
                    // bf16: r is rounded to bf16 (2⁻⁹) and so is the sum of up to 5 of them.
                    assert!(
                        (g - w).abs() <= tol * 5.0,
                        "{dtype:?} {:?}: gradient [{k}] {g} vs {w}",
                        ids.dtype()
                    );
                }
            }
        }
    }

    #[test]
    fn bf16_gradients_are_summed_in_f32_and_rounded_once() {
        // 300 copies of 1 + 2⁻⁷ (a bf16 value) into one row, then −300: a bf16 running sum
        // would round at every add past 256 (its spacing there is 2); in f32 the total is exact
        // before the one rounding.
        let (v, c) = (2, 1);
        let n = 301;
        let ids = Tensor::from_vec(vec![1u32; n], n, &Device::Cpu).unwrap();
        let mut r = vec![1.0 + 1.0 / 128.0; n - 1];
        r.push(-300.0);
        let (_, grad) = run(&ids, &[0.0, 0.0], &r, v, c, DType::BF16);
        // 300 · (1 + 2⁻⁷) − 300 = 300/128 = 2.34375, a bf16 value.
        assert_eq!(grad, vec![0.0, 2.343_75]);
    }

    #[test]
    fn the_gradient_sums_positions_in_increasing_order_on_any_number_of_threads() {
        // Sums of many rows whose f32 result depends on the order, on a table large enough for
        // the threaded path.
        let (v, c, n) = (97, 256, 5000);
        let ids_v: Vec<usize> = values(n, 3)
            .iter()
            .map(|x| ((x + 1.0) * 0.5 * v as f64) as usize % v)
            .collect();
        let ids = Tensor::from_vec(
            ids_v.iter().map(|&i| i as u32).collect::<Vec<_>>(),
            (50, 100),
            &Device::Cpu,
        )
        .unwrap();
        let table = values(v * c, 4);
        let r: Vec<f64> = values(n * c, 5).iter().map(|x| x * 1e3).collect();
        let pool = |k| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(k)
                .build()
                .unwrap()
        };
        let one = pool(1).install(|| run(&ids, &table, &r, v, c, DType::F32));
        let four = pool(4).install(|| run(&ids, &table, &r, v, c, DType::F32));
        assert_eq!(one, four);
        // The order is the positions' order: an f32 running sum in that order, from 0.
        let r32: Vec<f32> = r.iter().map(|&x| x as f32).collect();
        let mut want = vec![0f32; v * c];
        for (p, &id) in ids_v.iter().enumerate() {
            for j in 0..c {
                want[id * c + j] += r32[p * c + j];
            }
        }
        let want: Vec<f64> = want.into_iter().map(f64::from).collect();
        assert_eq!(one.1, want);
    }

    #[test]
    fn ids_out_of_range_and_wrong_dtypes_are_refused_naming_them() {
        let dev = Device::Cpu;
        let table = Tensor::zeros((5, 3), DType::F32, &dev).unwrap();
        let err = |r: Result<Tensor>| r.map(|t| t.dims().to_vec()).unwrap_err().to_string();
        let e = err(embedding(
            &Tensor::new(&[[0u32, 4], [5, 1]], &dev).unwrap(),
            &table,
        ));
        assert!(
            e.contains("ids[2] = 5") && e.contains("[5, 3]") && e.contains("0..5"),
            "{e}"
        );
        let e = err(embedding(&Tensor::new(&[1i64, -1], &dev).unwrap(), &table));
        assert!(e.contains("ids[1] = -1"), "{e}");
        let e = err(embedding(
            &Tensor::new(&[-3i64], &dev)
                .unwrap()
                .to_dtype(DType::I32)
                .unwrap(),
            &table,
        ));
        assert!(e.contains("ids[0] = -3"), "{e}");
        let e = err(embedding(&Tensor::new(&[1f32], &dev).unwrap(), &table));
        assert!(
            e.contains("embedding") && e.contains("F32") && e.contains("u32"),
            "{e}"
        );
        let e = err(embedding(
            &Tensor::new(&[1u32], &dev).unwrap(),
            &Tensor::zeros(5, DType::F32, &dev).unwrap(),
        ));
        assert!(e.contains("table") && e.contains("[5]"), "{e}");
    }

    #[test]
    fn a_frozen_table_gets_no_gradient_and_empty_ids_give_an_empty_output() {
        let dev = Device::Cpu;
        let table = Tensor::from_vec(values(12, 6), (4, 3), &dev).unwrap();
        let x = Var::from_tensor(&Tensor::ones((2, 3), DType::F64, &dev).unwrap()).unwrap();
        let ids = Tensor::new(&[2u32, 1], &dev).unwrap();
        let out = (embedding(&ids, &table).unwrap() * x.as_tensor()).unwrap();
        let grads = out.sum_all().unwrap().backward().unwrap();
        assert!(grads.get(&table).is_none());
        assert!(grads.get(x.as_tensor()).is_some());
        let empty = Tensor::zeros((0, 5), DType::U32, &dev).unwrap();
        assert_eq!(embedding(&empty, &table).unwrap().dims(), [0, 5, 3]);
    }

    #[test]
    fn the_cuda_tiles_cover_the_table_within_the_shared_memory() {
        // GPT-2's table, a vocabulary smaller than one tile, a row wider than the accumulators.
        for (v, c, acc) in [
            (50_257, 768, 4),
            (59, 768, 4),
            (3, 20_000, 4),
            (50_257, 768, 8),
        ] {
            let t = BackwardTiles::new(v, c, acc);
            assert!(t.rows * t.cols * acc <= ACCUMULATOR_BYTES, "{t:?}");
            assert!(
                t.rows * t.row_blocks >= v && t.cols * t.col_blocks >= c,
                "{t:?}"
            );
            assert!((t.row_blocks - 1) * t.rows < v && (t.col_blocks - 1) * t.cols < c);
            assert!(t.rows <= 1 << 16 && MAX_THREADS <= 1024);
            assert!(t.row_blocks * t.col_blocks <= i32::MAX as usize, "{t:?}");
        }
        assert_eq!(BackwardTiles::new(50_257, 768, 4).rows, 13);
    }
}
