//! Our CUDA C kernels that NVRTC compiles at run time (the multi-tensor optimizer kernels, the
//! gradient accumulation kernel), and what happens when it cannot: every caller has a tensor-op
//! path that candle's own kernels run (the same values up to the sign of a zero and the rounding
//! of candle's kernels), so a failure of the machine's CUDA setup makes the callers take it, with
//! one warning per process on standard error naming the cause, instead of failing every step
//! where candle alone would have worked. The usual cause is NVRTC's second library,
//! `libnvrtc-builtins.so.<version>`, missing from the loader's path: `libnvrtc.so` loads, and
//! then fails every compilation. An error that NVRTC reports in the source itself
//! (`NVRTC_ERROR_COMPILATION`) is this crate's bug, not the machine's: it is an error, never a
//! silent fallback.
//!
//! The decision (compile once, remember a failure, warn once) is plain code, tested without a GPU.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::error::{Error, Result};

/// One CUDA C source compiled at run time, once per process.
pub(crate) struct RuntimeKernels {
    /// What the kernels do, for the warning ("the fused optimizer kernels").
    what: &'static str,
    /// The name candle's device caches the loaded module under.
    module: &'static str,
    /// The CUDA C source.
    source: &'static str,
    /// The PTX; `Ok(None)` once compiling failed for want of the machine's NVRTC (compiling
    /// again would fail again), `Err` with NVRTC's log when the source itself did not compile.
    ptx: OnceLock<std::result::Result<Option<String>, String>>,
    /// Whether loading the PTX into a device failed (the driver refused it).
    load_failed: AtomicBool,
    /// Warnings given so far: one at most per cause (tests check it).
    warnings: AtomicU64,
}

impl RuntimeKernels {
    /// The kernels of `source`, described as `what`, cached under `module` once loaded.
    pub(crate) const fn new(
        what: &'static str,
        module: &'static str,
        source: &'static str,
    ) -> Self {
        Self {
            what,
            module,
            source,
            ptx: OnceLock::new(),
            load_failed: AtomicBool::new(false),
            warnings: AtomicU64::new(0),
        }
    }

    /// The PTX of the source, compiled by `compile` on the first call; `Ok(None)` (with one
    /// warning, the first time) when `compile` failed or panicked (cudarc panics when it cannot
    /// load `libnvrtc.so` at all); an error naming the kernels when NVRTC found an error in the
    /// source (`NVRTC_ERROR_COMPILATION`).
    pub(crate) fn ptx_with(
        &self,
        compile: impl FnOnce(&str) -> std::result::Result<String, String>,
    ) -> Result<Option<&str>> {
        self.ptx
            .get_or_init(|| {
                let outcome = catch_unwind(AssertUnwindSafe(|| compile(self.source)))
                    .unwrap_or_else(|panic| Err(panic_text(panic.as_ref())));
                match outcome {
                    Ok(ptx) => Ok(Some(ptx)),
                    Err(error) if error.contains("NVRTC_ERROR_COMPILATION") => Err(error),
                    Err(error) => {
                        self.warn("compile", &error);
                        Ok(None)
                    }
                }
            })
            .as_ref()
            .map(|ptx| ptx.as_deref())
            .map_err(|log| {
                Error::Device(format!(
                    "NVRTC found an error in the source of {} (a bug of accelerate-core, not of \
                     this machine's CUDA setup; please report it): {log}",
                    self.what
                ))
            })
    }

    /// Records that loading the compiled module failed with `error`: later calls take the
    /// tensor-op path without trying again; the first failure warns.
    pub(crate) fn load_failed(&self, error: &str) {
        if !self.load_failed.swap(true, Ordering::Relaxed) {
            self.warn("load", error);
        }
    }

    /// Whether an earlier load failed.
    pub(crate) fn is_load_failed(&self) -> bool {
        self.load_failed.load(Ordering::Relaxed)
    }

    /// Warnings given so far.
    #[cfg(test)]
    fn warnings(&self) -> u64 {
        self.warnings.load(Ordering::Relaxed)
    }

