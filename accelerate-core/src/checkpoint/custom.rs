//! State of the user's own saved with the checkpoint
//! ([`register_for_checkpointing`](crate::Accelerator::register_for_checkpointing)): an epoch
//! counter, a best metric, a struct.
//!
//! Each registered object is shared between the loop and the accelerator as an `Arc<Mutex<T>>`:
//! the loop changes it through its handle, `save_state` writes its value as it is at that moment
//! into `custom_checkpoint_<i>.cbor` (main process, as Accelerate writes
//! `custom_checkpoint_<i>.pkl`; listed in the manifest with its CRC-32 like every other file), and
//! `load_state` parses every one before anything changes and only then replaces the values, on
//! every rank.
//!
//! CBOR rather than JSON: JSON writes an infinity or a NaN (the usual `best_loss = inf`) as
//! `null`, which then does not read back as the float it was; CBOR keeps them, and is
//! self-describing, so a value of another type is refused at load.
//!
//! The accelerator takes an object's lock for a bounded time only: a loop that calls `save_state`
//! while holding the guard of a handle would otherwise wait on itself forever.

use std::any::Any;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;

/// How long saving or loading waits for a registered object's lock before refusing.
const LOCK_WAIT: Duration = Duration::from_secs(5);

/// The file of registered object `i`.
pub(crate) fn custom_file(i: usize) -> String {
    format!("custom_checkpoint_{i}.cbor")
}

/// A registered object, whatever its type: written as CBOR, parsed (checked) apart from being
/// applied, so that a load changes nothing until every file is known good.
pub(crate) trait CustomState: Send + Sync {
    /// The value now, as CBOR.
    fn encode(&self) -> std::result::Result<Vec<u8>, String>;
    /// `bytes` parsed as this object's type.
    fn parse(&self, bytes: &[u8]) -> std::result::Result<Box<dyn Any + Send>, String>;
    /// Replaces the value with one [`parse`](Self::parse) returned.
    fn apply(&self, parsed: Box<dyn Any + Send>) -> std::result::Result<(), String>;
    /// Whether the value can be replaced now (its lock is free, or freed within a bounded wait).
    fn check_unlocked(&self) -> std::result::Result<(), String>;
    /// The Rust type, for messages.
    fn type_name(&self) -> &'static str;
}

/// The object's lock, waited for [`LOCK_WAIT`] at most (a poisoned lock is taken: the value is
/// still whole, a panic elsewhere cannot have left it half-written through serde).
fn lock_within<T>(object: &Mutex<T>) -> std::result::Result<MutexGuard<'_, T>, String> {
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        match object.try_lock() {
            Ok(guard) => return Ok(guard),
            Err(TryLockError::Poisoned(e)) => return Ok(e.into_inner()),
            Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(TryLockError::WouldBlock) => {
                return Err(format!(
                    "its handle has been locked for over {}s; drop the guard of \
                     `handle.lock()` before save_state and load_state",
                    LOCK_WAIT.as_secs()
                ))
            }
        }
    }
}

impl<T: Serialize + DeserializeOwned + Send + 'static> CustomState for Mutex<T> {
    fn encode(&self) -> std::result::Result<Vec<u8>, String> {
        let value = lock_within(self)?;
        let mut bytes = Vec::new();
        ciborium::into_writer(&*value, &mut bytes).map_err(|e| e.to_string())?;
        Ok(bytes)
    }

    fn parse(&self, bytes: &[u8]) -> std::result::Result<Box<dyn Any + Send>, String> {
        ciborium::from_reader::<T, _>(bytes)
            .map(|v| Box::new(v) as Box<dyn Any + Send>)
            .map_err(|e| e.to_string())
    }

    fn apply(&self, parsed: Box<dyn Any + Send>) -> std::result::Result<(), String> {
        let value = parsed
            .downcast::<T>()
            .map_err(|_| "the parsed value is of another type".to_string())?;
        *lock_within(self)? = *value;
        Ok(())
    }

    fn check_unlocked(&self) -> std::result::Result<(), String> {
        lock_within(self).map(drop)
    }

    fn type_name(&self) -> &'static str {
        std::any::type_name::<T>()
    }
}

/// A registered object as the accelerator keeps it.
pub(crate) type SharedCustomState = Arc<dyn CustomState>;
