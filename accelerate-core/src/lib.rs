//! accelerate-core: everything a training process links.
pub mod comm;
pub mod cpu_slices;
pub mod data;
pub mod error;
pub mod grads;

pub use error::{Error, Result};
