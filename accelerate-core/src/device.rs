//! Which device a process computes on (see [`select_device`]).

use candle_core::Device;

use crate::env;
use crate::error::{Error, Result};
use crate::process::ProcessState;

/// The index of this process's GPU among the visible ones: `gpu_index` (the value of
/// [`env::GPU_INDEX`]) when given, else `local_rank`.
#[cfg(any(feature = "cuda", test))]
pub fn gpu_index(gpu_index: Option<&str>, local_rank: usize) -> Result<usize> {
    match gpu_index.map(str::trim) {
        None | Some("") => Ok(local_rank),
        Some(v) => v.parse::<usize>().map_err(|_| Error::Env {
            name: env::GPU_INDEX.into(),
            value: v.into(),
            problem: "expected the index of a visible GPU (0, 1, ...); accelerate-launch sets it, \
                      unset it to use LOCAL_RANK"
                .into(),
        }),
    }
}

/// What the environment asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Request {
    /// `ACCELERATE_USE_CPU=1`.
    Cpu,
    /// `ACCELERATE_DEVICE=cuda`.
    Gpu,
    /// Nothing said: a GPU if this build and machine have one, else the CPU.
    Auto,
}

fn request_from_env() -> Result<Request> {
    let cpu = env::read(env::USE_CPU, env::SWITCH_VALUES, env::switch)?.unwrap_or(false);
    let device = env::read(env::DEVICE, "expected cpu, cuda or auto", |v| match v {
        "cpu" => Some(Request::Cpu),
        "cuda" => Some(Request::Gpu),
        "auto" => Some(Request::Auto),
        _ => None,
    })?;
    match (cpu, device) {
        (true, Some(Request::Gpu)) => Err(Error::Env {
            name: env::DEVICE.into(),
            value: "cuda".into(),
            problem: format!(
                "{}=1 asks for the CPU at the same time; unset one",
                env::USE_CPU
            ),
        }),
        (true, _) => Ok(Request::Cpu),
        (false, request) => Ok(request.unwrap_or(Request::Auto)),
    }
}

/// The device for this process: its GPU in a `cuda` build on a machine with GPUs, otherwise the
/// CPU.
///
/// Which device a process computes on.
///
/// The GPU is chosen among those visible to the process, so `CUDA_VISIBLE_DEVICES` keeps its usual
/// meaning (the launcher does not rewrite it): [`env::GPU_INDEX`] when set (`accelerate-launch`
/// sets it, and under `--ranks-per-gpu N` it is `LOCAL_RANK / N`), else the local rank (torchrun,
/// SLURM, MPI: one process per GPU). Without a launcher a `cuda` build uses GPU 0. A machine without a GPU falls back to the CPU with a warning,
/// unless GPUs were asked for explicitly (`accelerate-launch --num-gpus`, which sets
/// [`env::DEVICE`] to `cuda`): then it is an error, since training on the CPU by surprise would be
/// slower by orders of magnitude.
pub fn select_device(state: &ProcessState) -> Result<Device> {
    let request = request_from_env()?;
    if request == Request::Cpu {
        return Ok(Device::Cpu);
    }
    select_gpu(state, request)
}

#[cfg(feature = "cuda")]
fn select_gpu(state: &ProcessState, request: Request) -> Result<Device> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "(unset)".into());
    let count = match CudaContext::device_count() {
        Ok(n) => n.max(0) as usize,
        Err(e) if request == Request::Gpu => {
            return Err(Error::Device(format!(
                "GPUs were requested but the CUDA driver reports none ({e}; \
                 CUDA_VISIBLE_DEVICES={visible}); check `nvidia-smi`, or launch with --cpu"
            )))
        }
        Err(_) => 0,
    };
    if count == 0 {
        return no_gpu(request, "this machine has no usable GPU");
    }
    let index = gpu_index(env::value(env::GPU_INDEX).as_deref(), state.local_rank)?;
    if index >= count {
        return Err(Error::Device(format!(
            "local rank {} needs GPU {index} but only {count} GPU(s) are visible \
             (CUDA_VISIBLE_DEVICES={visible}); start at most {count} processes per machine",
            state.local_rank
        )));
    }
    Ok(Device::new_cuda(index)?)
}

