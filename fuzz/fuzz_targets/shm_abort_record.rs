//! Fuzzes the abort record of the shared mapping.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = accelerate_core::fuzzing::shm_abort_record(data);
});
