//! Fuzzes a round tag in a peer's staging half of the shared mapping.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = accelerate_core::fuzzing::shm_round_tag(data);
});
