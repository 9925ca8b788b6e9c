//! Fuzzes the hello that opens a ring connection.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = accelerate_core::fuzzing::ring_hello(data);
});
