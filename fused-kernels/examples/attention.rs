//! Time of causal self-attention's forward and backward pass on the CPU: the `gpt` example's
//! current path (q, k, v copied out of the packed projection, `q kᵀ`, [`causal_softmax`],
//! `p v`, a transposed copy back, candle's backward through all of it) against
//! [`flash_attention`] on `narrow` views of the packed projection, on one thread and on two.
//!
//! `cargo run --release -p fused-kernels --example attention [repeats [path]]` prints one line per
//! configuration, path and thread count: the median wall time of `repeats` (default 3) steps,
//! each the forward pass, `Σ y ∘ r`, and the backward pass to the packed projection, and the
//! median CPU time of the process over a step (all threads; Linux, from `/proc/self/stat`), which
//! stays meaningful on a machine shared with other work. A `path` (`matmul+softmax` or
//! `flash_attention`) runs that path alone, for a profiler.
//!
//! `... --features cuda --example attention cuda [repeats]` times both paths in bf16 on the first
//! GPU instead (GPT-2's attention shape and the small one), the device synchronized after each
//! step.

use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var};
use fused_kernels::{causal_softmax, flash_attention};

/// `y = attention(qkv)` `[B, T, H·D]` from the packed projection `[B, T, 3·H·D]`, as the `gpt`
/// example computes it.
fn current(qkv: &Tensor, (b, t, h, d): (usize, usize, usize, usize)) -> Result<Tensor> {
    let qkv = qkv.reshape((b, t, 3, h, d))?.permute((2, 0, 3, 1, 4))?;
    let q = qkv.get(0)?.contiguous()?;
    let k = qkv.get(1)?.contiguous()?;
    let v = qkv.get(2)?.contiguous()?;
    let att = causal_softmax(&q.matmul(&k.t()?)?, 1.0 / (d as f64).sqrt())?;
    att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, h * d))
}

/// The same with [`flash_attention`] reading the heads in place.
fn flash(qkv: &Tensor, (b, t, h, d): (usize, usize, usize, usize)) -> Result<Tensor> {
    let qkv = qkv.reshape((b, t, 3 * h, d))?;
    let (q, k, v) = (
        qkv.narrow(2, 0, h)?,
        qkv.narrow(2, h, h)?,
        qkv.narrow(2, 2 * h, h)?,
    );
    flash_attention(&q, &k, &v, 1.0 / (d as f64).sqrt())?.reshape((b, t, h * d))
}

type Path = fn(&Tensor, (usize, usize, usize, usize)) -> Result<Tensor>;

/// Seconds of CPU time the process has used (user and system, all threads), or NaN where
/// `/proc/self/stat` cannot be read.
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return f64::NAN;
    };
    // Fields after the command name (which is in parentheses and may hold spaces): utime and
    // stime are the 12th and 13th, in clock ticks of 1/100 s on Linux.
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return f64::NAN;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    match (
        f.get(11).map(|s| s.parse::<f64>()),
        f.get(12).map(|s| s.parse::<f64>()),
    ) {
        (Some(Ok(u)), Some(Ok(s))) => (u + s) / 100.0,
        _ => f64::NAN,
    }
}

/// Wall and CPU seconds of one forward and backward pass (the device synchronized at the end).
fn step(
    path: Path,
    qkv: &Var,
    r: &Tensor,
    dims: (usize, usize, usize, usize),
) -> Result<(f64, f64)> {
    let (start, cpu) = (Instant::now(), cpu_seconds());
    let y = path(qkv, dims)?;
    let grads = (y * r)?.sum_all()?.backward()?;
    // Touch the gradient so that nothing is left lazy.
    let g = grads.get(qkv).expect("a gradient of the projection");
    assert_eq!(g.dims(), qkv.dims());
    qkv.device().synchronize()?;
    Ok((start.elapsed().as_secs_f64(), cpu_seconds() - cpu))
}

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    x[x.len() / 2]
}

/// Both paths in bf16 on the first CUDA device.
fn on_cuda(repeats: usize) -> Result<()> {
    let dev = Device::new_cuda(0)?;
    println!("config (B, T, H, D)      path              bf16 on {dev:?}: wall fwd+bwd");
    for dims in [(8, 1024, 12, 64), (32, 256, 4, 64)] {
        let (b, t, h, d) = dims;
        let qkv = Tensor::randn(0f32, 1.0, (b, t, 3 * h * d), &dev)?.to_dtype(DType::BF16)?;
        let qkv = Var::from_tensor(&qkv)?;
        let r = Tensor::randn(0f32, 1.0, (b, t, h * d), &dev)?.to_dtype(DType::BF16)?;
        for (name, path) in [
            ("matmul+softmax", current as Path),
            ("flash_attention", flash),
        ] {
            step(path, &qkv, &r, dims)?; // warm-up (and the kernels' first load)
            let times = (0..repeats)
                .map(|_| step(path, &qkv, &r, dims).map(|t| t.0))
                .collect::<Result<Vec<f64>>>()?;
            println!(
                "{:<24} {name:<17} {:>9.2} ms",
                format!("{dims:?}"),
                median(times) * 1e3
            );
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let cuda = args.first().is_some_and(|a| a == "cuda");
    if cuda {
        args.remove(0);
    }
    let repeats: usize = args
        .first()
        .map(|s| s.parse().expect("repeats: a number"))
        .unwrap_or(3);
    if cuda {
        return on_cuda(repeats.max(1));
    }
    let only = args.get(1).cloned();
    println!("config (B, T, H, D)      path              threads  wall fwd+bwd   CPU fwd+bwd");
    for dims in [(32, 256, 4, 64), (8, 1024, 12, 64)] {
        let (b, t, h, d) = dims;
        let qkv = Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, t, 3 * h * d), &Device::Cpu)?)?;
        let r = Tensor::randn(0f32, 1.0, (b, t, h * d), &Device::Cpu)?;
        for threads in [1usize, 2] {
            // candle's matrix products size their thread count from RAYON_NUM_THREADS; the
            // kernels use the pool they run in.
            std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a thread pool");
            for (name, path) in [
                ("matmul+softmax", current as Path),
                ("flash_attention", flash),
            ] {
                if only.as_deref().is_some_and(|o| o != name) {
                    continue;
                }
                let times = pool.install(|| -> Result<Vec<(f64, f64)>> {
                    step(path, &qkv, &r, dims)?; // warm-up
                    (0..repeats).map(|_| step(path, &qkv, &r, dims)).collect()
                })?;
                let wall = median(times.iter().map(|t| t.0).collect());
                let cpu = median(times.iter().map(|t| t.1).collect());
                println!(
                    "{:<24} {name:<17} {threads:>7}  {:>9.1} ms  {:>9.0} ms",
                    format!("{dims:?}"),
                    wall * 1e3,
                    cpu * 1e3
                );
            }
        }
    }
    Ok(())
}
