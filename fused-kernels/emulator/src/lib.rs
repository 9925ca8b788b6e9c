//! Runs fused-kernels' CUDA kernels on the CPU, so that tests without a GPU check the CUDA C
//! itself and not only a CPU kernel written to match it.
//!
//! The build script compiles every `fused-kernels/src/cuda/*.cu` with the system's C++ compiler
//! (g++), with `cuda_emulator.h` supplying what device code uses, and registers every
//! `extern "C" __global__` kernel by name with its parameter types. [`launch`] then runs a
//! kernel with CUDA's execution model: each block's threads are fibers on one OS thread (so
//! `__shared__` variables are thread-local statics), `__syncthreads` waits for the block's
//! running threads, warp shuffles and votes wait for the warp's 32 lanes, and blocks run in
//! parallel on several OS threads. A kernel's threads run in a chosen [`Order`] between
//! barriers, so a missing barrier shows as a result that differs between the two orders; a
//! `__syncthreads` some threads skip, a deadlock, or a collective without the full warp is an
//! error naming the kernel, block and thread, never a hang.
//!
//! ```no_run
//! use fused_kernels_emulator::{launch, Arg, Buffer, Order};
//! # fn main() -> Result<(), fused_kernels_emulator::Error> {
//! let x = Buffer::from_slice(&[1.0f32, -2.0, 3.0])?;
//! let mut y = Buffer::<f32>::poisoned(3)?;
//! launch("gelu_f32", 1, 256, 0, &[Arg::ptr(&x), Arg::ptr_mut(&mut y), Arg::U64(3)], Order::Increasing)?;
//! println!("{:?}", y.to_vec());
//! # Ok(())
//! # }
//! ```
//!
//! What it cannot catch (timing, data races between threads that do not synchronize, resource
//! limits, performance) is in the crate's README.

#![deny(missing_docs)]

mod arg;
mod buffer;
mod element;
mod error;
mod ffi;
mod launch;

pub use arg::Arg;
pub use buffer::Buffer;
pub use element::Element;
pub use error::Error;
pub use launch::{kernels, launch, signature, Dim3, Order};
