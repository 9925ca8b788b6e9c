//! A skipped test says so: it passes, so libtest would never show a reason written through its
//! captured output.

/// Says that the running test is skipped and why, as `skipped: <test>: <reason>` on this
/// process's standard error. Written to the stream itself, not through `eprintln!`, which libtest
/// captures and shows only for failing tests: a skipped test passes, so its reason would never
/// be seen. Call it, then return from the test.
pub fn skip(reason: impl std::fmt::Display) {
    use std::io::Write;
    // libtest runs each test on a thread named after it.
    let thread = std::thread::current();
    let test = thread.name().filter(|n| *n != "main").unwrap_or("a test");
    let _ = writeln!(std::io::stderr().lock(), "skipped: {test}: {reason}");
}

/// [`skip`], unless the variable `require` is set (to anything but empty or `0`): CI sets it where
/// it installed what the test needs, and there the skip is a failure that says `reason`.
pub fn skip_unless_required(require: &str, reason: impl std::fmt::Display) {
    let required = std::env::var(require).is_ok_and(|v| !v.is_empty() && v != "0");
    assert!(
        !required,
        "{require} is set, so this test may not skip: {reason}"
    );
    skip(reason);
}
