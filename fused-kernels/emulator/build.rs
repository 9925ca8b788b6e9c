//! Compiles every CUDA source of fused-kernels (`../src/cuda/*.cu`, whatever files are there) and
//! the emulator's own test kernels (`tests/cuda/*.cu`) with the system's C++ compiler (g++), as
//! C++17 with `-include cuda_emulator.h` and the shim headers of `cpp/shim` in place of CUDA's,
//! together with the emulator's runtime (`cpp/runtime/*.cc`), into one static library.
//!
//! The kernel registry is generated: each `.cu` is preprocessed with the same flags (plus
//! `FUSED_KERNELS_EMULATOR_SCAN`, under which `__global__` expands to a marker), and every
//! `extern "C"` function marked `__global__` after macro expansion is a kernel (most are
//! instantiated by macros such as `FOR_EACH_DTYPE`). For each `.cu` a translation unit includes
//! the file and then registers its kernels (`EMU_KERNEL_ENTRY`, which deduces each kernel's
//! parameter types from its function pointer); one more lists every file's table.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What `__global__` expands to while scanning (cpp/cuda_emulator.h).
const MARKER: &str = "__fused_kernels_emulator_kernel__";

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cpp = manifest.join("cpp");
    let kernel_dirs = [manifest.join("../src/cuda"), manifest.join("tests/cuda")];
    println!("cargo:rerun-if-changed=build.rs");
    // `FUSED_KERNELS_EMULATOR_CONTRACT=1`: contract multiply-adds as nvcc does (below).
    println!("cargo:rerun-if-env-changed=FUSED_KERNELS_EMULATOR_CONTRACT");
    let contract =
        std::env::var("FUSED_KERNELS_EMULATOR_CONTRACT").is_ok_and(|v| !v.is_empty() && v != "0");
    println!("cargo:rerun-if-changed=cpp");
    for dir in &kernel_dirs {
        // A directory: cargo reruns when any file in it changes, is added or removed.
        println!("cargo:rerun-if-changed={}", dir.display());
    }

    let mut sources: Vec<PathBuf> = Vec::new();
    for dir in &kernel_dirs {
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| {
            panic!("fused-kernels-emulator: cannot list {}: {e}", dir.display())
        });
        let mut found: Vec<PathBuf> = entries
            .map(|e| e.expect("a directory entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "cu"))
            .collect();
        found.sort();
        sources.extend(found);
    }

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .opt_level(2)
        .define("FUSED_KERNELS_EMULATOR", None)
        .flag("-include")
        .flag(cpp.join("cuda_emulator.h").to_str().expect("a UTF-8 path"))
        .include(cpp.join("shim"))
        .include(&cpp)
        // fused-kernels' own headers (common.cuh), for the emulator's test kernels too.
        .include(manifest.join("../src/cuda"))
        // Type punning through pointers (vector loads) is common in CUDA C and nvcc allows it.
        .flag_if_supported("-fno-strict-aliasing")
        // `#pragma unroll` is nvcc's.
        .flag_if_supported("-Wno-unknown-pragmas")
        .flag_if_supported("-Wno-unused-parameter");
    if contract {
        // As nvcc does by default (`--fmad=true`): `a * b + c` becomes one multiply-add, also
        // across statements, so that a kernel whose result depends on it shows here.
        build
            .define("FUSED_KERNELS_EMULATOR_CONTRACT", None)
            .flag("-ffp-contract=fast");
        if std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64") {
            build.flag("-mfma");
        }
    } else {
        // No fused multiply-adds the CPU reference does not make (g++ contracts by default on
        // targets with FMA, e.g. aarch64): results then differ from the CPU only by order.
        build.flag_if_supported("-ffp-contract=off");
    }
    let compiler = build.get_compiler();

    let mut owner: BTreeMap<String, PathBuf> = BTreeMap::new();
    let mut tables = Vec::new();
    for (i, unit) in sources.iter().enumerate() {
        let kernels = scan(&compiler, &cpp, unit);
        for k in &kernels {
            if let Some(other) = owner.insert(k.clone(), unit.clone()) {
                panic!(
                    "fused-kernels-emulator: kernel `{k}` is defined in both {} and {}: the emulator \
                     links every .cu into one library, so kernel names must be unique across files",
                    other.display(),
                    unit.display()
                );
            }
        }
        let wrapper = out_dir.join(format!("emu_unit_{i}.cc"));
        write_if_changed(&wrapper, &unit_source(i, unit, &kernels));
        build.file(&wrapper);
        tables.push(format!("fk_emu_table_{i}"));
    }
    let registry = out_dir.join("emu_registry.cc");
    write_if_changed(&registry, &registry_source(&tables));
    build.file(&registry);
    let mut runtime: Vec<PathBuf> = std::fs::read_dir(cpp.join("runtime"))
        .expect("cpp/runtime")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cc"))
        .collect();
    runtime.sort();
    build.files(runtime);
    build.compile("fused_kernels_emulator");
}

