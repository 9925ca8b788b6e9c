//! Fuzzes the records ranks publish through the store (ring address card, shared-memory host
//! card, transport plan).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = accelerate_core::fuzzing::store_records(data);
});
