//! State of the user's own saved with the checkpoint
//! ([`register_for_checkpointing`](crate::Accelerator::register_for_checkpointing)): an epoch
//! counter, a best metric, a struct.
//!
//! Each registered object is shared between the loop and the accelerator as an `Arc<Mutex<T>>`:
//! the loop changes it through its handle, `save_state` writes its value as it is at that moment
//! into `custom_checkpoint_<i>.json` (main process, as Accelerate writes `custom_checkpoint_<i>.pkl`;
//! listed in the manifest with its CRC-32 like every other file), and `load_state` parses every
//! one before anything changes and only then replaces the values, on every rank.

use std::any::Any;
use std::sync::{Arc, Mutex};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::training::lock;

/// The file of registered object `i`.
pub(crate) fn custom_file(i: usize) -> String {
    format!("custom_checkpoint_{i}.json")
}

/// A registered object, whatever its type: written as JSON, parsed (checked) apart from being
/// applied, so that a load changes nothing until every file is known good.
pub(crate) trait CustomState: Send + Sync {
    /// The value now, as JSON.
    fn to_json(&self) -> std::result::Result<Vec<u8>, String>;
    /// `bytes` parsed as this object's type.
    fn parse(&self, bytes: &[u8]) -> std::result::Result<Box<dyn Any + Send>, String>;
    /// Replaces the value with one [`parse`](Self::parse) returned.
    fn apply(&self, parsed: Box<dyn Any + Send>);
    /// The Rust type, for messages.
    fn type_name(&self) -> &'static str;
}

impl<T: Serialize + DeserializeOwned + Send + 'static> CustomState for Mutex<T> {
    fn to_json(&self) -> std::result::Result<Vec<u8>, String> {
        serde_json::to_vec_pretty(&*lock(self)).map_err(|e| e.to_string())
    }

    fn parse(&self, bytes: &[u8]) -> std::result::Result<Box<dyn Any + Send>, String> {
        serde_json::from_slice::<T>(bytes)
            .map(|v| Box::new(v) as Box<dyn Any + Send>)
            .map_err(|e| e.to_string())
    }

    fn apply(&self, parsed: Box<dyn Any + Send>) {
        if let Ok(value) = parsed.downcast::<T>() {
            *lock(self) = *value;
        }
    }

    fn type_name(&self) -> &'static str {
        std::any::type_name::<T>()
    }
}

/// A registered object as the accelerator keeps it.
pub(crate) type SharedCustomState = Arc<dyn CustomState>;
