//! The Trainer's error type.

/// What can go wrong in a Trainer run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Training arguments that cannot work, or a file of them that cannot be read; the message
    /// names the argument and the fix.
    #[error("{0}")]
    Args(String),
    /// An error of the runtime (collectives, checkpoints, trackers, data).
    #[error(transparent)]
    Accelerate(#[from] accelerate_core::Error),
    /// A file or directory of the run (a checkpoint, `output_dir`) that could not be read or
    /// changed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: std::path::PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// An error of a tensor operation (the model's forward pass, the loss).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// The Trainer's result type.
pub type Result<T> = std::result::Result<T, Error>;