/// The `extern "C"` kernels of `unit`, found in its preprocessed text.
fn scan(compiler: &cc::Tool, cpp: &Path, unit: &Path) -> Vec<String> {
    let output = Command::new(compiler.path())
        .args(["-E", "-P", "-x", "c++", "-std=c++17"])
        .args(["-DFUSED_KERNELS_EMULATOR", "-DFUSED_KERNELS_EMULATOR_SCAN"])
        .arg("-include")
        .arg(cpp.join("cuda_emulator.h"))
        .arg("-I")
        .arg(cpp.join("shim"))
        .arg("-I")
        .arg(cpp.parent().expect("the crate").join("../src/cuda"))
        .arg(unit)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "fused-kernels-emulator: cannot run the C++ compiler {} (install g++, or name a \
                 C++17 compiler in CXX): {e}",
                compiler.path().display()
            )
        });
    if !output.status.success() {
        panic!(
            "fused-kernels-emulator: preprocessing {} failed:\n{}",
            unit.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    kernels_in(&String::from_utf8_lossy(&output.stdout))
}

/// A token of preprocessed C++: what the scan needs to tell apart.
#[derive(Debug, PartialEq)]
enum Token<'a> {
    Word(&'a str),
    Str(&'a str),
    Punct(char),
}

/// Splits preprocessed C++ (no comments, no directives) into words, string literals and
/// punctuation; character literals and numbers become words.
fn tokens(text: &str) -> Vec<Token<'_>> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c == b'"' || c == b'\'' {
            let start = i;
            i += 1;
            while i < bytes.len() && bytes[i] != c {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(bytes.len());
            let lit = &text[start..i];
            out.push(if c == b'"' {
                Token::Str(lit)
            } else {
                Token::Word(lit)
            });
        } else if c.is_ascii_alphanumeric() || c == b'_' {
            let start = i;
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            out.push(Token::Word(&text[start..i]));
        } else {
            out.push(Token::Punct(c as char));
            i += 1;
        }
    }
    out
}

/// The names of the functions marked with [`MARKER`] that have C language linkage: declared
/// right after `extern "C"` or inside an `extern "C" { ... }` block.
fn kernels_in(text: &str) -> Vec<String> {
    let toks = tokens(text);
    let mut names: Vec<String> = Vec::new();
    // For each open brace: whether it opened an `extern "C"` block.
    let mut braces: Vec<bool> = Vec::new();
    for (i, t) in toks.iter().enumerate() {
        match t {
            Token::Punct('{') => {
                let extern_c = i >= 2
                    && toks[i - 2] == Token::Word("extern")
                    && toks[i - 1] == Token::Str("\"C\"");
                braces.push(extern_c);
            }
            Token::Punct('}') => {
                braces.pop();
            }
            Token::Word(w) if *w == MARKER => {
                let linkage_c = braces.iter().any(|&c| c)
                    || (i >= 2
                        && toks[i - 2] == Token::Word("extern")
                        && toks[i - 1] == Token::Str("\"C\""));
                if !linkage_c {
                    continue;
                }
                // The name is the word right before the first `(` after the marker.
                let mut name = None;
                for j in i + 1..toks.len() {
                    match toks[j] {
                        Token::Punct('(') => {
                            if let Token::Word(n) = toks[j - 1] {
                                name = Some(n.to_string());
                            }
                            break;
                        }
                        Token::Punct(';' | '{' | '}') => break,
                        _ => {}
                    }
                }
                if let Some(n) = name {
                    if !names.contains(&n) {
                        names.push(n);
                    }
                }
            }
            _ => {}
        }
    }
    names
}

/// The translation unit of `.cu` number `i`: the file itself, then its kernel table.
fn unit_source(i: usize, unit: &Path, kernels: &[String]) -> String {
    let path = unit
        .canonicalize()
        .unwrap_or_else(|_| unit.to_path_buf())
        .display()
        .to_string()
        .replace('\\', "\\\\")
        .replace('"', "\\\"");
    let mut s = format!(
        "// Generated by fused-kernels-emulator's build.rs: {path} and its kernels.\n\
         #include \"{path}\"\n#include \"emu/registration.h\"\n"
    );
    if kernels.is_empty() {
        let _ = writeln!(
            s,
            "extern \"C\" const ::emu::KernelTable fk_emu_table_{i} = {{\"{path}\", nullptr, 0}};"
        );
    } else {
        let _ = writeln!(
            s,
            "static const ::emu::KernelEntry fk_emu_entries_{i}[] = {{"
        );
        for k in kernels {
            let _ = writeln!(s, "    EMU_KERNEL_ENTRY({k}),");
        }
        let _ = writeln!(
            s,
            "}};\nextern \"C\" const ::emu::KernelTable fk_emu_table_{i} = {{\"{path}\", \
             fk_emu_entries_{i}, {}}};",
            kernels.len()
        );
    }
    s
}

/// The list of every file's table.
fn registry_source(tables: &[String]) -> String {
    let mut s = String::from(
        "// Generated by fused-kernels-emulator's build.rs: the kernel tables of every .cu.\n\
         #include \"emu/abi.h\"\n",
    );
    for t in tables {
        let _ = writeln!(s, "extern \"C\" const ::emu::KernelTable {t};");
    }
    s.push_str("extern \"C\" const ::emu::KernelTable* const fk_emu_tables[] = {\n");
    for t in tables {
        let _ = writeln!(s, "    &{t},");
    }
    s.push_str("    nullptr,\n};\n");
    let _ = writeln!(
        s,
        "extern \"C\" const std::size_t fk_emu_table_count = {};",
        tables.len()
    );
    s
}

/// Writes `text` to `path` unless it already holds it (keeps the file's time for cc's caching).
fn write_if_changed(path: &Path, text: &str) {
    if std::fs::read_to_string(path).is_ok_and(|old| old == text) {
        return;
    }
    std::fs::write(path, text).unwrap_or_else(|e| {
        panic!(
            "fused-kernels-emulator: cannot write {}: {e}",
            path.display()
        )
    });
}
