//! The C ABI of the emulator's runtime (`cpp/runtime/launch.cc`), and the type codes it shares
//! with `cpp/emu/abi.h`.

use std::ffi::{c_char, c_int, c_long, c_void};

/// The scalar kinds of `abi.h`'s `emu::Kind` (a pointer's kind is its pointee's).
pub(crate) mod kind {
    pub(crate) const F32: u32 = 1;
    pub(crate) const F64: u32 = 2;
    pub(crate) const BF16: u32 = 3;
    pub(crate) const F16: u32 = 4;
    pub(crate) const I8: u32 = 5;
    pub(crate) const U8: u32 = 6;
    pub(crate) const I16: u32 = 7;
    pub(crate) const U16: u32 = 8;
    pub(crate) const I32: u32 = 9;
    pub(crate) const U32: u32 = 10;
    pub(crate) const I64: u32 = 11;
    pub(crate) const U64: u32 = 12;
}
/// The flag of a pointer argument.
pub(crate) const POINTER: u32 = 1 << 8;
/// The flag of a read-only pointer argument.
pub(crate) const CONST: u32 = 1 << 9;

extern "C" {
    /// 0 on success, else 1 with the reason in `emu_last_error`.
    pub(crate) fn emu_launch(
        name: *const c_char,
        grid: *const u32,
        block: *const u32,
        dynamic_smem: usize,
        args: *const *mut c_void,
        arg_codes: *const u32,
        nargs: usize,
        order: c_int,
    ) -> c_int;
    /// The calling thread's last launch error.
    pub(crate) fn emu_last_error() -> *const c_char;
    pub(crate) fn emu_kernel_count() -> usize;
    pub(crate) fn emu_kernel_name(i: usize) -> *const c_char;
    pub(crate) fn emu_kernel_signature(name: *const c_char, out: *mut c_char, cap: usize)
        -> c_long;
    /// A guarded allocation of `bytes` bytes (16-byte aligned, poisoned with 0xFF), or null.
    pub(crate) fn emu_alloc(bytes: usize) -> *mut c_void;
    pub(crate) fn emu_free(data: *mut c_void);
}
