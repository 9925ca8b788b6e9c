//! `accelerate test`: a built-in 2-process job on the configured setup (the CPU, or GPUs), whose
//! trained parameters are checked against the same training in one process. It launches this very
//! binary (`accelerate test-worker`) through the launcher, as a training program would be.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

use crate::cli::Args;
use crate::commands::launch::{config_for, DefaultConfig};
use crate::commands::test_worker::{EPOCHS, K};
use crate::commands::TEST_WORKER;
use crate::config::merge;

/// Parameters may differ by float rounding only (different summation orders): the model is f32.
pub const TOLERANCE: f32 = 1e-5;

/// `accelerate test [--config-file F]`.
#[derive(Debug, Clone, Parser)]
pub struct TestArgs {
    /// The config file whose setup to test (default: $HF_HOME/accelerate/default_config.yaml;
    /// with none, 2 CPU processes).
    #[arg(long, alias = "config_file", value_name = "FILE")]
    pub config_file: Option<PathBuf>,
}

/// Runs `accelerate test`: 0 and a PASS line, 1 and a FAIL line, 2 for a bad config file.
pub fn run(args: TestArgs) -> ExitCode {
    match test(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(msg) => {
            eprintln!("accelerate test: error: {msg}");
            ExitCode::from(2)
        }
    }
}

fn test(args: TestArgs) -> Result<bool, String> {
    let exe = std::env::current_exe()
        .map_err(|e| format!("cannot find this program's own path to launch it: {e}"))?;
    let dir = tempfile_dir()?;
    let mut launch = Args::try_parse_from([
        OsStr::new("accelerate test"),
        exe.as_os_str(),
        OsStr::new(TEST_WORKER),
        OsStr::new("--result-dir"),
        dir.path.as_os_str(),
    ])
    .map_err(|e| e.to_string())?;
    let mut notes = Vec::new();
    let config_given = match config_for(args.config_file, DefaultConfig::Read, "accelerate test")? {
        Some(file) => {
            merge::apply(&file, &mut launch, &|_| false);
            if let Some(ids) = &file.gpu_ids {
                // Single-threaded here: nothing has started yet.
                std::env::set_var("CUDA_VISIBLE_DEVICES", ids);
            }
            true
        }
        None => false,
    };
    // This machine only, 2 processes, f32 (an exact comparison), a free port.
    launch.num_machines = 1;
    launch.machine_rank = 0;
    launch.main_process_ip = None;
    launch.main_process_port = 0;
    launch.max_restarts = 0;
    launch.gradient_accumulation_steps = None;
    if launch.mixed_precision.take().is_some() {
        notes.push("mixed precision off (an exact comparison needs f32)".to_string());
    }
    let gpus = crate::gpus::visible_gpu_count();
    match choose_setup(config_given, launch.cpu, gpus, Build::this()) {
        Setup::Cpu { why } => {
            launch.cpu = true;
            launch.num_gpus = None;
            launch.num_processes = Some(2);
            if let Some(why) = why {
                eprintln!("accelerate test: testing the CPU: {why}");
                notes.push(format!("on the CPU: {why}"));
            }
        }
        Setup::Gpus {
            num_gpus,
            ranks_per_gpu,
        } => {
            launch.cpu = false;
            launch.num_processes = None;
            launch.num_gpus = Some(num_gpus);
            launch.ranks_per_gpu = ranks_per_gpu;
            if ranks_per_gpu > 1 {
                // The launcher's testing switch: two ranks on one GPU, each its own NCCL host.
                notes.push("2 ranks on the one GPU".to_string());
            }
        }
    }
    let status = crate::run(launch);
    let mut deltas = Vec::new();
    let mut seen = None;
    for rank in 0..2 {
        let path = dir.path.join(format!("rank{rank}"));
        let Ok(text) = std::fs::read_to_string(&path) else {
            println!(
                "accelerate test: FAIL — rank {rank} reported no result (the launcher ended with \
                 {status:?}; its output is above)"
            );
            return Ok(false);
        };
        let mut fields = text.split_whitespace();
        let delta: f32 = fields
            .next()
            .and_then(|d| d.parse().ok())
            .unwrap_or(f32::NAN);
        let device = fields.next().unwrap_or("?").to_string();
        deltas.push(delta);
        seen = Some(device);
    }
    let device = seen.unwrap_or_default();
    let notes = if notes.is_empty() {
        String::new()
    } else {
        format!(" ({})", notes.join("; "))
    };
    // A NaN fails (it compares false), and is shown.
    let pass = deltas.iter().all(|d| *d <= TOLERANCE);
    let worst = deltas.iter().copied().fold(0f32, |w, d| {
        if d.is_nan() || w.is_nan() {
            f32::NAN
        } else {
            w.max(d)
        }
    });
    println!(
        "accelerate test: {} — 2 processes on {device}, K={K}, {EPOCHS} epochs, max |Δ| = \
         {worst:.1e} against one process (tolerance {TOLERANCE:.0e}){notes}",
        if pass { "PASS" } else { "FAIL" }
    );
    Ok(pass)
}

