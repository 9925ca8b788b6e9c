//! The conformance suite of the `Communicator` contract, written once and run against every
//! backend: the local one, the CPU one over TCP and over shared memory (in-process, in
//! `tests/integration/conformance.rs`), and NCCL (in worker processes, `accelerate-test-worker conformance`).
//!
//! Every rank calls [`check_communicator`] with its communicator and the backend's device. The
//! same checks run on tensors on the host and on that device (once when it is the host): every
//! dtype of the contract, a whole tensor and a view with an offset into a larger buffer, every
//! operation (all-reduce Sum/Mean/Max, broadcast from the last rank, all-gather, reduce-scatter
//! and all-gather into preallocated outputs, with and without the agreement, barrier), layouts
//! the contract refuses or accepts, and ranks passing tensors of different sizes, dtypes or
//! shapes. Expected values come from formulas of the rank and the index, computed here directly.

use accelerate_core::comm::Communicator;
use accelerate_core::ReduceOp;
use candle_core::{DType, Device, Tensor};

/// Every dtype the contract names.
pub const CONTRACT_DTYPES: [DType; 7] = [
    DType::F32,
    DType::F64,
    DType::BF16,
    DType::F16,
    DType::I64,
    DType::U32,
    DType::U8,
];

/// Elements of the tensors reduced: divisible neither by 2 nor by 3, so ring segments differ.
const LEN: usize = 11;
/// Elements before the view inside its buffer.
const BEFORE: usize = 3;
/// Elements after the view inside its buffer.
const AFTER: usize = 2;
/// Value of the buffer's elements outside the view; a collective must leave them alone.
const SENTINEL: f64 = 99.0;

/// Input of `rank` at index `i` for `dtype`: small values, exact in every dtype and whose sums
/// over three ranks are exact too; negative ones for the signed types (so that integer `Mean`
/// shows its truncation toward zero), and a per-rank offset so that ranks differ everywhere.
pub fn value(rank: usize, i: usize, dtype: DType) -> f64 {
    let base = ((rank * 5 + i * 3) % 13) as f64;
    match dtype {
        DType::U8 => base + 20.0 * rank as f64,
        DType::U32 => base + 100.0 * rank as f64,
        DType::I64 => base - 6.0 + 1000.0 * rank as f64,
        _ => base - 6.0 + 0.5 * rank as f64,
    }
}

/// The reduction over `world` ranks of [`value`] at index `i`.
fn reduced(world: usize, i: usize, dtype: DType, op: ReduceOp) -> f64 {
    let column = (0..world).map(|r| value(r, i, dtype));
    match op {
        ReduceOp::Sum => column.sum(),
        ReduceOp::Max => column.fold(f64::NEG_INFINITY, f64::max),
        // Integers: the sum divided by the world size, truncated toward zero.
        ReduceOp::Mean if !dtype.is_float() => (column.sum::<f64>() / world as f64).trunc(),
        ReduceOp::Mean => column.sum::<f64>() / world as f64,
    }
}

/// How far a float `Mean` may be from the exact quotient: the one rounding of the division, or
/// (NCCL's average scales each input by 1/world before summing) one per rank and addition.
fn mean_tolerance(world: usize, i: usize, dtype: DType) -> f64 {
    let eps = match dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        DType::F32 => 2f64.powi(-24),
        _ => 2f64.powi(-53),
    };
    let magnitude: f64 = (0..world).map(|r| value(r, i, dtype).abs()).sum();
    4.0 * eps * (magnitude + 1.0)
}

/// A failed check, with where it happened.
fn fail(rank: usize, what: String) -> String {
    format!("rank {rank}: {what}")
}

/// The values of a tensor as f64 (exact for every value used here).
fn values(t: &Tensor) -> Result<Vec<f64>, String> {
    t.to_device(&Device::Cpu)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1::<f64>())
        .map_err(|e| e.to_string())
}

