//! The element types the CPU communicator moves and reduces (f32, f64, i64, bf16, f16, u32, u8:
//! the dtypes of the contract on `Communicator`), their little-endian wire encoding, and in-place
//! access to the data of CPU tensors of those types.

use std::sync::Mutex;

use candle_core::{CpuStorage, InplaceOp1, InplaceOp2, Layout, Storage, Tensor};

use crate::comm::ReduceOp;
use crate::error::{Error, Result};

/// A tensor element type the ring can carry.
pub(crate) trait Element: candle_core::WithDType + Default {
    /// Bytes per element on the wire.
    const SIZE: usize;
    /// Identifies the type in frame headers, so ranks disagreeing on the dtype are caught.
    const CODE: u8;

    /// The elements of a CPU storage of this type.
    fn of_storage(storage: &CpuStorage) -> Option<&[Self]>;
    /// The elements of a CPU storage of this type, mutably.
    fn of_storage_mut(storage: &mut CpuStorage) -> Option<&mut [Self]>;
    /// Decodes one element from `SIZE` little-endian bytes.
    fn from_le(bytes: &[u8]) -> Self;
    /// Writes the little-endian encoding of `value` into `out` (exactly `SIZE` bytes).
    #[cfg_attr(target_endian = "little", allow(dead_code))] // little-endian copies bytes whole
    fn put_le(value: Self, out: &mut [u8]);
    /// `a + b` (integers wrap, as in PyTorch).
    fn sum_of(a: Self, b: Self) -> Self;
    /// The larger of `a` and `b`; a NaN wins, so a diverged rank is not hidden by the others.
    fn max_of(a: Self, b: Self) -> Self;
    /// `a / n` (integers truncate toward zero).
    fn divided(a: Self, n: usize) -> Self;
}

/// The items of [`Element`] that only depend on the type: its size and wire code, access to a
/// CPU storage of its variant, and its little-endian encoding.
macro_rules! element_storage {
    ($t:ty, $variant:ident, $code:expr) => {
        const SIZE: usize = std::mem::size_of::<$t>();
        const CODE: u8 = $code;

        fn of_storage(storage: &CpuStorage) -> Option<&[Self]> {
            match storage {
                CpuStorage::$variant(data) => Some(data),
                _ => None,
            }
        }
        fn of_storage_mut(storage: &mut CpuStorage) -> Option<&mut [Self]> {
            match storage {
                CpuStorage::$variant(data) => Some(data),
                _ => None,
            }
        }
        fn from_le(bytes: &[u8]) -> Self {
            <$t>::from_le_bytes(bytes.try_into().expect("caller passes SIZE bytes"))
        }
        fn put_le(value: Self, out: &mut [u8]) {
            out.copy_from_slice(&value.to_le_bytes());
        }
    };
}

/// A floating-point element type. `$sum` and `$div` say how two values are added and how one is
/// divided by the world size: natively for f32 and f64; in f32, rounded once per operation (as
/// NCCL does), for bf16 and f16.
macro_rules! float_element {
    ($t:ty, $variant:ident, $code:expr, |$a:ident, $b:ident| $sum:expr, |$x:ident, $n:ident| $div:expr) => {
        impl Element for $t {
            element_storage!($t, $variant, $code);
            fn sum_of($a: Self, $b: Self) -> Self {
                $sum
            }
            fn max_of(a: Self, b: Self) -> Self {
                if a.is_nan() || a >= b {
                    a
                } else {
                    b
                }
            }
            fn divided($x: Self, $n: usize) -> Self {
                $div
            }
        }
    };
}

float_element!(f32, F32, 1, |a, b| a + b, |a, n| a / n as f32);
float_element!(f64, F64, 2, |a, b| a + b, |a, n| a / n as f64);
float_element!(
    half::bf16,
    BF16,
    4,
    |a, b| half::bf16::from_f32(a.to_f32() + b.to_f32()),
    |a, n| half::bf16::from_f32(a.to_f32() / n as f32)
);
float_element!(
    half::f16,
    F16,
    5,
    |a, b| half::f16::from_f32(a.to_f32() + b.to_f32()),
    |a, n| half::f16::from_f32(a.to_f32() / n as f32)
);

