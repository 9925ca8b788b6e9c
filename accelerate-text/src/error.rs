//! The crate's error type.

/// What can go wrong reading a tokenizer or a corpus; every message names the file and the fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tokenizer, corpus or token file that cannot be read or is not what it should be.
    #[error("{0}")]
    Text(String),
    /// An error of the runtime (a dataset's batch, a tensor).
    #[error(transparent)]
    Core(#[from] accelerate_core::Error),
    /// An I/O error.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