    /// Says, once per cause, that the tensor-op path runs instead: on standard error, where a
    /// program without a tracing subscriber shows it too, and as a tracing event.
    fn warn(&self, stage: &str, error: &str) {
        self.warnings.fetch_add(1, Ordering::Relaxed);
        let message = fallback_message(self.what, stage, error);
        eprintln!("accelerate: warning: {message}");
        tracing::warn!("{message}");
    }
}

#[cfg(feature = "cuda")]
impl RuntimeKernels {
    /// The kernel `name` loaded on `device`, compiling the source with NVRTC (floating-point
    /// contraction off, so that each element rounds as the CPU's arithmetic does) on first use;
    /// `Ok(None)` when the machine's NVRTC could not compile it or the driver could not load it,
    /// once warned about, so that the caller takes its tensor-op path; an error when the source
    /// itself did not compile. Launch it on the device's stream (`cuda_stream().launch_builder`),
    /// as candle launches its own.
    pub(crate) fn function(
        &self,
        device: &candle_core::CudaDevice,
        name: &str,
    ) -> Result<Option<candle_core::cuda_backend::cudarc::driver::CudaFunction>> {
        use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
        if self.is_load_failed() {
            return Ok(None);
        }
        let ptx = self.ptx_with(|source| {
            let options = CompileOptions {
                fmad: Some(false),
                ..Default::default()
            };
            compile_ptx_with_opts(source, options)
                .map(|ptx| ptx.to_src())
                .map_err(|e| e.to_string())
        })?;
        let Some(ptx) = ptx else {
            return Ok(None);
        };
        match device.get_or_load_custom_func(name, self.module, ptx) {
            // candle's wrapper derefs to cudarc's function (the wrapper's type is not exported).
            Ok(function) => Ok(Some((*function).clone())),
            Err(e) => {
                self.load_failed(&e.to_string());
                Ok(None)
            }
        }
    }
}

/// The text of a caught panic's payload.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// The first shared library named in `error` (`libnvrtc-builtins.so.13.0`, say), if any.
fn library_named_in(error: &str) -> Option<&str> {
    error
        .split(|c: char| !(c.is_ascii_alphanumeric() || "._-+".contains(c)))
        .map(|word| word.trim_end_matches('.'))
        .find(|word| word.starts_with("lib") && word.contains(".so"))
}

