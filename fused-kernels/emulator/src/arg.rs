//! Kernel arguments: buffer pointers and scalars.

use crate::buffer::Buffer;
use crate::element::Element;
use crate::ffi::{self, kind};
use crate::Error;
use std::marker::PhantomData;

/// One argument of a launch, checked against the kernel's parameter of the same position: a
/// pointer into a [`Buffer`] whose element type is the parameter's pointee, or a scalar of the
/// parameter's exact type (`u64` for `unsigned long long`/`u64`, `i32` for `int`, `u32` for
/// `unsigned`, `f32` for `float`, `f64` for `double`, `i64` for `long long`).
///
/// A kernel may write through a pointer only if it was passed with [`Arg::ptr_mut`] (which
/// borrows the buffer mutably); a non-const pointer parameter refuses [`Arg::ptr`].
#[derive(Debug, Clone, Copy)]
pub struct Arg<'a> {
    pub(crate) value: Value,
    pub(crate) code: u32,
    _buffers: PhantomData<&'a ()>,
}

/// An argument's bits, laid out as the kernel's parameter.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Value {
    Pointer(*mut std::ffi::c_void),
    U64(u64),
    I64(i64),
    U32(u32),
    I32(i32),
    F32(f32),
    F64(f64),
}

impl<'a> Arg<'a> {
    fn new(value: Value, code: u32) -> Self {
        Arg {
            value,
            code,
            _buffers: PhantomData,
        }
    }

    /// A read-only pointer to the start of `buffer` (a `const T*` parameter).
    pub fn ptr<T: Element>(buffer: &'a Buffer<T>) -> Self {
        Self::new(
            Value::Pointer(
                buffer
                    .ptr_at(0)
                    .expect("offset 0 is in every buffer")
                    .cast(),
            ),
            T::KIND | ffi::POINTER | ffi::CONST,
        )
    }

    /// A pointer to the start of `buffer` the kernel may write through (a `T*` parameter).
    pub fn ptr_mut<T: Element>(buffer: &'a mut Buffer<T>) -> Self {
        Self::new(
            Value::Pointer(
                buffer
                    .ptr_at(0)
                    .expect("offset 0 is in every buffer")
                    .cast(),
            ),
            T::KIND | ffi::POINTER,
        )
    }

    /// A read-only pointer to element `offset` of `buffer` (`offset <= len`).
    pub fn ptr_at<T: Element>(buffer: &'a Buffer<T>, offset: usize) -> Result<Self, Error> {
        Ok(Self::new(
            Value::Pointer(buffer.ptr_at(offset)?.cast()),
            T::KIND | ffi::POINTER | ffi::CONST,
        ))
    }

    /// A writable pointer to element `offset` of `buffer` (`offset <= len`), as a sub-slice of a
    /// device buffer is passed.
    pub fn ptr_mut_at<T: Element>(buffer: &'a mut Buffer<T>, offset: usize) -> Result<Self, Error> {
        Ok(Self::new(
            Value::Pointer(buffer.ptr_at(offset)?.cast()),
            T::KIND | ffi::POINTER,
        ))
    }

    /// An `unsigned long long` (u64) scalar.
    #[allow(non_snake_case)]
    pub fn U64(v: u64) -> Self {
        Self::new(Value::U64(v), kind::U64)
    }

    /// A `long long` (i64) scalar.
    #[allow(non_snake_case)]
    pub fn I64(v: i64) -> Self {
        Self::new(Value::I64(v), kind::I64)
    }

    /// An `unsigned int` (u32) scalar.
    #[allow(non_snake_case)]
    pub fn U32(v: u32) -> Self {
        Self::new(Value::U32(v), kind::U32)
    }

    /// An `int` (i32) scalar.
    #[allow(non_snake_case)]
    pub fn I32(v: i32) -> Self {
        Self::new(Value::I32(v), kind::I32)
    }

    /// A `float` (f32) scalar.
    #[allow(non_snake_case)]
    pub fn F32(v: f32) -> Self {
        Self::new(Value::F32(v), kind::F32)
    }

    /// A `double` (f64) scalar.
    #[allow(non_snake_case)]
    pub fn F64(v: f64) -> Self {
        Self::new(Value::F64(v), kind::F64)
    }
}