/// An integer element type: sums wrap (as in PyTorch), division truncates toward zero.
macro_rules! int_element {
    ($t:ty, $variant:ident, $code:expr) => {
        impl Element for $t {
            element_storage!($t, $variant, $code);
            fn sum_of(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            fn max_of(a: Self, b: Self) -> Self {
                a.max(b)
            }
            fn divided(a: Self, n: usize) -> Self {
                // `n` is a world size; one that does not fit the type leaves a quotient of 0
                // (of a non-negative value; i64 holds every world size).
                match <$t>::try_from(n) {
                    Ok(n) => a / n,
                    Err(_) => 0,
                }
            }
        }
    };
}

int_element!(i64, I64, 3);
int_element!(u32, U32, 6);
int_element!(u8, U8, 7);

/// Names an element type code received from a peer, for mismatch errors.
pub(crate) fn describe_code(code: u8) -> String {
    match code {
        c if c == <f32 as Element>::CODE => "f32".into(),
        c if c == <f64 as Element>::CODE => "f64".into(),
        c if c == <i64 as Element>::CODE => "i64".into(),
        c if c == <half::bf16 as Element>::CODE => "bf16".into(),
        c if c == <half::f16 as Element>::CODE => "f16".into(),
        c if c == <u32 as Element>::CODE => "u32".into(),
        c if c == <u8 as Element>::CODE => "u8".into(),
        other => format!("unknown element type {other}"),
    }
}

/// Appends the wire encoding of `values` to `out`.
pub(crate) fn encode<T: Element>(values: &[T], out: &mut Vec<u8>) {
    #[cfg(target_endian = "little")]
    out.extend_from_slice(native_bytes(values));
    #[cfg(not(target_endian = "little"))]
    {
        let start = out.len();
        out.resize(start + values.len() * T::SIZE, 0);
        for (dst, &v) in out[start..].chunks_exact_mut(T::SIZE).zip(values) {
            T::put_le(v, dst);
        }
    }
}

/// Overwrites `dst` with the elements encoded in `bytes` (exactly `dst.len() * SIZE` of them).
pub(crate) fn decode_into<T: Element>(dst: &mut [T], bytes: &[u8]) {
    assert_eq!(
        bytes.len(),
        dst.len() * T::SIZE,
        "frame length checked by the caller"
    );
    #[cfg(target_endian = "little")]
    native_bytes_mut(dst).copy_from_slice(bytes);
    #[cfg(not(target_endian = "little"))]
    for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(T::SIZE)) {
        *d = T::from_le(b);
    }
}

/// The in-memory bytes of `values`, which on a little-endian machine are their wire encoding;
/// copying them wholesale is several times faster than encoding element by element.
#[cfg(target_endian = "little")]
fn native_bytes<T: Element>(values: &[T]) -> &[u8] {
    // SAFETY: `Element` is implemented only for f32, f64, i64, bf16, f16, u32 and u8: plain numbers
    // without padding, so every byte of the slice is initialized, and u8 has no alignment
    // requirement.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}

/// Mutable counterpart of [`native_bytes`].
#[cfg(target_endian = "little")]
fn native_bytes_mut<T: Element>(values: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `native_bytes`; in addition every bit pattern is a valid value of each, so
    // any bytes written through the view leave valid values.
    unsafe {
        std::slice::from_raw_parts_mut(
            values.as_mut_ptr().cast::<u8>(),
            std::mem::size_of_val(values),
        )
    }
}

/// Combines the elements encoded in `bytes` into `dst` with `op` (`Mean` sums here; the division
/// happens once, when the sum is complete).
pub(crate) fn reduce_into<T: Element>(dst: &mut [T], bytes: &[u8], op: ReduceOp) {
    debug_assert_eq!(bytes.len(), dst.len() * T::SIZE);
    let pairs = dst.iter_mut().zip(bytes.chunks_exact(T::SIZE));
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            pairs.for_each(|(d, b)| *d = T::sum_of(*d, T::from_le(b)))
        }
        ReduceOp::Max => pairs.for_each(|(d, b)| *d = T::max_of(*d, T::from_le(b))),
    }
}

/// Divides every element by `n`.
pub(crate) fn divide<T: Element>(values: &mut [T], n: usize) {
    for v in values {
        *v = T::divided(*v, n);
    }
}

