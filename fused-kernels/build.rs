//! With the `cuda` feature, compiles every `src/cuda/*.cu` with nvcc into a fat binary in `OUT_DIR`
//! (`<file>.fatbin`), so that a type-check of the CUDA build (`cargo clippy --features cuda`) also
//! compiles the CUDA C and reports its errors. Without the feature it does nothing.
//!
//! Each fat binary holds machine code (cubin) for sm_80 (A100; also runs on the other 8.x GPUs) and
//! sm_90 (H100/H200), and for `$CUDA_COMPUTE_CAP` (e.g. 89, 120) when that is set to another
//! capability of 8.0 or newer, plus PTX for compute_80, which the driver compiles on a GPU that has
//! no machine code here (a newer architecture). Machine code loads without the driver's JIT, which
//! costs seconds per module on a machine's first launch. The tensor-core kernels need 8.0 or newer.
//!
//! nvcc is `$NVCC`, else `$CUDA_ROOT/bin/nvcc` or `$CUDA_PATH/bin/nvcc`, else `nvcc` on `PATH`.

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
    let arches = machine_code_arches();
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
        let fatbin = out_dir.join(format!("{stem}.fatbin"));
        let mut command = Command::new(&nvcc);
        command.args(["--fatbin", "-O3", "-std=c++17", "-lineinfo"]);
        for arch in &arches {
            command.arg(format!(
                "--generate-code=arch=compute_{arch},code=sm_{arch}"
            ));
        }
        command.arg(format!(
            "--generate-code=arch=compute_{PTX_ARCH},code=compute_{PTX_ARCH}"
        ));
        let output = command
            .arg("-I")
            .arg(sources)
            .arg("-o")
            .arg(&fatbin)
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

/// The architecture whose PTX is embedded for GPUs without machine code here.
const PTX_ARCH: u32 = 80;

/// The architectures to emit machine code for: 80 and 90, and `$CUDA_COMPUTE_CAP` when it names
/// another one of 8.0 or newer (candle-kernels reads the same variable for its PTX).
fn machine_code_arches() -> Vec<u32> {
    let mut arches = vec![80, 90];
    if let Ok(cap) = std::env::var("CUDA_COMPUTE_CAP") {
        let digits: String = cap.chars().filter(char::is_ascii_digit).collect();
        let arch: u32 = digits.parse().unwrap_or_else(|_| {
            panic!("fused-kernels: CUDA_COMPUTE_CAP = {cap:?} is not a compute capability like 90")
        });
        if arch < PTX_ARCH {
            // candle itself runs on older GPUs; these kernels then fail to load at their first
            // launch with the driver's "no kernel image" error, which names the module.
            println!(
                "cargo:warning=fused-kernels: CUDA_COMPUTE_CAP = {cap}: its kernels need compute \
                 capability 8.0 or newer (bf16 tensor cores); building for 80 and 90 only"
            );
        } else if !arches.contains(&arch) {
            arches.push(arch);
        }
    }
    arches
}
