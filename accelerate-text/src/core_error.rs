//! This crate's errors as accelerate-core's, for the dataset traits the loaders call.

use crate::error::Error;

/// `e` as an accelerate-core error: a wrapped one unwrapped, any other a data error with the same
/// message.
pub(crate) fn to_core(e: Error) -> accelerate_core::Error {
    match e {
        Error::Core(e) => e,
        other => accelerate_core::Error::Data(other.to_string()),
    }
}