/// Runs `f` on the elements of a contiguous CPU tensor of element type `T`, in place.
pub(crate) fn with_elements_mut<T: Element, R>(
    tensor: &Tensor,
    f: impl FnOnce(&mut [T]) -> Result<R>,
) -> Result<R> {
    let op = ElementsOp::<T, _, R> {
        f: Mutex::new(Some(f)),
        result: Mutex::new(None),
        _element: std::marker::PhantomData,
    };
    tensor.inplace_op1(&op)?;
    op.result
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .unwrap_or_else(|| {
            Err(Error::Config(format!(
                "internal: tensor of dtype {:?} was not reachable as {:?} CPU storage",
                tensor.dtype(),
                <T as candle_core::WithDType>::DTYPE
            )))
        })
}

/// Runs `f` on the elements of the contiguous CPU tensor `input`, read, and those of the
/// contiguous CPU tensor `output`, written in place, both of element type `T`.
///
/// Both storages stay locked while `f` runs, which for a collective means while it waits for
/// its peers. candle's `inplace_op2` takes the two locks in one order fixed by the storages'
/// addresses, whatever their roles, as candle's own in-place ops do; taking the input's first
/// because it is the input would deadlock against a thread that holds the output's storage and
/// waits to write the input's. It refuses an output sharing the input's storage (a read lock
/// and a write lock on one storage would wait on each other forever).
pub(crate) fn with_input_and_output<T: Element, R>(
    input: &Tensor,
    output: &Tensor,
    f: impl FnOnce(&[T], &mut [T]) -> Result<R>,
) -> Result<R> {
    let op = PairOp::<T, _, R> {
        f: Mutex::new(Some(f)),
        result: Mutex::new(None),
        _element: std::marker::PhantomData,
    };
    output.inplace_op2(input, &op)?;
    op.result
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .unwrap_or_else(|| {
            Err(Error::Config(format!(
                "internal: tensors of dtypes {:?} and {:?} were not reachable as contiguous \
                 {:?} CPU storages",
                input.dtype(),
                output.dtype(),
                <T as candle_core::WithDType>::DTYPE
            )))
        })
}

/// Copies the elements of a contiguous CPU tensor of element type `T`.
pub(crate) fn read_elements<T: Element>(tensor: &Tensor, into: &mut [T]) -> Result<()> {
    let (storage, layout) = tensor.storage_and_layout();
    let elements = match (&*storage, layout.contiguous_offsets()) {
        (Storage::Cpu(cpu), Some((start, end))) => T::of_storage(cpu).map(|data| &data[start..end]),
        _ => None,
    };
    match elements {
        Some(data) if data.len() == into.len() => {
            into.copy_from_slice(data);
            Ok(())
        }
        _ => Err(Error::Config(format!(
            "internal: tensor of dtype {:?} and shape {:?} was not readable as {} {:?} elements",
            tensor.dtype(),
            tensor.dims(),
            into.len(),
            <T as candle_core::WithDType>::DTYPE
        ))),
    }
}

struct ElementsOp<T, F, R> {
    f: Mutex<Option<F>>,
    result: Mutex<Option<Result<R>>>,
    _element: std::marker::PhantomData<fn(T)>,
}

impl<T: Element, F: FnOnce(&mut [T]) -> Result<R>, R> InplaceOp1 for ElementsOp<T, F, R> {
    fn name(&self) -> &'static str {
        "accelerate-cpu-collective"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (Some((start, end)), Some(data)) =
            (layout.contiguous_offsets(), T::of_storage_mut(storage))
        else {
            // Leaves `result` empty; the caller reports it.
            return Ok(());
        };
        let Some(f) = self.f.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Ok(());
        };
        let r = f(&mut data[start..end]);
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        Ok(())
    }
}

/// The in-place op behind [`with_input_and_output`]: candle passes the output as the
/// destination and the input as the source.
struct PairOp<T, F, R> {
    f: Mutex<Option<F>>,
    result: Mutex<Option<Result<R>>>,
    _element: std::marker::PhantomData<fn(T)>,
}

