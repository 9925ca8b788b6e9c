//! Side-by-side throughput of the MLP workload, one process, CPU:
//! 1. a plain candle loop with candle-nn's AdamW, batch B;
//! 2. the Accelerator loop with our AdamW, K = 1, batch B;
//! 3. the Accelerator loop with our AdamW, K = 4, batch B/4 (the same samples per optimizer step);
//! 4. a hand-written candle loop doing what 3 does without the runtime: K = 4 backward passes of
//!    B/4, gradients summed with tensor ops, then our AdamW — the cost of the smaller batches alone;
//! 5. the same hand-written loop at K = 1, batch B: what 2 does without the runtime (its overhead).
//!
//! The configurations run in interleaved rounds (in reverse order every other round) so that
//! machine noise hits all of them alike; the median round is reported, and for the runtime's
//! overhead (2 against 5) also the spread of the per-round ratios. `cargo run --release --bin bench_mlp`.

use std::sync::Arc;
use std::time::Instant;

use accelerate_benchmarks::{median, Overhead};
use accelerate_core::data::{DataLoader, TensorDataset};
use accelerate_core::optim::{AdamW, AdamWConfig};
use accelerate_core::{Accelerator, ProcessState};
use accelerate_examples::mlp;
use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_nn::Optimizer as _;
use clap::Parser;

/// Benchmark the MLP training step.
#[derive(Debug, Parser)]
struct Args {
    /// Samples per optimizer step.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Hidden width.
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// Optimizer steps measured per configuration per round.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Rounds (each runs every configuration once).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Prefetch depth of the Accelerator loops' data loader (0 builds batches inline).
    #[arg(long, default_value_t = 2)]
    prefetch: usize,
    /// Run only these configurations (1-5, comma-separated), e.g. `--only 2,5` for the
    /// runtime's overhead alone, or one under a profiler.
    #[arg(long, value_delimiter = ',')]
    only: Option<Vec<usize>>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    // Every configuration runs with the same allocator settings (the Accelerator applies them
    // when it is built; the plain loops must not be measured with glibc's defaults instead).
    accelerate_core::keep_freed_memory();
    let samples = args.batch_size * (args.steps + 2);
    let (x, y) = mlp::synthetic_data(samples, 0)?;
    let dataset = Arc::new(TensorDataset::new(x.clone(), y.clone())?);
    let names = [
        "plain candle loop, candle-nn AdamW, K=1".to_string(),
        "Accelerator, our AdamW, K=1".to_string(),
        format!(
            "Accelerator, our AdamW, K=4 (batch {})",
            args.batch_size / 4
        ),
        format!(
            "plain candle loop, our AdamW, K=4 by hand (batch {})",
            args.batch_size / 4
        ),
        "plain candle loop, our AdamW, K=1".to_string(),
    ];
    let mut results: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    let selected: Vec<usize> = match &args.only {
        Some(only) => only.iter().map(|&c| c - 1).collect(),
        None => (0..names.len()).collect(),
    };
    if let Some(bad) = selected.iter().find(|&&c| c >= names.len()) {
        anyhow::bail!(
            "--only {}: configurations are numbered 1 to {}",
            bad + 1,
            names.len()
        );
    }
    for round in 0..args.rounds {
        // Every other round runs the configurations in reverse order, so that none of them
        // always follows the same one (caches, allocator and CPU frequency carry over).
        let mut order = selected.clone();
        if round % 2 == 1 {
            order.reverse();
        }
        for &config in &order {
            let ms = match config {
                0 => plain_candle(&args, &x, &y)?,
                1 => accelerated(&args, &dataset, 1)?,
                2 => accelerated(&args, &dataset, 4)?,
                3 => hand_accumulated(&args, &x, &y, 4)?,
                _ => hand_accumulated(&args, &x, &y, 1)?,
            };
            results[config].push(ms);
        }
        eprintln!("round {} of {} done", round + 1, args.rounds);
    }
    println!(
        "MLP 784-{h}-{h}-10, {} samples per optimizer step, {} steps x {} rounds, {} threads, \
         loader prefetch {}",
        args.batch_size,
        args.steps,
        args.rounds,
        candle_core::utils::get_num_threads(),
        args.prefetch,
        h = args.hidden
    );
    println!(
        "{:<48} {:>12} {:>12} {:>8}",
        "configuration", "ms/step", "samples/s", "ratio"
    );
    // Ratios are to the plain candle-nn loop (NaN when it did not run).
    let base = median(&results[0]);
    for (name, r) in names.iter().zip(&results) {
        if r.is_empty() {
            continue;
        }
        let ms = median(r);
        println!(
            "{name:<48} {ms:>12.2} {:>12.0} {:>8.2}",
            args.batch_size as f64 / ms * 1e3,
            base / ms
        );
    }
    // The runtime's own cost: the same arithmetic and optimizer with and without the
    // Accelerator. Each round's pair ran back to back, so the per-round ratio cancels the slow
    // drift of this machine; its spread says how far the figure can be trusted.
    if !results[1].is_empty() && !results[4].is_empty() {
        println!(
            "runtime overhead at K=1 (Accelerator vs plain loop, both our AdamW): {}",
            Overhead::new(&results[1], &results[4])
        );
    }
    Ok(())
}