#[cfg(not(feature = "cuda"))]
fn select_gpu(_state: &ProcessState, request: Request) -> Result<Device> {
    no_gpu(
        request,
        "this program was built without the `cuda` feature (rebuild with `--features cuda` or \
         `--features nccl`)",
    )
}

/// The CPU with a warning, or an error when a GPU was required.
fn no_gpu(request: Request, why: &str) -> Result<Device> {
    if request == Request::Gpu {
        return Err(Error::Device(format!(
            "GPUs were requested ({}=cuda, set by `accelerate-launch --num-gpus`) but \
             {why}; launch with --cpu --num-processes N to train on the CPU",
            env::DEVICE
        )));
    }
    if gpu_present() {
        tracing::warn!("{why}: computing on the CPU");
        eprintln!("accelerate: warning: {why}; computing on the CPU");
    }
    Ok(Device::Cpu)
}

/// Whether the machine has an NVIDIA GPU at all (see [`physical_gpu_count`]), so that a build
/// without CUDA can tell (only worth a warning then).
pub fn gpu_present() -> bool {
    physical_gpu_count() > 0
}

/// The NVIDIA GPUs of this machine, whatever `CUDA_VISIBLE_DEVICES` says, counted without CUDA:
/// the driver lists them under `/proc/driver/nvidia/gpus` (or `nvidia-smi -L` where that is not
/// mounted). The launcher counts GPUs with it too, so it links no CUDA.
pub fn physical_gpu_count() -> usize {
    if let Ok(dir) = std::fs::read_dir("/proc/driver/nvidia/gpus") {
        return dir.count();
    }
    std::process::Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("GPU "))
                .count()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Environment variables are process-wide; tests that set them run one at a time.
    static ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn with_env<R>(cpu: Option<&str>, device: Option<&str>, f: impl FnOnce() -> R) -> R {
        let _guard = ENV.lock().unwrap_or_else(|e| e.into_inner());
        let set = |k: &str, v: Option<&str>| match v {
            Some(v) => std::env::set_var(k, v),
            None => std::env::remove_var(k),
        };
        set(env::USE_CPU, cpu);
        set(env::DEVICE, device);
        let r = f();
        set(env::USE_CPU, None);
        set(env::DEVICE, None);
        r
    }

    #[test]
    fn the_cpu_flag_wins_and_conflicts_are_errors() {
        let state = ProcessState::single();
        with_env(Some("1"), None, || {
            assert!(select_device(&state).unwrap().is_cpu());
        });
        let err = with_env(Some("1"), Some("cuda"), || {
            select_device(&state).unwrap_err()
        });
        assert!(err.to_string().contains("unset one"), "{err}");
        let err = with_env(Some("maybe"), None, || select_device(&state).unwrap_err());
        assert!(err.to_string().contains(env::USE_CPU), "{err}");
        let err = with_env(None, Some("tpu"), || select_device(&state).unwrap_err());
        assert!(err.to_string().contains("cpu, cuda or auto"), "{err}");
    }

    #[test]
    fn the_launchers_gpu_index_wins_over_the_local_rank() {
        assert_eq!(gpu_index(None, 3).unwrap(), 3);
        assert_eq!(gpu_index(Some(""), 3).unwrap(), 3);
        // Under --ranks-per-gpu 2, local rank 3 sits on GPU 1.
        assert_eq!(gpu_index(Some("1"), 3).unwrap(), 1);
        let e = gpu_index(Some("one"), 0).unwrap_err().to_string();
        assert!(e.contains(env::GPU_INDEX) && e.contains("one"), "{e}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_build_without_cuda_computes_on_the_cpu_unless_a_gpu_is_required() {
        let state = ProcessState::single();
        with_env(None, None, || {
            assert!(select_device(&state).unwrap().is_cpu());
        });
        let err = with_env(None, Some("cuda"), || select_device(&state).unwrap_err());
        let msg = err.to_string();
        assert!(
            msg.contains("--features cuda") && msg.contains("--cpu"),
            "{msg}"
        );
    }
}