/// A tensor of `dtype` on `device` holding `data` (exact values).
fn tensor(data: &[f64], dtype: DType, device: &Device) -> Result<Tensor, String> {
    Tensor::new(data, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .and_then(|t| t.to_device(device))
        .map_err(|e| e.to_string())
}

/// A buffer on `device` and the view of it that the collective gets: the view holds this rank's
/// [`value`]s, the rest of the buffer [`SENTINEL`]s. `offset` false: the view is the buffer.
fn buffer_and_view(
    rank: usize,
    dtype: DType,
    device: &Device,
    offset: bool,
) -> Result<(Tensor, Tensor), String> {
    let mine: Vec<f64> = (0..LEN).map(|i| value(rank, i, dtype)).collect();
    if !offset {
        let t = tensor(&mine, dtype, device)?;
        return Ok((t.clone(), t));
    }
    let mut all = vec![SENTINEL; BEFORE];
    all.extend(&mine);
    all.extend(vec![SENTINEL; AFTER]);
    let buffer = tensor(&all, dtype, device)?;
    let view = buffer.narrow(0, BEFORE, LEN).map_err(|e| e.to_string())?;
    Ok((buffer, view))
}

/// Checks that the buffer holds `want` in the view and sentinels around it.
fn check_buffer(
    rank: usize,
    what: &str,
    buffer: &Tensor,
    offset: bool,
    want: &[f64],
    tolerance: impl Fn(usize) -> f64,
) -> Result<(), String> {
    let got = values(buffer)?;
    let len = want.len();
    let (view, around): (Vec<f64>, Vec<f64>) = if offset {
        let view = got[BEFORE..(BEFORE + len).min(got.len())].to_vec();
        let mut around = got[..BEFORE].to_vec();
        around.extend(&got[(BEFORE + len).min(got.len())..]);
        (view, around)
    } else {
        (got.clone(), Vec::new())
    };
    if around.iter().any(|&v| v != SENTINEL) {
        return Err(fail(
            rank,
            format!("{what}: the elements around the view changed: {got:?}"),
        ));
    }
    let off = view
        .iter()
        .zip(want)
        .enumerate()
        .any(|(i, (g, w))| (g - w).abs() > tolerance(i));
    if view.len() != want.len() || off {
        return Err(fail(rank, format!("{what}: got {view:?}, want {want:?}")));
    }
    Ok(())
}

/// Runs the whole suite on `comm`, whose backend computes on `device` (the host for the CPU
/// backends). Every rank of the job must call it at the same time.
pub fn check_communicator(comm: &dyn Communicator, device: &Device) -> Result<(), String> {
    let mut placements = vec![Device::Cpu];
    if !device.is_cpu() {
        placements.push(device.clone());
    }
    for placement in &placements {
        for dtype in CONTRACT_DTYPES {
            for offset in [false, true] {
                check_dtype_and_layout(comm, placement, dtype, offset)?;
            }
        }
        check_layouts(comm, placement)?;
        check_output_refusals(comm, placement)?;
        check_disagreements(comm, placement)?;
        check_output_disagreements(comm, placement)?;
    }
    // Empty tensors on the host only: CUDA refuses empty allocations, so none exists on a GPU.
    check_empty(comm)?;
    comm.barrier()
        .map_err(|e| fail(comm.rank(), format!("final barrier: {e}")))?;
    Ok(())
}

/// Every operation on one dtype, on a whole tensor or a view with an offset, on `placement`.
fn check_dtype_and_layout(
    comm: &dyn Communicator,
    placement: &Device,
    dtype: DType,
    offset: bool,
) -> Result<(), String> {
    let (r, w) = (comm.rank(), comm.world_size());
    let case = format!(
        "{dtype:?} on {:?}{}",
        placement.location(),
        if offset {
            ", a view with an offset"
        } else {
            ""
        }
    );
    let e = |what: &str| {
        let case = case.clone();
        let what = what.to_string();
        move |err: accelerate_core::Error| fail(r, format!("{what} of {case}: {err}"))
    };

    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Mean] {
        let (buffer, view) = buffer_and_view(r, dtype, placement, offset)?;
        comm.all_reduce(&view, op).map_err(e(&format!("{op:?}")))?;
        let want: Vec<f64> = (0..LEN).map(|i| reduced(w, i, dtype, op)).collect();
        let exact = op != ReduceOp::Mean || !dtype.is_float();
        check_buffer(
            r,
            &format!("all_reduce {op:?} of {case}"),
            &buffer,
            offset,
            &want,
            |i| {
                if exact {
                    0.0
                } else {
                    mean_tolerance(w, i, dtype)
                }
            },
        )?;
        if !view.device().same_device(placement) {
            return Err(fail(r, format!("all_reduce of {case} moved the tensor")));
        }
    }

    // Broadcast from the last rank: a non-zero root whenever there are several.
    let root = w - 1;
    let (buffer, view) = buffer_and_view(r, dtype, placement, offset)?;
    comm.broadcast(&view, root).map_err(e("broadcast"))?;
    let want: Vec<f64> = (0..LEN).map(|i| value(root, i, dtype)).collect();
    check_buffer(
        r,
        &format!("broadcast from rank {root} of {case}"),
        &buffer,
        offset,
        &want,
        |_| 0.0,
    )?;

    // All-gather: the blocks of every rank in rank order, on the input's device.
    let (_, view) = buffer_and_view(r, dtype, placement, offset)?;
    let gathered = comm.all_gather(&view).map_err(e("all_gather"))?;
    let want: Vec<f64> = (0..w)
        .flat_map(|k| (0..LEN).map(move |i| value(k, i, dtype)))
        .collect();
    if gathered.dims() != [w * LEN] || gathered.dtype() != dtype {
        return Err(fail(
            r,
            format!(
                "all_gather of {case}: shape {:?} and dtype {:?}, want [{}] and {dtype:?}",
                gathered.dims(),
                gathered.dtype(),
                w * LEN
            ),
        ));
    }
    if !gathered.device().same_device(placement) {
        return Err(fail(
            r,
            format!(
                "all_gather of {case}: the result is on {:?}, not on the input's device",
                gathered.device().location()
            ),
        ));
    }
    let got = values(&gathered)?;
    if got != want {
        return Err(fail(
            r,
            format!("all_gather of {case}: got {got:?}, want {want:?}"),
        ));
    }
    // The input is untouched by the gather.
    if values(&view)? != (0..LEN).map(|i| value(r, i, dtype)).collect::<Vec<_>>() {
        return Err(fail(r, format!("all_gather of {case} changed its input")));
    }

    for agreed in [false, true] {
        check_reduce_scatter(comm, placement, dtype, offset, agreed, &case)?;
        check_all_gather_into(comm, placement, dtype, offset, agreed, &case)?;
    }
    Ok(())
}

