//! With the `cuda` feature, compiles every `src/cuda/*.cu` to PTX in `OUT_DIR` with nvcc, so that a
//! type-check of the CUDA build (`cargo clippy --features cuda`) also compiles the CUDA C and
//! reports its errors. Without the feature it does nothing.
//!
//! nvcc is `$NVCC`, else `$CUDA_ROOT/bin/nvcc` or `$CUDA_PATH/bin/nvcc`, else `nvcc` on `PATH`. The
//! PTX targets compute capability `$CUDA_COMPUTE_CAP` (e.g. 90 for Hopper, as candle-kernels
//! reads it), else the first GPU's as `nvidia-smi` reports it. Like candle's own kernels, the PTX
//! runs on that capability and newer ones: build for the oldest GPU the binary will meet.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/cuda");
    // PATH too: nvcc may be found there.
    for var in ["CUDA_COMPUTE_CAP", "NVCC", "CUDA_ROOT", "CUDA_PATH", "PATH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = nvcc();
    let arch = compute_cap();
    let sources = Path::new("src/cuda");
    let mut units: Vec<PathBuf> = std::fs::read_dir(sources)
        .unwrap_or_else(|e| panic!("fused-kernels: cannot list {}: {e}", sources.display()))
        .map(|entry| entry.expect("a directory entry of src/cuda").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    units.sort();
    for unit in units {
        let stem = unit
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("a UTF-8 file name");
        let ptx = out_dir.join(format!("{stem}.ptx"));
        let output = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", "-lineinfo"])
            .arg(format!("--gpu-architecture=sm_{arch}"))
            .arg("-I")
            .arg(sources)
            .arg("-o")
            .arg(&ptx)
            .arg(&unit)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "fused-kernels: the cuda feature compiles its kernels with nvcc, which could \
                     not be run as {}: {e}. Put nvcc on PATH or name it in NVCC \
                     (scripts/gpu-build.sh installs it from NVIDIA's wheels)",
                    nvcc.display()
                )
            });
        if !output.status.success() {
            panic!(
                "fused-kernels: nvcc failed on {}:\n{}{}",
                unit.display(),
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
    }
}

/// The nvcc to run.
fn nvcc() -> PathBuf {
    if let Some(path) = std::env::var_os("NVCC") {
        return PathBuf::from(path);
    }
    for root in ["CUDA_ROOT", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(root) {
            let candidate = Path::new(&root).join("bin").join("nvcc");
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    PathBuf::from("nvcc")
}

/// The compute capability to compile for, as digits (`90`).
fn compute_cap() -> String {
    if let Ok(cap) = std::env::var("CUDA_COMPUTE_CAP") {
        let digits: String = cap.chars().filter(char::is_ascii_digit).collect();
        if digits.is_empty() {
            panic!("fused-kernels: CUDA_COMPUTE_CAP = {cap:?} is not a compute capability like 90");
        }
        return digits;
    }
    let queried = Command::new("nvidia-smi")
        .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(|l| l.chars().filter(char::is_ascii_digit).collect::<String>())
        })
        .filter(|digits| !digits.is_empty());
    queried.unwrap_or_else(|| {
        panic!(
            "fused-kernels: set CUDA_COMPUTE_CAP to the GPU's compute capability (e.g. 90 for \
             H100/H200, 80 for A100): nvidia-smi could not report one"
        )
    })
}
