//! Peak memory and time of one training step (forward and backward) through a deep stack of
//! pre-norm transformer blocks, with and without [`fused_kernels::checkpoint`].
//!
//! `cargo run --release -p fused-kernels --example checkpoint_memory [layers batch context width]`
//! runs each mode in a child process of its own (the peak resident set, `VmHWM` in
//! `/proc/self/status`, is per process: Linux only) and prints one line per mode.

use std::process::Command;
use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var};
use fused_kernels::{causal_softmax, checkpoint::checkpoint, gelu, layer_norm, linear};

/// The shape of the run: layers, batch, context, width (the MLP is 4 × width wide).
#[derive(Clone, Copy)]
struct Shape {
    layers: usize,
    batch: usize,
    context: usize,
    width: usize,
}

/// One pre-norm block: one attention head and a GELU MLP.
#[derive(Clone)]
struct Block {
    norm: [(Tensor, Tensor); 2],
    qkv: [Tensor; 3],
    out: Tensor,
    up: Tensor,
    down: Tensor,
}

fn var(shape: &[usize], scale: f64) -> Result<Tensor> {
    let t = (Tensor::randn(0f32, 1f32, shape, &Device::Cpu)? * scale)?;
    Ok(Var::from_tensor(&t)?.as_tensor().clone())
}

impl Block {
    fn new(width: usize) -> Result<Self> {
        let norm = || -> Result<(Tensor, Tensor)> {
            let ones = Tensor::ones(width, DType::F32, &Device::Cpu)?;
            Ok((
                Var::from_tensor(&ones)?.as_tensor().clone(),
                var(&[width], 0.0)?,
            ))
        };
        let s = 1.0 / (width as f64).sqrt();
        Ok(Block {
            norm: [norm()?, norm()?],
            qkv: [
                var(&[width, width], s)?,
                var(&[width, width], s)?,
                var(&[width, width], s)?,
            ],
            out: var(&[width, width], s)?,
            up: var(&[4 * width, width], s)?,
            down: var(&[width, 4 * width], s / 2.0)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let width = x.dim(2)?;
        let h = layer_norm(x, &self.norm[0].0, &self.norm[0].1, 1e-5)?;
        let q = linear(&h, &self.qkv[0], None)?;
        let k = linear(&h, &self.qkv[1], None)?;
        let v = linear(&h, &self.qkv[2], None)?;
        let scores = q.matmul(&k.t()?.contiguous()?)?;
        let a = causal_softmax(&scores, 1.0 / (width as f64).sqrt())?.matmul(&v)?;
        let x = (x + linear(&a, &self.out, None)?)?;
        let h = layer_norm(&x, &self.norm[1].0, &self.norm[1].1, 1e-5)?;
        x + linear(&gelu(&linear(&h, &self.up, None)?)?, &self.down, None)?
    }
}

fn peak_resident_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kib| kib / 1024.0)
}

/// One forward and backward step in this process; prints the peak memory and the step time.
fn step(shape: Shape, checkpointed: bool) -> Result<()> {
    let blocks = (0..shape.layers)
        .map(|_| Block::new(shape.width))
        .collect::<Result<Vec<_>>>()?;
    let x = Tensor::randn(
        0f32,
        1f32,
        (shape.batch, shape.context, shape.width),
        &Device::Cpu,
    )?;
    let start = Instant::now();
    let mut h = x;
    for block in &blocks {
        h = if checkpointed {
            let b = block.clone();
            checkpoint(&h, move |x| b.forward(x))?
        } else {
            block.forward(&h)?
        };
    }
    let grads = h.sqr()?.mean_all()?.backward()?;
    let seconds = start.elapsed().as_secs_f64();
    assert!(grads.get(&blocks[0].qkv[0]).is_some());
    println!(
        "checkpointing={} layers={} batch={} context={} width={}: peak {:.0} MiB, step {:.2} s",
        if checkpointed { "on " } else { "off" },
        shape.layers,
        shape.batch,
        shape.context,
        shape.width,
        peak_resident_mib(),
        seconds
    );
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [mode, rest @ ..] = args.as_slice() {
        if mode == "--child-on" || mode == "--child-off" {
            let n: Vec<usize> = rest.iter().map(|a| a.parse().unwrap()).collect();
            let shape = Shape {
                layers: n[0],
                batch: n[1],
                context: n[2],
                width: n[3],
            };
            return step(shape, mode == "--child-on");
        }
    }
    let numbers: Vec<String> = match args.len() {
        0 => ["8", "8", "256", "256"].map(String::from).to_vec(),
        4 => args,
        _ => candle_core::bail!("usage: checkpoint_memory [layers batch context width]"),
    };
    let exe = std::env::current_exe()?;
    for mode in ["--child-off", "--child-on"] {
        let status = Command::new(&exe).arg(mode).args(&numbers).status()?;
        if !status.success() {
            candle_core::bail!("checkpoint_memory: the {mode} run failed ({status})");
        }
    }
    Ok(())
}