/// A buffer on `device` of `len` elements (plus the sentinels around when `offset`), all
/// [`SENTINEL`]s, and the view of it that a collective writes.
fn sentinel_output(
    len: usize,
    dtype: DType,
    device: &Device,
    offset: bool,
) -> Result<(Tensor, Tensor), String> {
    let total = if offset { BEFORE + len + AFTER } else { len };
    let buffer = tensor(&vec![SENTINEL; total], dtype, device)?;
    let view = if offset {
        buffer.narrow(0, BEFORE, len).map_err(|e| e.to_string())?
    } else {
        buffer.clone()
    };
    Ok((buffer, view))
}

/// Reduce-scatter (every op) of `world_size` blocks of [`LEN`] elements of this rank's
/// [`value`]s into a sentinel-filled output (a view with an offset when `offset`, which the
/// input is too): block `r` of the reduction lands in rank `r`'s output, nothing around it
/// changes, the input is left as it was.
fn check_reduce_scatter(
    comm: &dyn Communicator,
    placement: &Device,
    dtype: DType,
    offset: bool,
    agreed: bool,
    case: &str,
) -> Result<(), String> {
    let (r, w) = (comm.rank(), comm.world_size());
    let name = if agreed {
        "reduce_scatter_agreed"
    } else {
        "reduce_scatter"
    };
    let mine: Vec<f64> = (0..w * LEN).map(|i| value(r, i, dtype)).collect();
    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Mean] {
        let input = if offset {
            let mut all = vec![SENTINEL; BEFORE];
            all.extend(&mine);
            tensor(&all, dtype, placement)?
                .narrow(0, BEFORE, w * LEN)
                .map_err(|e| e.to_string())?
        } else {
            tensor(&mine, dtype, placement)?
        };
        let (buffer, output) = sentinel_output(LEN, dtype, placement, offset)?;
        let result = if agreed {
            comm.reduce_scatter_agreed(&input, &output, op)
        } else {
            comm.reduce_scatter(&input, &output, op)
        };
        result.map_err(|e| fail(r, format!("{name} {op:?} of {case}: {e}")))?;
        let want: Vec<f64> = (0..LEN)
            .map(|j| reduced(w, r * LEN + j, dtype, op))
            .collect();
        let exact = op != ReduceOp::Mean || !dtype.is_float();
        check_buffer(
            r,
            &format!("{name} {op:?} of {case}"),
            &buffer,
            offset,
            &want,
            |j| {
                if exact {
                    0.0
                } else {
                    mean_tolerance(w, r * LEN + j, dtype)
                }
            },
        )?;
        if values(&input)? != mine {
            return Err(fail(
                r,
                format!("{name} {op:?} of {case} changed its input"),
            ));
        }
    }
    Ok(())
}