/// What this build of `accelerate` can run on GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Build {
    /// candle's CUDA backend (the `cuda` feature).
    pub cuda: bool,
    /// NCCL collectives (the `nccl` feature), which two GPU ranks need to talk.
    pub nccl: bool,
}

impl Build {
    /// This build.
    pub fn this() -> Self {
        Self {
            cuda: cfg!(feature = "cuda"),
            nccl: cfg!(feature = "nccl"),
        }
    }
}

/// Where `accelerate test` runs its 2 ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Setup {
    /// On the CPU; `why`, where GPUs were there to test.
    Cpu {
        /// Why not on the visible GPUs.
        why: Option<String>,
    },
    /// On `num_gpus` GPUs, `ranks_per_gpu` ranks on each.
    Gpus {
        /// GPUs used.
        num_gpus: usize,
        /// Ranks on each.
        ranks_per_gpu: usize,
    },
}

/// Chooses where to test: `config_given` says whether a config file was read, `cpu_asked`
/// whether it (or the flags) asked for the CPU, `gpus` how many GPUs are visible, `build` what
/// this program can run.
pub fn choose_setup(config_given: bool, cpu_asked: bool, gpus: usize, build: Build) -> Setup {
    // Without a config file Accelerate's test runs on the GPUs it sees; so does ours.
    if (config_given && cpu_asked) || gpus == 0 {
        return Setup::Cpu { why: None };
    }
    let seen = match gpus {
        1 => "1 GPU is visible".to_string(),
        n => format!("{n} GPUs are visible"),
    };
    let missing = match (build.cuda, build.nccl) {
        (false, _) => Some("no cuda feature (candle's GPU backend)"),
        (true, false) => Some("no nccl feature (the collectives between GPU ranks)"),
        (true, true) => None,
    };
    if let Some(missing) = missing {
        return Setup::Cpu {
            why: Some(format!(
                "{seen}, but this build of accelerate has {missing}; install it with \
                 `--features nccl` to test the GPUs"
            )),
        };
    }
    if gpus == 1 {
        // The launcher's testing switch: two ranks on the one GPU, each its own NCCL host.
        Setup::Gpus {
            num_gpus: 1,
            ranks_per_gpu: 2,
        }
    } else {
        Setup::Gpus {
            num_gpus: 2,
            ranks_per_gpu: 1,
        }
    }
}

/// A private temporary directory, removed on drop.
struct TempDir {
    path: PathBuf,
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

fn tempfile_dir() -> Result<TempDir, String> {
    use std::os::unix::fs::DirBuilderExt;
    let base = std::env::temp_dir();
    for attempt in 0..100u32 {
        let path = base.join(format!("accelerate-test-{}-{attempt}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&path) {
            Ok(()) => return Ok(TempDir { path }),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(format!(
                    "cannot create a directory in {} for the results ({e}); set TMPDIR to a \
                     writable directory",
                    base.display()
                ))
            }
        }
    }
    Err(format!(
        "cannot create a fresh directory in {}",
        base.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: Build = Build {
        cuda: true,
        nccl: true,
    };

    #[test]
    fn visible_gpus_are_tested_with_nccl_as_accelerate_does() {
        // No config file: Accelerate's test then runs on the GPUs it sees.
        assert_eq!(
            choose_setup(false, false, 1, FULL),
            Setup::Gpus {
                num_gpus: 1,
                ranks_per_gpu: 2
            }
        );
        assert_eq!(
            choose_setup(false, false, 8, FULL),
            Setup::Gpus {
                num_gpus: 2,
                ranks_per_gpu: 1
            }
        );
        // A config file for GPUs likewise.
        assert_eq!(
            choose_setup(true, false, 2, FULL),
            Setup::Gpus {
                num_gpus: 2,
                ranks_per_gpu: 1
            }
        );
    }

    #[test]
    fn the_cpu_is_tested_where_asked_or_where_there_is_no_gpu_without_a_reason_to_give() {
        assert_eq!(choose_setup(true, true, 4, FULL), Setup::Cpu { why: None });
        assert_eq!(
            choose_setup(false, false, 0, FULL),
            Setup::Cpu { why: None }
        );
    }

    #[test]
    fn a_build_that_cannot_test_the_visible_gpus_says_so_and_why() {
        for (build, needs) in [
            (
                Build {
                    cuda: false,
                    nccl: false,
                },
                "no cuda feature",
            ),
            (
                Build {
                    cuda: true,
                    nccl: false,
                },
                "no nccl feature",
            ),
        ] {
            let Setup::Cpu { why: Some(why) } = choose_setup(false, false, 1, build) else {
                panic!("{build:?}: not the CPU with a reason")
            };
            assert!(
                why.contains("1 GPU") && why.contains(needs) && why.contains("--features nccl"),
                "{build:?}: {why}"
            );
        }
    }
}