/// The warning for a failure at `stage` ("compile" or "load") with `error`: what falls back,
/// what it costs, and the fix.
fn fallback_message(what: &str, stage: &str, error: &str) -> String {
    let library = library_named_in(error).unwrap_or("libnvrtc.so and libnvrtc-builtins.so");
    let fix = if stage == "compile" {
        format!(
            "NVRTC needs {library} (libnvrtc.so and libnvrtc-builtins.so of one CUDA version) on \
             the loader's path: add the folder holding them (the CUDA toolkit's lib64, or the \
             nvidia-cuda-nvrtc wheel's nvidia/cu13/lib) to LD_LIBRARY_PATH"
        )
    } else {
        "the driver refused NVRTC's PTX: NVRTC may be newer than the driver (use the CUDA \
         version of the driver's, on LD_LIBRARY_PATH)"
            .to_string()
    };
    format!(
        "could not {stage} {what} ({error}); using candle's tensor ops instead, which give the \
         same values (up to the sign of a zero and rounding) with more kernel launches per step. \
         {fix}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A compile failure (the error NVRTC gives without its builtins library) leaves no PTX, so
    /// callers take the tensor-op path; it is warned about once, naming the library and
    /// LD_LIBRARY_PATH, and never compiled again.
    #[test]
    fn a_compile_failure_falls_back_and_warns_once_naming_the_library() {
        let kernels = RuntimeKernels::new("the test kernels", "test_module", "source text");
        let mut compiles = 0;
        let error = "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE: libnvrtc-builtins.so.13.0: cannot \
                     open shared object file: No such file or directory";
        for _ in 0..3 {
            let ptx = kernels.ptx_with(|source| {
                compiles += 1;
                assert_eq!(source, "source text");
                Err(error.to_string())
            });
            assert_eq!(ptx.unwrap(), None);
        }
        assert_eq!(compiles, 1, "a failure is remembered");
        assert_eq!(kernels.warnings(), 1, "and warned about once");
        let message = fallback_message("the test kernels", "compile", error);
        for word in [
            "libnvrtc-builtins.so.13.0",
            "LD_LIBRARY_PATH",
            "the test kernels",
            "tensor ops",
        ] {
            assert!(message.contains(word), "{word:?} in: {message}");
        }
    }

    /// cudarc panics when it cannot load libnvrtc.so at all: that falls back too.
    #[test]
    fn a_panicking_compiler_falls_back() {
        let kernels = RuntimeKernels::new("the test kernels", "test_module", "");
        let ptx = kernels.ptx_with(|_| panic!("Unable to dynamically load the \"nvrtc\" library"));
        assert_eq!(ptx.unwrap(), None);
        assert_eq!(kernels.warnings(), 1);
    }

    /// A successful compile is kept and used by every later call, without warnings.
    #[test]
    fn a_successful_compile_is_compiled_once() {
        let kernels = RuntimeKernels::new("the test kernels", "test_module", "src");
        let mut compiles = 0;
        for _ in 0..3 {
            let ptx = kernels.ptx_with(|source| {
                compiles += 1;
                Ok(format!("ptx of {source}"))
            });
            assert_eq!(ptx.unwrap(), Some("ptx of src"));
        }
        assert_eq!((compiles, kernels.warnings()), (1, 0));
    }

    /// An error NVRTC finds in the source is our bug: every call is an error naming the kernels
    /// and NVRTC's log, never a silent fallback, and it is compiled once.
    #[test]
    fn an_error_in_the_source_is_an_error_not_a_fallback() {
        let kernels = RuntimeKernels::new("the test kernels", "test_module", "src");
        let mut compiles = 0;
        for _ in 0..2 {
            let outcome = kernels.ptx_with(|_| {
                compiles += 1;
                Err(
                    "NVRTC_ERROR_COMPILATION: 1 error detected: identifier \"x\" is undefined"
                        .to_string(),
                )
            });
            let message = outcome.unwrap_err().to_string();
            for word in ["the test kernels", "identifier \"x\" is undefined", "bug"] {
                assert!(message.contains(word), "{word:?} in: {message}");
            }
        }
        assert_eq!((compiles, kernels.warnings()), (1, 0));
    }

    /// A load failure is remembered and warned about once.
    #[test]
    fn a_load_failure_is_remembered_and_warned_once() {
        let kernels = RuntimeKernels::new("the test kernels", "test_module", "");
        assert!(!kernels.is_load_failed());
        kernels.load_failed("CUDA_ERROR_UNSUPPORTED_PTX_VERSION");
        kernels.load_failed("CUDA_ERROR_UNSUPPORTED_PTX_VERSION");
        assert!(kernels.is_load_failed());
        assert_eq!(kernels.warnings(), 1);
    }

    /// Without a library in the error, the message names both of NVRTC's.
    #[test]
    fn the_message_names_nvrtcs_libraries_when_the_error_does_not() {
        assert_eq!(
            library_named_in("x: libnvrtc-builtins.so.13.0: cannot open"),
            Some("libnvrtc-builtins.so.13.0")
        );
        // cudarc's text ends the library's name with a full stop.
        assert_eq!(
            library_named_in("failed to open libnvrtc-builtins.so.13.0."),
            Some("libnvrtc-builtins.so.13.0")
        );
        assert_eq!(library_named_in("NVRTC_ERROR_COMPILATION"), None);
        let message = fallback_message("k", "compile", "NVRTC_ERROR_COMPILATION");
        assert!(
            message.contains("libnvrtc.so and libnvrtc-builtins.so"),
            "{message}"
        );
    }
}