impl<T: Element, F: FnOnce(&[T], &mut [T]) -> Result<R>, R> InplaceOp2 for PairOp<T, F, R> {
    fn name(&self) -> &'static str {
        "accelerate-cpu-collective"
    }

    fn cpu_fwd(
        &self,
        output: &mut CpuStorage,
        output_layout: &Layout,
        input: &CpuStorage,
        input_layout: &Layout,
    ) -> candle_core::Result<()> {
        let (Some((o_start, o_end)), Some((i_start, i_end)), Some(out), Some(inp)) = (
            output_layout.contiguous_offsets(),
            input_layout.contiguous_offsets(),
            T::of_storage_mut(output),
            T::of_storage(input),
        ) else {
            // Leaves `result` empty; the caller reports it.
            return Ok(());
        };
        let Some(f) = self.f.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Ok(());
        };
        let r = f(&inp[i_start..i_end], &mut out[o_start..o_end]);
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn encoding_round_trips_and_reductions_follow_the_definitions() {
        let mut bytes = Vec::new();
        encode(&[1.5f32, -2.0, 3.25], &mut bytes);
        assert_eq!(bytes.len(), 12);
        assert_eq!(&bytes[..4], &1.5f32.to_le_bytes());
        let mut acc = [10.0f32, 10.0, 10.0];
        reduce_into(&mut acc, &bytes, ReduceOp::Sum);
        assert_eq!(acc, [11.5, 8.0, 13.25]);
        reduce_into(&mut acc, &bytes, ReduceOp::Max);
        assert_eq!(acc, [11.5, 8.0, 13.25]);
        divide(&mut acc, 2);
        assert_eq!(acc, [5.75, 4.0, 6.625]);
        let mut ints = [7i64, -7, i64::MAX];
        let mut one = Vec::new();
        encode(&[1i64, 1, 1], &mut one);
        reduce_into(&mut ints, &one, ReduceOp::Sum);
        assert_eq!(ints, [8, -6, i64::MIN]); // wraps like PyTorch instead of panicking
        divide(&mut ints[..2], 3);
        assert_eq!(&ints[..2], &[2, -2]); // truncation toward zero
    }

    #[test]
    fn max_lets_nan_through() {
        assert!(<f64 as Element>::max_of(f64::NAN, 1.0).is_nan());
        assert!(<f64 as Element>::max_of(1.0, f64::NAN).is_nan());
        assert_eq!(<f64 as Element>::max_of(-1.0, 2.0), 2.0);
    }

    #[test]
    fn in_place_access_honours_views_and_dtypes() {
        let flat = Tensor::new(&[1i64, 2, 3, 4, 5], &Device::Cpu).unwrap();
        let view = flat.narrow(0, 1, 3).unwrap();
        with_elements_mut::<i64, _>(&view, |xs| {
            assert_eq!(xs, &[2, 3, 4]);
            xs.iter_mut().for_each(|x| *x *= 10);
            Ok(())
        })
        .unwrap();
        assert_eq!(flat.to_vec1::<i64>().unwrap(), vec![1, 20, 30, 40, 5]);
        let mut copy = [0i64; 3];
        read_elements(&view, &mut copy).unwrap();
        assert_eq!(copy, [20, 30, 40]);
        // Asking for the wrong element type is an error, not a silent no-op.
        assert!(with_elements_mut::<f64, _>(&view, |_| Ok(())).is_err());
    }

    #[test]
    fn an_input_and_output_pair_is_read_and_written_unless_they_share_a_storage() {
        let input = Tensor::new(&[1.0f32, 2.0, 3.0, 4.0], &Device::Cpu).unwrap();
        let buffer = Tensor::zeros(6, candle_core::DType::F32, &Device::Cpu).unwrap();
        let output = buffer.narrow(0, 1, 4).unwrap();
        with_input_and_output::<f32, _>(&input, &output, |from, to| {
            to.iter_mut().zip(from).for_each(|(t, f)| *t = 2.0 * f);
            Ok(())
        })
        .unwrap();
        let got = buffer.to_vec1::<f32>().unwrap();
        assert_eq!(got, [0.0, 2.0, 4.0, 6.0, 8.0, 0.0]);
        // Two views of one buffer: refused, not read-locked and then write-locked (a hang).
        let err = with_input_and_output::<f32, _>(
            &buffer.narrow(0, 0, 2).unwrap(),
            &buffer.narrow(0, 2, 2).unwrap(),
            |_, _| Ok(()),
        )
        .unwrap_err();
        assert!(err.to_string().contains("shares storage with dst"), "{err}");
        // The wrong element type is an error, not a silent no-op.
        assert!(with_input_and_output::<f64, _>(&input, &output, |_, _| Ok(())).is_err());
    }
}
