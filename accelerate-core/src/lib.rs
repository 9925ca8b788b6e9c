//! accelerate-core: everything a training process links.
pub mod comm;
pub mod cpu_slices;
pub mod error;
pub mod grads;
pub mod optim;

pub use error::{Error, Result};
