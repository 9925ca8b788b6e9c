//! The first of the three levels of the same training job (docs/src/accumulation.md): the `mlp`
//! workload in plain candle, one process, gradient accumulation by hand. `mlp --no-shuffle` is
//! the same job through the Accelerator loop, `trainer` through the Trainer.
//!
//! `cargo run --release --example plain_candle -- --grad-accum 4 --save-model plain.safetensors`

use std::path::PathBuf;

use accelerate_examples::mlp;
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::Device;
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use clap::Parser;

/// Train the MLP on the seeded synthetic task with candle alone (no runtime, no shuffle).
#[derive(Debug, Parser)]
struct Args {
    /// Samples per micro-batch.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 4)]
    grad_accum: usize,
    /// Width of the two hidden layers.
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// Samples in the synthetic dataset.
    #[arg(long, default_value_t = 16384)]
    samples: usize,
    /// Passes over the data.
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Seed of the data and the initial weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write the trained weights here (safetensors).
    #[arg(long)]
    save_model: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.batch_size == 0 || args.grad_accum == 0 {
        bail!("--batch-size and --grad-accum must be at least 1");
    }
    let (x, y) = mlp::synthetic_data(args.samples, args.seed)?;
    let (varmap, model) = mlp::build(args.hidden, args.seed, &Device::Cpu)?;
    let params = ParamsAdamW {
        lr: 1e-3,
        weight_decay: 0.0,
        ..ParamsAdamW::default()
    };
    let mut opt = AdamW::new(varmap.all_vars(), params)?;
    let batches = args.samples.div_ceil(args.batch_size);
    let mut loss_sum = 0.0;
    for _epoch in 0..args.epochs {
        let mut grads: Option<GradStore> = None;
        for b in 0..batches {
            let start = b * args.batch_size;
            let len = args.batch_size.min(args.samples - start);
            // A window's loss is divided by its true length (the last one may be shorter).
            let window_start = b - b % args.grad_accum;
            let window = args.grad_accum.min(batches - window_start);
            let logits = model.forward(&x.narrow(0, start, len)?)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y.narrow(0, start, len)?)?;
            loss_sum += loss.to_scalar::<f32>()? as f64 / window as f64;
            let step_grads = (loss / window as f64)?.backward()?;
            grads = Some(match grads.take() {
                None => step_grads,
                Some(mut sum) => {
                    for var in varmap.all_vars() {
                        let (old, new) = (sum.remove(&var), step_grads.get(&var));
                        if let (Some(old), Some(new)) = (old, new) {
                            sum.insert(&var, (old + new)?);
                        }
                    }
                    sum
                }
            });
            if b + 1 == window_start + window {
                opt.step(&grads.take().expect("a window has a micro-batch"))?;
                println!("step loss={loss_sum:.6}");
                loss_sum = 0.0;
            }
        }
    }
    if let Some(path) = &args.save_model {
        varmap.save(path)?;
    }
    Ok(())
}
