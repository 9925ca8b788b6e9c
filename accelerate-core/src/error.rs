//! One error type for the whole runtime. Every message says what was wrong and, where there is one,
//! what to do about it; errors that involve another process name its rank.

use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong in accelerate-core.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor operation failed inside candle.
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),

    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A socket or other non-file I/O operation failed.
    #[error("{context}: {source}")]
    Network {
        /// What was being done, and with whom.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// An environment variable that the runtime reads holds something it cannot use.
    #[error("environment variable {name}={value:?} is invalid: {problem}")]
    Env {
        /// The variable's name.
        name: String,
        /// Its value.
        value: String,
        /// What is wrong with it and what would be right.
        problem: String,
    },

    /// A configuration value (builder option, flag, argument) is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// A dataset or data file is unusable.
    #[error("data: {0}")]
    Data(String),

    /// The model's parameters do not match what was expected (names, shapes, dtypes).
    #[error("parameters: {0}")]
    Parameters(String),

    /// An optimizer or scheduler was misused, or its saved state does not fit.
    #[error("optimizer: {0}")]
    Optimizer(String),

    /// A collective operation failed; `rank` is the peer that caused it, when known.
    #[error("collective {op} failed{}: {problem}", peer_suffix(*.peer))]
    Collective {
        /// The collective (`all_reduce`, `broadcast`, ...).
        op: &'static str,
        /// The rank that disconnected, misbehaved or did not answer.
        peer: Option<usize>,
        /// What happened.
        problem: String,
    },

    /// Waiting on another process took longer than allowed.
    #[error("timed out after {after:?} waiting for {what}; {hint}")]
    Timeout {
        /// What was awaited (names the peer).
        what: String,
        /// The limit that was exceeded.
        after: Duration,
        /// What to check or which setting raises the limit.
        hint: String,
    },

    /// No usable device: a GPU was required but is missing, or a local rank has no GPU.
    #[error("device: {0}")]
    Device(String),

    /// The rendezvous store refused a request or could not be reached.
    #[error("rendezvous store: {0}")]
    Store(String),

    /// A checkpoint is missing, corrupt or does not match this run.
    #[error("checkpoint {path}: {problem}")]
    Checkpoint {
        /// The checkpoint file or directory.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },

    /// A tracker (`report_to`) could not write its file.
    #[error("tracker file {path}: {problem}")]
    Tracking {
        /// The file or directory involved.
        path: PathBuf,
        /// What failed and what to do about it.
        problem: String,
    },
}

fn peer_suffix(peer: Option<usize>) -> String {
    match peer {
        Some(rank) => format!(" with rank {rank}"),
        None => String::new(),
    }
}

impl Error {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

/// The result type of accelerate-core.
pub type Result<T> = std::result::Result<T, Error>;
