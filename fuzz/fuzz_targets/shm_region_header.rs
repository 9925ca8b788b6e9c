//! Fuzzes the header of the shared mapping another rank created.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = accelerate_core::fuzzing::shm_region_header(data);
});