/// All-gather of this rank's [`LEN`] [`value`]s into a sentinel-filled output of
/// `world_size` blocks (views with an offset when `offset`): every rank's block in rank order,
/// nothing around it changed, the input left as it was.
fn check_all_gather_into(
    comm: &dyn Communicator,
    placement: &Device,
    dtype: DType,
    offset: bool,
    agreed: bool,
    case: &str,
) -> Result<(), String> {
    let (r, w) = (comm.rank(), comm.world_size());
    let name = if agreed {
        "all_gather_into_agreed"
    } else {
        "all_gather_into"
    };
    let (_, input) = buffer_and_view(r, dtype, placement, offset)?;
    let (buffer, output) = sentinel_output(w * LEN, dtype, placement, offset)?;
    let result = if agreed {
        comm.all_gather_into_agreed(&input, &output)
    } else {
        comm.all_gather_into(&input, &output)
    };
    result.map_err(|e| fail(r, format!("{name} of {case}: {e}")))?;
    let want: Vec<f64> = (0..w)
        .flat_map(|k| (0..LEN).map(move |i| value(k, i, dtype)))
        .collect();
    check_buffer(
        r,
        &format!("{name} of {case}"),
        &buffer,
        offset,
        &want,
        |_| 0.0,
    )?;
    if values(&input)? != (0..LEN).map(|i| value(r, i, dtype)).collect::<Vec<_>>() {
        return Err(fail(r, format!("{name} of {case} changed its input")));
    }
    Ok(())
}

/// Layouts the contract accepts (a non-contiguous input of all_gather, a 0-dimensional tensor)
/// and refuses (a non-contiguous tensor in place, a dtype that does not travel), on `placement`.
fn check_layouts(comm: &dyn Communicator, placement: &Device) -> Result<(), String> {
    let (r, w) = (comm.rank(), comm.world_size());
    let s = |e: candle_core::Error| fail(r, e.to_string());
    let on = format!("on {:?}", placement.location());

    // A transposed (non-contiguous) 3x2 -> 2x3 tensor gathers as its values.
    let rows: Vec<f64> = (0..6).map(|i| value(r, i, DType::F32)).collect();
    let t = tensor(&rows, DType::F32, placement)?
        .reshape((3, 2))
        .and_then(|t| t.t())
        .map_err(s)?;
    if t.is_contiguous() {
        return Err(fail(r, "internal: the transpose is contiguous".into()));
    }
    let gathered = comm
        .all_gather(&t)
        .map_err(|e| fail(r, format!("all_gather of a transposed tensor {on}: {e}")))?;
    let want: Vec<f64> = (0..w)
        .flat_map(|k| {
            // Row j, column c of the transpose is element (c, j) of the 3x2 original.
            (0..2).flat_map(move |j| (0..3).map(move |c| value(k, c * 2 + j, DType::F32)))
        })
        .collect();
    let got = values(&gathered)?;
    if gathered.dims() != [2 * w, 3] || got != want {
        return Err(fail(
            r,
            format!(
                "all_gather of a transposed tensor {on}: shape {:?}, {got:?}; want [{}, 3], \
                 {want:?}",
                gathered.dims(),
                2 * w
            ),
        ));
    }

    // A 0-dimensional tensor: reduced in place, gathered into a vector.
    let scalar = Tensor::new((r + 1) as f64, placement).map_err(s)?;
    comm.all_reduce(&scalar, ReduceOp::Sum)
        .map_err(|e| fail(r, format!("all_reduce of a scalar {on}: {e}")))?;
    let sum = values(&scalar)?;
    if sum != [(w * (w + 1) / 2) as f64] {
        return Err(fail(r, format!("all_reduce of a scalar {on}: {sum:?}")));
    }
    let scalar = Tensor::new((r + 1) as f64, placement).map_err(s)?;
    let gathered = comm
        .all_gather(&scalar)
        .map_err(|e| fail(r, format!("all_gather of a scalar {on}: {e}")))?;
    let want: Vec<f64> = (1..=w).map(|k| k as f64).collect();
    if gathered.dims() != [w] || values(&gathered)? != want {
        return Err(fail(
            r,
            format!(
                "all_gather of a scalar {on}: shape {:?}, {:?}",
                gathered.dims(),
                values(&gathered)?
            ),
        ));
    }

    // Refused before any traffic: every rank refuses alike, and the ranks stay in step.
    let err = comm
        .all_reduce(&t, ReduceOp::Sum)
        .err()
        .ok_or_else(|| fail(r, format!("a non-contiguous all_reduce {on} was accepted")))?;
    if !err.to_string().contains("contiguous") {
        return Err(fail(r, format!("non-contiguous all_reduce {on}: {err}")));
    }
    let ints = Tensor::zeros(4, DType::I32, placement).map_err(s)?;
    let err = comm
        .all_reduce(&ints, ReduceOp::Sum)
        .err()
        .ok_or_else(|| fail(r, format!("an i32 all_reduce {on} was accepted")))?;
    if !err.to_string().contains("I32") {
        return Err(fail(r, format!("i32 all_reduce {on}: {err}")));
    }
    comm.barrier()
        .map_err(|e| fail(r, format!("barrier {on}: {e}")))?;
    check_still_in_step(comm, placement, "the refused layouts")
}

