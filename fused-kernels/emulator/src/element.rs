//! The element types a [`crate::Buffer`] holds.

use crate::ffi::kind;
use half::{bf16, f16};

/// A plain value type a kernel reads or writes through a pointer: the floats of fused-kernels'
/// kernels and the integer types of their indices. Sealed: the emulator checks a buffer's element
/// type against the kernel's pointer type by [`Element::KIND`], which must be right.
pub trait Element: Copy + Send + Sync + sealed::Sealed + 'static {
    /// The element's kind, as the runtime's type codes number it.
    #[doc(hidden)]
    const KIND: u32;
    /// The name the errors use.
    const NAME: &'static str;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! element {
    ($t:ty, $kind:expr, $name:literal) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const KIND: u32 = $kind;
            const NAME: &'static str = $name;
        }
    };
}
element!(f32, kind::F32, "f32");
element!(f64, kind::F64, "f64");
element!(bf16, kind::BF16, "bf16");
element!(f16, kind::F16, "f16");
element!(i8, kind::I8, "i8");
element!(u8, kind::U8, "u8");
element!(i16, kind::I16, "i16");
element!(u16, kind::U16, "u16");
element!(i32, kind::I32, "i32");
element!(u32, kind::U32, "u32");
element!(i64, kind::I64, "i64");
element!(u64, kind::U64, "u64");
