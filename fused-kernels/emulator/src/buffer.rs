//! Device-like memory: typed buffers in guarded allocations.

use crate::element::Element;
use crate::ffi;
use crate::Error;
use std::ptr::NonNull;

/// A buffer of `len` elements of `T` that kernels read and write, as device memory would be.
///
/// Its allocation sits between two inaccessible guard pages, with its data (16-byte aligned)
/// ending just before the upper one: a kernel's access well past either end faults at once and
/// the emulator aborts naming the kernel, block and thread; a write into the few bytes of
/// alignment slack after the end, or into the page before the start, is found after the launch
/// (the bytes there hold a canary pattern) and makes the launch an error. A new buffer from
/// [`Buffer::poisoned`] holds 0xFF bytes (NaN for floats), so output a kernel forgets to write
/// shows.
pub struct Buffer<T: Element> {
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: the buffer owns its allocation; sharing it is sharing a `[T]` of `Send + Sync` values.
unsafe impl<T: Element> Send for Buffer<T> {}
// SAFETY: as above; `&Buffer` only reads (kernels write only through `&mut Buffer` arguments).
unsafe impl<T: Element> Sync for Buffer<T> {}

impl<T: Element> Buffer<T> {
    /// A buffer of `len` elements whose bytes are all 0xFF, for a kernel's output.
    pub fn poisoned(len: usize) -> Result<Self, Error> {
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
            Error::new(format!(
                "a buffer of {len} {} elements is too large",
                T::NAME
            ))
        })?;
        // SAFETY: emu_alloc returns a fresh mapping of at least `bytes` bytes, 16-byte aligned
        // (enough for every Element), or null.
        let raw = unsafe { ffi::emu_alloc(bytes) };
        let ptr = NonNull::new(raw.cast::<T>()).ok_or_else(|| {
            Error::new(format!(
                "cannot map a buffer of {bytes} bytes ({len} {} elements)",
                T::NAME
            ))
        })?;
        Ok(Self { ptr, len })
    }

    /// A buffer holding a copy of `values`.
    pub fn from_slice(values: &[T]) -> Result<Self, Error> {
        let mut b = Self::poisoned(values.len())?;
        b.as_mut_slice().copy_from_slice(values);
        Ok(b)
    }

    /// A buffer of `len` copies of `value`.
    pub fn filled(len: usize, value: T) -> Result<Self, Error> {
        let mut b = Self::poisoned(len)?;
        b.as_mut_slice().fill(value);
        Ok(b)
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements.
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: ptr points to len initialized (poisoned or written) elements that live as long
        // as self; kernels write them only during a launch holding `&mut self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The elements, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in as_slice, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// A copy of the elements.
    pub fn to_vec(&self) -> Vec<T> {
        self.as_slice().to_vec()
    }

    /// The device pointer of element `offset` (the end for `offset == len`).
    pub(crate) fn ptr_at(&self, offset: usize) -> Result<*mut T, Error> {
        if offset > self.len {
            return Err(Error::new(format!(
                "offset {offset} is past the end of a buffer of {} {} elements",
                self.len,
                T::NAME
            )));
        }
        // SAFETY: offset <= len keeps the pointer inside the allocation or one past its end.
        Ok(unsafe { self.ptr.as_ptr().add(offset) })
    }
}

impl<T: Element> Drop for Buffer<T> {
    fn drop(&mut self) {
        // SAFETY: ptr came from emu_alloc and is freed once.
        unsafe { ffi::emu_free(self.ptr.as_ptr().cast()) }
    }
}

impl<T: Element + std::fmt::Debug> std::fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}