/// Every operation on an empty tensor succeeds, moves nothing, keeps the shape (the gather's
/// rows multiplied by the world size), and leaves the ranks in step.
fn check_empty(comm: &dyn Communicator) -> Result<(), String> {
    let (r, w) = (comm.rank(), comm.world_size());
    let e = |what: &'static str| {
        move |err: accelerate_core::Error| fail(r, format!("{what} of an empty tensor: {err}"))
    };
    let empty = Tensor::zeros((0, 3), DType::F32, &Device::Cpu).map_err(|e| e.to_string())?;
    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Mean] {
        comm.all_reduce(&empty, op).map_err(e("all_reduce"))?;
    }
    comm.broadcast(&empty, w - 1).map_err(e("broadcast"))?;
    let gathered = comm.all_gather(&empty).map_err(e("all_gather"))?;
    if gathered.dims() != [0, 3] {
        return Err(fail(
            r,
            format!(
                "all_gather of a (0, 3) tensor: shape {:?}, want [0, 3]",
                gathered.dims()
            ),
        ));
    }
    let output = Tensor::zeros(0, DType::F32, &Device::Cpu).map_err(|e| e.to_string())?;
    comm.reduce_scatter(&empty, &output, ReduceOp::Sum)
        .map_err(e("reduce_scatter"))?;
    comm.all_gather_into(&output, &empty)
        .map_err(e("all_gather_into"))?;
    if empty.elem_count() != 0 || output.elem_count() != 0 {
        return Err(fail(r, "an empty tensor grew".into()));
    }
    check_still_in_step(comm, &Device::Cpu, "collectives on empty tensors")
}

/// One all-reduce whose result proves the ranks are still in step after `after`.
fn check_still_in_step(
    comm: &dyn Communicator,
    placement: &Device,
    after: &str,
) -> Result<(), String> {
    let (r, w) = (comm.rank(), comm.world_size());
    let t = tensor(&[r as f64, 1.0], DType::I64, placement)?;
    comm.all_reduce(&t, ReduceOp::Sum)
        .map_err(|e| fail(r, format!("all_reduce after {after}: {e}")))?;
    let got = values(&t)?;
    let want = [(w * (w - 1) / 2) as f64, w as f64];
    if got != want {
        return Err(fail(
            r,
            format!("all_reduce after {after}: got {got:?}, want {want:?}"),
        ));
    }
    Ok(())
}

