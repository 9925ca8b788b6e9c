//! Where the binaries `cargo test` built for the tests are: beside the test binary's own folder.

use std::path::PathBuf;

/// The directory of the build profile the tests were built with (`target/release` or
/// `target/debug`), where `cargo test` also puts the launcher and the examples.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test>-<hash>
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("test executable lives in target/<profile>/deps")
        .to_path_buf()
}

/// Path of a binary built by `cargo test --workspace`, with a clear message when it is missing.
pub fn built_binary(relative: &str) -> PathBuf {
    let path = profile_dir().join(relative);
    assert!(
        path.exists(),
        "{} is missing: run the tests with `cargo test --release --workspace`, which builds the \
         launcher and the examples",
        path.display()
    );
    path
}
