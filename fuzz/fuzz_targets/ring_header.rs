//! Fuzzes a ring frame header, and an abort frame's payload.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = accelerate_core::fuzzing::ring_header(data);
});