/// The last rank passes a tensor of another size, dtype or shape: every rank refuses, with an
/// error naming the ranks and what each passed, and stays usable.
fn check_disagreements(comm: &dyn Communicator, placement: &Device) -> Result<(), String> {
    let (r, w) = (comm.rank(), comm.world_size());
    if w == 1 {
        return Ok(());
    }
    let odd = r == w - 1;
    let on = format!("on {:?}", placement.location());
    let expect_refusal = |what: &str,
                          result: accelerate_core::Result<()>,
                          needles: &[String]|
     -> Result<(), String> {
        let err = match result {
            Ok(()) => {
                return Err(fail(
                    r,
                    format!("{what} {on} was accepted although rank {} differs", w - 1),
                ))
            }
            Err(e) => e.to_string(),
        };
        if let Some(missing) = needles.iter().find(|n| !err.contains(n.as_str())) {
            return Err(fail(
                r,
                format!("{what} {on}: the error does not say {missing:?}: {err}"),
            ));
        }
        check_still_in_step(comm, placement, what)
    };

    // Another element count.
    let len = if odd { LEN + 1 } else { LEN };
    let t = tensor(&vec![1.0; len], DType::F32, placement)?;
    let others = if w == 2 {
        "rank 0".to_string()
    } else {
        format!(
            "ranks {}",
            (0..w - 1)
                .map(|k| k.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    expect_refusal(
        "all_reduce with different sizes",
        comm.all_reduce(&t, ReduceOp::Sum),
        &[
            format!("{others}: all_reduce (Sum) of {LEN} f32 elements"),
            format!(
                "rank {}: all_reduce (Sum) of {} f32 elements",
                w - 1,
                LEN + 1
            ),
        ],
    )?;

    // Another dtype, same count.
    let dtype = if odd { DType::F64 } else { DType::F32 };
    let t = tensor(&[1.0; LEN], dtype, placement)?;
    expect_refusal(
        "broadcast with different dtypes",
        comm.broadcast(&t, 0),
        &[
            format!("{others}: broadcast from rank 0 of {LEN} f32 elements"),
            format!(
                "rank {}: broadcast from rank 0 of {LEN} f64 elements",
                w - 1
            ),
        ],
    )?;

    // Another number of rows to gather.
    let rows = if odd { 3 } else { 2 };
    let t = tensor(&vec![1.0; rows * 4], DType::F32, placement)?
        .reshape((rows, 4))
        .map_err(|e| fail(r, e.to_string()))?;
    expect_refusal(
        "all_gather with different shapes",
        comm.all_gather(&t).map(|_| ()),
        &["in 3 rows".into(), "pad_across_processes".into()],
    )
}

/// Outputs the contract refuses for `reduce_scatter` and `all_gather_into`, passed alike by
/// every rank: each refuses with an error naming the problem (and both counts and the world size
/// for a size), and the ranks stay in step.
fn check_output_refusals(comm: &dyn Communicator, placement: &Device) -> Result<(), String> {
    let (r, w) = (comm.rank(), comm.world_size());
    let s = |e: candle_core::Error| fail(r, e.to_string());
    let on = format!("on {:?}", placement.location());
    let zeros = |n: usize, dtype: DType| Tensor::zeros(n, dtype, placement).map_err(s);
    let expect = |what: &str, result: accelerate_core::Result<()>, needles: &[String]| {
        let err = match result {
            Ok(()) => return Err(fail(r, format!("{what} {on} was accepted"))),
            Err(e) => e.to_string(),
        };
        if let Some(missing) = needles.iter().find(|n| !err.contains(n.as_str())) {
            return Err(fail(
                r,
                format!("{what} {on}: the error does not say {missing:?}: {err}"),
            ));
        }
        check_still_in_step(comm, placement, what)
    };
    let sum = ReduceOp::Sum;

    let input = zeros(w * LEN, DType::F32)?;
    expect(
        "reduce_scatter into an output of the wrong size",
        comm.reduce_scatter(&input, &zeros(LEN + 1, DType::F32)?, sum),
        &[
            "reduce_scatter".into(),
            format!("input of {} elements, output of {}", w * LEN, LEN + 1),
            format!("on {w} ranks"),
        ],
    )?;
    expect(
        "reduce_scatter of an input that is not world_size blocks",
        comm.reduce_scatter(
            &zeros(w * LEN + 1, DType::F32)?,
            &zeros(LEN, DType::F32)?,
            sum,
        ),
        &[
            format!("input of {} elements, output of {LEN}", w * LEN + 1),
            "pad the input".into(),
        ],
    )?;
    expect(
        "reduce_scatter into a view of its own input",
        comm.reduce_scatter(&input, &input.narrow(0, 0, LEN).map_err(s)?, sum),
        &["shares its storage with the input".into()],
    )?;
    // Every other element of a buffer twice as long: LEN elements, not contiguous.
    let strided = zeros(2 * LEN, DType::F32)?
        .reshape((LEN, 2))
        .and_then(|t| t.narrow(1, 0, 1))
        .map_err(s)?;
    expect(
        "reduce_scatter into a non-contiguous output",
        comm.reduce_scatter(&input, &strided, sum),
        &["not contiguous".into()],
    )?;
    expect(
        "reduce_scatter into an output of another dtype",
        comm.reduce_scatter(&input, &zeros(LEN, DType::F64)?, sum),
        &["the output is F64 but the input is F32".into()],
    )?;
    expect(
        "reduce_scatter of a dtype that does not travel",
        comm.reduce_scatter(&zeros(w * LEN, DType::I32)?, &zeros(LEN, DType::I32)?, sum),
        &["I32".into()],
    )?;
    expect(
        "all_gather_into an output of the wrong size",
        comm.all_gather_into(&zeros(LEN, DType::F32)?, &zeros(w * LEN - 1, DType::F32)?),
        &[
            "all_gather_into".into(),
            format!("input of {LEN} elements, output of {}", w * LEN - 1),
            format!("on {w} ranks"),
        ],
    )?;
    let buffer = zeros((w + 1) * LEN, DType::F32)?;
    expect(
        "all_gather_into an output sharing the input's storage",
        comm.all_gather_into(
            &buffer.narrow(0, 0, LEN).map_err(s)?,
            &buffer.narrow(0, LEN, w * LEN).map_err(s)?,
        ),
        &["shares its storage with the input".into()],
    )
}

/// The last rank passes other tensors to `reduce_scatter` and `all_gather_into` (another block
/// size, a size that does not fit, a non-contiguous output): every rank refuses, naming what each
/// passed, instead of waiting for the others; the ranks stay in step.
fn check_output_disagreements(comm: &dyn Communicator, placement: &Device) -> Result<(), String> {
    let (r, w) = (comm.rank(), comm.world_size());
    if w == 1 {
        return Ok(());
    }
    let odd = r == w - 1;
    let s = |e: candle_core::Error| fail(r, e.to_string());
    let on = format!("on {:?}", placement.location());
    let zeros = |n: usize| Tensor::zeros(n, DType::F32, placement).map_err(s);
    let expect = |what: &str, result: accelerate_core::Result<()>, needles: &[String]| {
        let err = match result {
            Ok(()) => {
                return Err(fail(
                    r,
                    format!("{what} {on} was accepted although rank {} differs", w - 1),
                ))
            }
            Err(e) => e.to_string(),
        };
        if let Some(missing) = needles.iter().find(|n| !err.contains(n.as_str())) {
            return Err(fail(
                r,
                format!("{what} {on}: the error does not say {missing:?}: {err}"),
            ));
        }
        check_still_in_step(comm, placement, what)
    };
    let last = format!("rank {}:", w - 1);

    // Another block size, valid on each rank by itself.
    let block = if odd { LEN + 1 } else { LEN };
    expect(
        "reduce_scatter with different block sizes",
        comm.reduce_scatter(&zeros(w * block)?, &zeros(block)?, ReduceOp::Mean),
        &[
            format!(
                "reduce_scatter (Mean) of {} f32 elements into {LEN} f32 elements",
                w * LEN
            ),
            format!(
                "{last} reduce_scatter (Mean) of {} f32 elements into {} f32 elements",
                w * (LEN + 1),
                LEN + 1
            ),
        ],
    )?;
    // A size that does not fit on the last rank only: refused by all, not by it alone.
    let output = if odd { zeros(LEN + 1)? } else { zeros(LEN)? };
    expect(
        "reduce_scatter with a wrong output size on one rank",
        comm.reduce_scatter(&zeros(w * LEN)?, &output, ReduceOp::Sum),
        &[format!(
            "{last} reduce_scatter (Sum) of {} f32 elements into {} f32 elements",
            w * LEN,
            LEN + 1
        )],
    )?;
    // A non-contiguous output on the last rank only.
    let output = if odd {
        zeros(2 * LEN)?
            .reshape((LEN, 2))
            .and_then(|t| t.narrow(1, 0, 1))
            .map_err(s)?
    } else {
        zeros(LEN)?
    };
    expect(
        "reduce_scatter with a non-contiguous output on one rank",
        comm.reduce_scatter(&zeros(w * LEN)?, &output, ReduceOp::Sum),
        &[format!("{last} reduce_scatter (Sum) of {} f32 elements into {LEN} f32 elements, not contiguous", w * LEN)],
    )?;
    // All-gather of other block sizes.
    expect(
        "all_gather_into with different block sizes",
        comm.all_gather_into(&zeros(block)?, &zeros(w * block)?),
        &[format!(
            "{last} all_gather_into of {} f32 elements into {} f32 elements",
            LEN + 1,
            w * (LEN + 1)
        )],
    )
}
