//! Fuzzes the frames a store client sends (hello under the unauthenticated limit, then requests).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = accelerate_core::fuzzing::store_request(data);
});
