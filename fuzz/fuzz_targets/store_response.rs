//! Fuzzes the frames the store sends back to a client.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = accelerate_core::fuzzing::store_response(data);
});
