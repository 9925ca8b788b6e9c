//! The checks of the device contract that every backend makes before any traffic (see
//! [`Communicator`](super::Communicator)): the dtypes that travel, and the layout an in-place
//! collective needs.

use candle_core::{DType, Tensor};

use super::ReduceOp;
use crate::error::{Error, Result};

/// The dtypes every backend carries.
pub const SUPPORTED_DTYPES: [DType; 7] = [
    DType::F32,
    DType::F64,
    DType::BF16,
    DType::F16,
    DType::I64,
    DType::U32,
    DType::U8,
];

/// Refuses a dtype that no backend carries, naming the ones that travel.
pub(crate) fn check_dtype(op: &'static str, dtype: DType) -> Result<()> {
    if SUPPORTED_DTYPES.contains(&dtype) {
        return Ok(());
    }
    Err(unsupported_dtype(op, dtype))
}

/// The error for a dtype no backend carries.
pub(crate) fn unsupported_dtype(op: &'static str, dtype: DType) -> Error {
    Error::Config(format!(
        "{op}: dtype {dtype:?} is not carried by the communicators (f32, f64, bf16, f16, i64, u32 \
         and u8 are); convert with to_dtype before the collective (Accelerator::reduce and \
         gather do it for you)"
    ))
}

/// Refuses a tensor that an in-place collective cannot update: a non-contiguous one (a view with
/// an offset is fine), or one of a dtype that does not travel.
pub(crate) fn check_in_place(op: &'static str, tensor: &Tensor) -> Result<()> {
    check_dtype(op, tensor.dtype())?;
    if !tensor.is_contiguous() {
        return Err(Error::Config(format!(
            "{op}: the tensor of shape {:?} is not contiguous, so it cannot be updated in place; \
             pass a contiguous tensor (e.g. a gradient bucket) or call .contiguous() and use the \
             copy",
            tensor.dims()
        )));
    }
    Ok(())
}

/// The shape of an all-gather's result: dimension 0 times `world_size` (a 0-dimensional input
/// gathers into a vector).
pub(crate) fn gathered_dims(dims: &[usize], world_size: usize) -> Vec<usize> {
    let mut out = dims.to_vec();
    match out.first_mut() {
        Some(first) => *first *= world_size,
        None => out.push(world_size),
    }
    out
}

/// The two collectives that write into a preallocated output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IntoOutput {
    /// `reduce_scatter` with its reduction: the input holds `world_size` blocks of the output's
    /// size.
    ReduceScatter(ReduceOp),
    /// `all_gather_into`: the output holds `world_size` blocks of the input's size.
    AllGatherInto,
}

impl IntoOutput {
    /// The collective's name, as users call it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            IntoOutput::ReduceScatter(_) => "reduce_scatter",
            IntoOutput::AllGatherInto => "all_gather_into",
        }
    }
}

/// Whether two tensors share their storage (a view of the other, or both views of one buffer).
pub(crate) fn share_storage(a: &Tensor, b: &Tensor) -> bool {
    // The storage lives inside an `Arc` that both tensors keep alive, so its address identifies
    // it; the guards are taken one after the other, never both at once.
    let address = |t: &Tensor| {
        let (storage, _) = t.storage_and_layout();
        &*storage as *const candle_core::Storage as usize
    };
    address(a) == address(b)
}

/// Refuses an input/output pair that `kind` cannot run on `world_size` ranks: a dtype that does
/// not travel, an output of another dtype, a non-contiguous output, element counts that do not
/// match, or an output sharing the input's storage.
pub(crate) fn check_into_output(
    kind: IntoOutput,
    input: &Tensor,
    output: &Tensor,
    world_size: usize,
) -> Result<()> {
    let op = kind.name();
    check_dtype(op, input.dtype())?;
    if output.dtype() != input.dtype() {
        return Err(Error::Config(format!(
            "{op}: the output is {:?} but the input is {:?}; allocate the output with the \
             input's dtype",
            output.dtype(),
            input.dtype()
        )));
    }
    if !output.is_contiguous() {
        return Err(Error::Config(format!(
            "{op}: the output of shape {:?} is not contiguous, so it cannot be written in place; \
             pass a contiguous tensor (a view with an offset, e.g. `narrow` of a flat buffer, is \
             fine)",
            output.dims()
        )));
    }
    let (n_in, n_out) = (input.elem_count(), output.elem_count());
    let fits = match kind {
        IntoOutput::ReduceScatter(_) => n_in == n_out * world_size,
        IntoOutput::AllGatherInto => n_out == n_in * world_size,
    };
    if !fits {
        let rule = match kind {
            IntoOutput::ReduceScatter(_) => format!(
                "the input must hold world_size blocks of the output's size: {} = {world_size} \
                 x {n_out} elements (pad the input to a multiple of {world_size})",
                n_out * world_size
            ),
            IntoOutput::AllGatherInto => format!(
                "the output must hold world_size blocks of the input's size: {} = {world_size} \
                 x {n_in} elements",
                n_in * world_size
            ),
        };
        return Err(Error::Config(format!(
            "{op}: input of {n_in} elements, output of {n_out}, on {world_size} ranks; {rule}"
        )));
    }
    if share_storage(input, output) {
        return Err(Error::Config(format!(
            "{op}: the output shares its storage with the input; pass an output allocated \
             separately (the collective reads the input while it writes the output)"
        )));
    }
    Ok(())
}