/// Runs `run(0)` and `run(1)` as warm-up, then `steps` timed steps; milliseconds per step.
fn time_steps(steps: usize, mut run: impl FnMut(usize) -> Result<()>) -> Result<f64> {
    run(0)?;
    run(1)?;
    let start = Instant::now();
    for i in 2..steps + 2 {
        run(i)?;
    }
    Ok(start.elapsed().as_secs_f64() * 1e3 / steps as f64)
}

/// Milliseconds per optimizer step of a plain candle loop.
fn plain_candle(args: &Args, x: &Tensor, y: &Tensor) -> Result<f64> {
    let (varmap, model) = mlp::build(args.hidden, 0, &Device::Cpu)?;
    let mut opt = candle_nn::AdamW::new(
        varmap.all_vars(),
        candle_nn::ParamsAdamW {
            lr: 1e-3,
            ..Default::default()
        },
    )?;
    let b = args.batch_size;
    let run = |i: usize| -> Result<()> {
        let xb = x.narrow(0, i * b, b)?;
        let yb = y.narrow(0, i * b, b)?;
        let loss = candle_nn::loss::cross_entropy(&model.forward(&xb)?, &yb)?;
        opt.backward_step(&loss)?;
        Ok(())
    };
    time_steps(args.steps, run)
}

/// Milliseconds per optimizer step of a hand-written accumulation loop: K backward passes, the
/// gradients summed with candle ops, our AdamW applied to the sum.
fn hand_accumulated(args: &Args, x: &Tensor, y: &Tensor, k: usize) -> Result<f64> {
    use accelerate_core::optim::Optimizer;
    use accelerate_core::GradientBuffers;
    let (varmap, model) = mlp::build(args.hidden, 0, &Device::Cpu)?;
    let mut params: Vec<(String, candle_core::Var)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    params.sort_by(|a, b| a.0.cmp(&b.0));
    let mut opt = AdamW::new(params.clone(), AdamWConfig::default())?;
    let b = args.batch_size / k;
    // Allocated once, like the Accelerator's buckets, so the baseline does not pay for it per step.
    let mut buffers = GradientBuffers::new(&params, usize::MAX)?;
    let run = |i: usize| -> Result<()> {
        let mut sums: Vec<Option<Tensor>> = vec![None; params.len()];
        for j in 0..k {
            let xb = x.narrow(0, (i * k + j) * b, b)?;
            let yb = y.narrow(0, (i * k + j) * b, b)?;
            let loss = (candle_nn::loss::cross_entropy(&model.forward(&xb)?, &yb)? / k as f64)?;
            let grads = loss.backward()?;
            for ((_, var), sum) in params.iter().zip(sums.iter_mut()) {
                let g = grads
                    .get(var.as_tensor())
                    .expect("every parameter has a gradient");
                *sum = Some(match sum.take() {
                    None => g.clone(),
                    Some(s) => (s + g)?,
                });
            }
        }
        buffers.zero();
        for ((name, _), sum) in params.iter().zip(&sums) {
            buffers.accumulate_one(name, sum.as_ref().expect("summed"), 1.0)?;
        }
        opt.step(buffers.gradients())?;
        Ok(())
    };
    time_steps(args.steps, run)
}

/// Milliseconds per optimizer step of the Accelerator loop with K micro-batches of batch/K.
fn accelerated(args: &Args, dataset: &Arc<TensorDataset>, k: usize) -> Result<f64> {
    let mut acc = Accelerator::builder()
        .gradient_accumulation_steps(k)
        .process_state(ProcessState::single())
        .build()?;
    let (varmap, model) = mlp::build(args.hidden, 0, acc.device())?;
    let params = acc.prepare(&varmap)?;
    let mut opt = acc.prepare(AdamW::new(params, AdamWConfig::default())?)?;
    let loader = DataLoader::new(dataset.clone(), args.batch_size / k).prefetch(args.prefetch);
    let mut loader = acc.prepare(loader)?;
    let mut start = Instant::now();
    for batch in loader.iter() {
        let (x, y) = batch?;
        let _step = acc.accumulate();
        let loss = candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
        acc.backward(&loss)?;
        opt.step()?;
        opt.zero_grad();
        if acc.sync_gradients() && acc.optimizer_steps() == 2 {
            // Two warm-up steps, as for the plain loop.
            start = Instant::now();
        }
    }
    let measured = acc.optimizer_steps() - 2;
    Ok(start.elapsed().as_secs_f64() * 1e3 / measured as f64)
}
