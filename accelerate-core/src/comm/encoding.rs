//! How objects and dtypes travel between ranks: tensors converted to a dtype every backend
//! carries and reduces without loss, dtypes numbered so that ranks can compare them, and serde
//! values as CBOR for the object collectives (`gather_object`, `broadcast_object`).

use candle_core::{DType, Tensor};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, Result};

/// A contiguous tensor of a dtype that reduces without loss or overflow (f32, f64, i64), and the dtype to
/// convert the result back to, if it differs.
pub(crate) fn wire_dtype(tensor: &Tensor) -> Result<(Tensor, Option<DType>)> {
    let wire = match tensor.dtype() {
        DType::F32 | DType::F64 | DType::I64 => None,
        // Every integer travels as i64: exact, and a sum over ranks does not overflow.
        DType::U8 | DType::U32 | DType::I16 | DType::I32 => Some(DType::I64),
        // Half and smaller floats as f32: a metric summed over ranks keeps its precision.
        _ => Some(DType::F32),
    };
    let t = match wire {
        Some(w) => tensor.to_dtype(w)?,
        None => tensor.contiguous()?,
    };
    Ok((t.contiguous()?, wire.map(|_| tensor.dtype())))
}

/// The dtypes a rank may pass, numbered so that a collective can compare them across ranks
/// (`Accelerator::broadcast` refuses ranks that passed different ones): the index is what
/// travels.
const DTYPES: [DType; 14] = [
    DType::U8,
    DType::U32,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
    DType::F8E4M3,
    DType::F6E2M3,
    DType::F6E3M2,
    DType::F4,
    DType::F8E8M0,
];

/// `dtype`'s number in [`DTYPES`].
pub(crate) fn dtype_index(dtype: DType) -> i64 {
    DTYPES
        .iter()
        .position(|&d| d == dtype)
        .map_or(-1, |i| i as i64)
}

/// The name of the dtype numbered `index` in [`DTYPES`].
pub(crate) fn dtype_name(index: i64) -> &'static str {
    usize::try_from(index)
        .ok()
        .and_then(|i| DTYPES.get(i))
        .map_or("an unknown dtype", |d| d.as_str())
}

/// `value` as CBOR bytes, for an object collective.
pub(crate) fn to_cbor<T: Serialize>(op: &'static str, rank: usize, value: &T) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    ciborium::into_writer(value, &mut bytes).map_err(|e| {
        Error::Config(format!(
            "{op}: the value of rank {rank} (this rank) cannot be serialized ({e}); its Serialize \
             implementation returned an error. Every rank refused the collective"
        ))
    })?;
    Ok(bytes)
}

/// The error of the ranks whose own value was fine when rank `failed`'s could not be encoded.
pub(crate) fn not_encoded(op: &'static str, failed: usize) -> Error {
    Error::Collective {
        op,
        peer: Some(failed),
        problem: format!(
            "the value of rank {failed} cannot be serialized (its error says why); nothing was \
             exchanged, every rank refused the collective"
        ),
    }
}

/// The value rank `rank` sent, parsed.
pub(crate) fn from_cbor<T: DeserializeOwned>(
    op: &'static str,
    rank: usize,
    bytes: &[u8],
) -> Result<T> {
    ciborium::from_reader(bytes).map_err(|e| Error::Collective {
        op,
        peer: Some(rank),
        problem: format!(
            "the value rank {rank} sent is not of the type this rank expects ({e}); pass the same \
             type on every rank"
        ),
    })
}
