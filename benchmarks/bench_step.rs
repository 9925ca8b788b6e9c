//! One training configuration at steady state: GPT-2 124M's or SmolLM-135M's shape trained through
//! the runtime (`Accelerator`: parameters and AdamW prepared, `accumulate`, `backward`, `step`),
//! on synthetic tokens, timed step by step. Its PyTorch counterpart is `benchmarks/torch_step.py`
//! (the same configurations, data and printed fields); `benchmarks/gpu/run.sh` runs both on a
//! GPU and tabulates them.
//!
//! Prints one JSON line (an object whose `"bench"` is `"step"`) and one readable line on the
//! main process:
//!
//! - step time: each step ends with the loss read back to the host (a device synchronization);
//!   the steps after `--warmup` are timed one by one; median and mean in ms;
//! - tokens/s over all ranks: `ranks · batch · context / mean step time`;
//! - model FLOPs utilization: `(6 · N + 12 · L · T · width) · tokens/s` over a peak measured at
//!   start on the same device (N: the parameters that multiply, every one but the input
//!   embedding tables; see `accelerate_benchmarks::mfu`); the peak is the rate of a large
//!   matrix product, bf16 on a GPU and f32 on the CPU, timed after warm-up;
//! - memory: on a GPU the largest device memory in use (the driver's total − free, polled every
//!   2 ms from just before the model is built to the end), on the CPU the peak resident set;
//! - the loss per predicted token of the main process's last step.
//!
//! Data: the SplitMix64 token stream of `--seed` (see `accelerate_benchmarks::synthetic`) cut
//! into rows of `context + 1` tokens; global batch `i` (rows `i·B .. (i+1)·B`) goes to rank
//! `i mod ranks`. GPT-2 reads the first `context` tokens of a row and predicts the next one at
//! each; SmolLM reads the whole row (`labels = input_ids`, as transformers' causal-LM loss) and
//! predicts its last `context` tokens. Every batch has the same shape.
//!
//! With `--profile-steps K`, K more steps follow the timed ones between `cuProfilerStart` and
//! `cuProfilerStop`, so that `ncu --profile-from-start off` records exactly those.
//!
//! `--zero-stage N` trains at ZeRO stage N (default: `ACCELERATE_ZERO_STAGE`, else 0; the JSON
//! line's `zero_stage` says which ran). GPT-2 computes through its units (`gpt::GptUnits`, the
//! `gpt` example's code) at every stage: at stages 0 to 2 a unit is a plain call on the prepared
//! parameters, at stage 3 it is gathered for each pass, so the stages differ in nothing else.
//! SmolLM runs at stages 0 to 2 only (its whole-model code path).
//!
//! `bench_step --model gpt2 --mixed-precision bf16` (a `--features cuda` or `nccl` build on a
//! GPU); `bench_step --device cpu --layers 4 --width 256 --heads 4 --context 256` on the CPU.

use std::sync::Arc;
use std::time::Instant;

use accelerate_benchmarks::gpu_probe::{self, MemoryWatch};
use accelerate_benchmarks::json_float::{float, floats, optional};
use accelerate_benchmarks::{median, mfu, peak_resident_kib, synthetic};
use accelerate_core::data::{DataLoader, Dataset};
use accelerate_core::optim::{AdamW, AdamWConfig};
use accelerate_core::{Accelerator, MixedPrecision, Model, PreparedOptimizer};
use accelerate_examples::gpt::{self, GptConfig, GptUnits, TextWindows};
use accelerate_examples::llama::{self, default_intermediate, LlamaConfig, TokenRows};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use clap::{Parser, ValueEnum};
use serde_json::{json, Value};

/// The model shapes benchmarked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ModelKind {
    /// GPT-2 124M: 12 layers, width 768, 12 heads, vocabulary 50257, learned positions, untied
    /// head (the `gpt` example's model).
    Gpt2,
    /// SmolLM-135M: 30 layers, hidden 576, 9 heads (3 key/value), MLP 1536, vocabulary 49152,
    /// untied head (the `llama` example's model).
    Smollm,
}

/// Where to compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DeviceKind {
    /// The process's GPU (GPU 0 alone; under `accelerate-launch` the one it assigns).
    Cuda,
    /// The CPU.
    Cpu,
}

/// Time the steady-state training step of GPT-2 124M's or SmolLM-135M's shape on synthetic
/// tokens, through the runtime.
#[derive(Debug, Parser)]
struct Args {
    /// Which model's shape.
    #[arg(long, value_enum)]
    model: ModelKind,
    /// no (f32) or bf16 (bf16 compute, f32 master weights), as Accelerate spells them.
    #[arg(long, default_value = "bf16")]
    mixed_precision: MixedPrecision,
    /// Rows per step on each rank.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Tokens predicted per row (rows hold context + 1 tokens).
    #[arg(long, default_value_t = 1024)]
    context: usize,
    /// Steps run before the timed ones (excluded from every figure).
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Steps timed.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Steps run after the timed ones between cuProfilerStart and cuProfilerStop (0: none).
    #[arg(long, default_value_t = 0)]
    profile_steps: usize,
    /// Where to compute.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cuda)]
    device: DeviceKind,
    /// Seed of the initial weights and of the token stream.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Overrides the model's number of layers (small models for tests and CPU runs).
    #[arg(long)]
    layers: Option<usize>,
    /// Overrides the model's width (hidden size).
    #[arg(long)]
    width: Option<usize>,
    /// Overrides the model's attention heads (head width = width / heads).
    #[arg(long)]
    heads: Option<usize>,
    /// Overrides SmolLM's key/value heads (default with --heads: SmolLM's 3 when they divide
    /// the heads, else the heads).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Overrides SmolLM's MLP width (default with --width: Llama's rule, 1536 at width 576).
    #[arg(long)]
    intermediate: Option<usize>,
    /// Overrides the vocabulary size.
    #[arg(long)]
    vocab: Option<usize>,
    /// Side of the square matrices whose product measures the peak (default: 8192 on a GPU,
    /// 1024 on the CPU).
    #[arg(long)]
    peak_size: Option<usize>,
    /// ZeRO stage: 0 (plain data parallel), 1, 2 or 3 (fully sharded; --model gpt2 only).
    /// Default: ACCELERATE_ZERO_STAGE (accelerate-launch --zero-stage sets it), else 0.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    zero_stage: Option<u8>,
}

/// The optimizer of every run, mirrored in torch_step.py: GPT-2's (llm.c's) AdamW settings.
fn adamw() -> AdamWConfig {
    AdamWConfig {
        lr: 3e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

/// The model's size once presets and overrides are applied.
#[derive(Debug, Clone, Copy)]
enum Shape {
    Gpt2(GptConfig),
    Smollm(LlamaConfig),
}

impl Shape {
    fn of(args: &Args) -> Result<Self> {
        let positive = [
            ("--layers", args.layers),
            ("--width", args.width),
            ("--heads", args.heads),
            ("--kv-heads", args.kv_heads),
            ("--intermediate", args.intermediate),
            ("--vocab", args.vocab),
        ];
        for (flag, value) in positive {
            if value == Some(0) {
                bail!("{flag} must be at least 1");
            }
        }
        match args.model {
            ModelKind::Gpt2 => {
                for (flag, given) in [
                    ("--kv-heads", args.kv_heads.is_some()),
                    ("--intermediate", args.intermediate.is_some()),
                ] {
                    if given {
                        bail!("{flag} applies to --model smollm only (GPT-2's MLP is 4 x width)");
                    }
                }
                let config = GptConfig {
                    vocab: args.vocab.unwrap_or(50257),
                    context: args.context,
                    width: args.width.unwrap_or(768),
                    heads: args.heads.unwrap_or(12),
                    layers: args.layers.unwrap_or(12),
                };
                if !config.width.is_multiple_of(config.heads) {
                    bail!(
                        "width {} is not divisible by heads {}: pick --width and --heads so that \
                         every head gets width / heads dimensions",
                        config.width,
                        config.heads
                    );
                }
                Ok(Self::Gpt2(config))
            }
            ModelKind::Smollm => {
                let width = args.width.unwrap_or(576);
                let heads = args.heads.unwrap_or(9);
                let kv_heads =
                    args.kv_heads
                        .unwrap_or(if heads.is_multiple_of(3) { 3 } else { heads });
                let intermediate = args
                    .intermediate
                    .unwrap_or_else(|| default_intermediate(width));
                // SmolLM's rotary tables cover 2048 positions; rows here hold context + 1.
                let positions = (args.context + 1).max(2048);
                let config = LlamaConfig::from_flags(
                    args.vocab.unwrap_or(49152),
                    args.layers.unwrap_or(30),
                    width,
                    heads,
                    kv_heads,
                    intermediate,
                    positions,
                )?;
                Ok(Self::Smollm(config))
            }
        }
    }

    fn vocab(&self) -> usize {
        match self {
            Self::Gpt2(c) => c.vocab,
            Self::Smollm(c) => c.vocab_size,
        }
    }

    fn layers(&self) -> usize {
        match self {
            Self::Gpt2(c) => c.layers,
            Self::Smollm(c) => c.num_hidden_layers,
        }
    }

    fn width(&self) -> usize {
        match self {
            Self::Gpt2(c) => c.width,
            Self::Smollm(c) => c.hidden_size,
        }
    }

    fn heads(&self) -> usize {
        match self {
            Self::Gpt2(c) => c.heads,
            Self::Smollm(c) => c.num_attention_heads,
        }
    }

    /// Parameters looked up rather than multiplied (left out of the FLOPs count).
    fn is_embedding_table(&self, name: &str) -> bool {
        match self {
            Self::Gpt2(_) => name == "wte.weight" || name == "wpe.weight",
            Self::Smollm(_) => name == "model.embed_tokens.weight",
        }
    }
}

/// What the timed loop measured.
struct Timings {
    /// Milliseconds of each timed step.
    step_ms: Vec<f64>,
    /// Loss per predicted token of the last step (this rank's rows).
    final_loss: f64,
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    if args.batch_size == 0 || args.context == 0 || args.steps == 0 {
        bail!("--batch-size, --context and --steps must be at least 1");
    }
    let shape = Shape::of(&args)?;
    let started = Instant::now();
    let mut builder = Accelerator::builder()
        .seed(args.seed)
        .mixed_precision(args.mixed_precision)
        .gradient_accumulation_steps(1);
    if let Some(stage) = args.zero_stage {
        builder = builder.zero_stage(stage);
    }
    match args.device {
        DeviceKind::Cpu => builder = builder.device(Device::Cpu),
        // The runtime picks the GPU (the launcher's assignment, else GPU 0); asking for one
        // makes a machine without a usable GPU an error instead of a silent CPU run.
        DeviceKind::Cuda => {
            if std::env::var_os(accelerate_core::env::DEVICE).is_none() {
                std::env::set_var(accelerate_core::env::DEVICE, "cuda");
            }
        }
    }
    let mut acc = builder.build()?;
    let zero_stage = acc.zero_stage();
    if zero_stage == 3 && args.model == ModelKind::Smollm {
        bail!(
            "ZeRO stage 3 (from --zero-stage or ACCELERATE_ZERO_STAGE) is wired for --model gpt2 \
             only: SmolLM's rows run its whole-model code, which stage 3 cannot shard; use \
             --model gpt2, or stage 0, 1 or 2"
        );
    }
    let device = acc.device().clone();
    let world = acc.num_processes();
    let memory = MemoryWatch::start(&device)?;
    let mem_before = memory.as_ref().map(|m| m.used_now()).transpose()?;

    // The peak on the main process alone: ranks sharing a GPU would halve each other's.
    let peak_size = args
        .peak_size
        .unwrap_or(if device.is_cpu() { 1024 } else { 8192 });
    let peak = if acc.is_main_process() {
        Some(measure_peak(&device, peak_size)?)
    } else {
        None
    };
    acc.wait_for_everyone()?;
    if let Some(m) = &memory {
        m.reset()?;
    }

    let total_steps = args.warmup + args.steps + args.profile_steps;
    let rows = world * args.batch_size * total_steps;
    let row_len = args.context + 1;
    let tokens = synthetic::tokens(args.seed, 0, rows * row_len, shape.vocab());
    let data_first: Vec<u32> = tokens[..4.min(tokens.len())].to_vec();
    let dtype = acc.compute_dtype();
    let (params, timings) = match shape {
        Shape::Gpt2(config) => {
            // The `gpt` example's path: the model computes through its units at every stage
            // (at stage 3 `prepare_model` keeps only this rank's pieces, and the whole
            // parameters built here are dropped).
            let (varmap, _) = gpt::build_in(config, args.seed, &device, dtype)?;
            let counts = count_params(&varmap, &shape);
            let prepared =
                acc.prepare_model(Model::from_varmap(&varmap).units(gpt::unit_specs(&config)))?;
            drop(varmap);
            let params = prepared.parameters().to_vec();
            let model = GptUnits::new(config, prepared, false);
            let opt = acc.prepare(AdamW::new(params, adamw())?)?;
            // Windows of exactly `context` inputs, one per row of context + 1 tokens.
            let data = TextWindows::new(tokens, args.context, args.context, row_len, args.seed)?;
            let items_of = |batch: &gpt::TokenBatch| batch.tokens;
            let timings = train(&mut acc, opt, data, &args, items_of, |batch| {
                Ok(model.summed_loss(&batch.inputs, &batch.targets, &batch.mask, None)?)
            })?;
            (counts, timings)
        }
        Shape::Smollm(config) => {
            let (varmap, model) = llama::build_in(config, args.seed, &device, dtype)?;
            let counts = count_params(&varmap, &shape);
            let params = acc.prepare(&varmap)?;
            let opt = acc.prepare(AdamW::new(params, adamw())?)?;
            let data = TokenRows::new(tokens, row_len)?;
            let items_of = |batch: &llama::RowBatch| batch.predicted;
            let timings = train(&mut acc, opt, data, &args, items_of, |batch| {
                Ok(model.summed_causal_lm_loss(&batch.input_ids)?)
            })?;
            (counts, timings)
        }
    };
    let (n_params, n_matmul) = params;

    let mem_peak = memory.as_ref().map(|m| m.peak()).transpose()?;
    let rss_peak_kib = peak_resident_kib().ok();
    let gpu = gpu_probe::gpu_name(&device);
    let step_median = median(&timings.step_ms);
    let step_mean = timings.step_ms.iter().sum::<f64>() / timings.step_ms.len() as f64;
    let step_min = timings
        .step_ms
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min);
    let tokens_per_s = (world * args.batch_size * args.context) as f64 / (step_mean / 1e3);
    let flops_per_token = mfu::flops_per_token(
        n_matmul as u64,
        shape.layers() as u64,
        args.context as u64,
        shape.width() as u64,
    );
    acc.wait_for_everyone()?;
    if !acc.is_main_process() {
        return Ok(());
    }
    let (peak_tflops, peak_dtype) = peak.expect("the main process measured the peak");
    let utilization = mfu::utilization(flops_per_token, tokens_per_s, peak_tflops * 1e12);
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let opt = adamw();
    let model_name = match args.model {
        ModelKind::Gpt2 => "gpt2",
        ModelKind::Smollm => "smollm",
    };
    // The fields torch_step.py prints too (benchmarks/gpu/report.py reads both); a float that
    // may not be finite goes through `float`, so that a NaN loss reads as NaN, not as missing.
    let fields: Vec<(&str, Value)> = vec![
        ("bench", json!("step")),
        ("impl", json!("ours")),
        ("mode", json!("candle")),
        ("model", json!(model_name)),
        ("mixed_precision", json!(args.mixed_precision.to_string())),
        (
            "device",
            json!(if device.is_cpu() { "cpu" } else { "cuda" }),
        ),
        ("gpu", json!(gpu)),
        ("world_size", json!(world)),
        ("zero_stage", json!(zero_stage)),
        ("batch_size", json!(args.batch_size)),
        ("context", json!(args.context)),
        ("layers", json!(shape.layers())),
        ("width", json!(shape.width())),
        ("heads", json!(shape.heads())),
        ("vocab", json!(shape.vocab())),
        ("n_params", json!(n_params)),
        ("n_params_matmul", json!(n_matmul)),
        ("flops_per_token", json!(flops_per_token)),
        ("warmup", json!(args.warmup)),
        ("steps", json!(args.steps)),
        ("profile_steps", json!(args.profile_steps)),
        ("step_ms_median", float(step_median)),
        ("step_ms_mean", float(step_mean)),
        ("step_ms_min", float(step_min)),
        ("step_ms", floats(&timings.step_ms)),
        ("tokens_per_s", float(tokens_per_s)),
        ("peak_tflops", float(peak_tflops)),
        ("peak_dtype", json!(peak_dtype)),
        ("peak_size", json!(peak_size)),
        ("mfu", float(utilization)),
        ("mem_used_before_mib", optional(mem_before.map(mib))),
        ("mem_used_peak_mib", optional(mem_peak.map(mib))),
        ("framework_peak_mib", Value::Null),
        ("rss_peak_mib", optional(rss_peak_kib.map(|k| k / 1024.0))),
        ("final_loss", float(timings.final_loss)),
        ("data_first", json!(data_first)),
        ("compile_s", Value::Null),
        ("launches_per_step", Value::Null),
        ("wall_s", json!(started.elapsed().as_secs_f64())),
        ("threads", json!(candle_core::utils::get_num_threads())),
        (
            "adamw",
            json!({"lr": opt.lr, "betas": [opt.beta1, opt.beta2], "eps": opt.eps,
                   "weight_decay": opt.weight_decay}),
        ),
    ];
    let line: serde_json::Map<String, Value> = fields
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    println!("{}", Value::Object(line));
    let memory_text = match mem_peak {
        Some(b) => format!("peak device memory {:.0} MiB", mib(b)),
        None => format!(
            "peak RSS {:.0} MiB",
            rss_peak_kib.unwrap_or(f64::NAN) / 1024.0
        ),
    };
    println!(
        "bench_step: {} {} ours, ZeRO stage {zero_stage}, {world} rank(s) x batch {} x context {}: \
         step {step_median:.2} \
         ms median ({step_mean:.2} mean), {tokens_per_s:.0} tokens/s, MFU {:.2} % of {} \
         TFLOP/s ({peak_dtype} {peak_size}^3), {memory_text}, loss {:.4}",
        model_name,
        args.mixed_precision,
        args.batch_size,
        args.context,
        utilization * 100.0,
        // A CPU's peak is a small fraction of a TFLOP/s.
        if peak_tflops < 10.0 {
            format!("{peak_tflops:.3}")
        } else {
            format!("{peak_tflops:.1}")
        },
        timings.final_loss
    );
    Ok(())
}

/// All parameters of the whole model, and those that multiply (all but the embedding tables):
/// counted before `prepare`, which at ZeRO stage 3 leaves each rank its pieces only.
fn count_params(varmap: &VarMap, shape: &Shape) -> (usize, usize) {
    let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
    let total = data.values().map(|v| v.elem_count()).sum();
    let matmul = data
        .iter()
        .filter(|(n, _)| !shape.is_embedding_table(n))
        .map(|(_, v)| v.elem_count())
        .sum();
    (total, matmul)
}

/// Runs the warm-up, timed and profiled steps of `data` through the runtime: `loss_of` gives a
/// batch's loss summed over the tokens it predicts, `items_of` their number.
fn train<D: Dataset>(
    acc: &mut Accelerator,
    mut opt: PreparedOptimizer<AdamW>,
    data: D,
    args: &Args,
    items_of: impl Fn(&D::Batch) -> usize,
    mut loss_of: impl FnMut(&D::Batch) -> Result<Tensor>,
) -> Result<Timings> {
    let device = acc.device().clone();
    let loader = DataLoader::new(Arc::new(data), args.batch_size).prefetch(2);
    let mut loader = acc.prepare(loader)?;
    let expected = args.warmup + args.steps + args.profile_steps;
    if loader.len() != expected {
        bail!(
            "the data loader holds {} batches per rank, not the {expected} steps asked for",
            loader.len()
        );
    }
    let mut step_ms = Vec::with_capacity(args.steps);
    let mut final_loss = f64::NAN;
    let mut last = Instant::now();
    for (i, window) in loader.windows(1).enumerate() {
        if i == args.warmup + args.steps && args.profile_steps > 0 {
            device.synchronize()?;
            gpu_probe::profiler_range(&device, true)?;
        }
        let window = window?;
        acc.set_window_items(window.iter().map(&items_of).sum())?;
        for batch in &window {
            let _step = acc.accumulate();
            let loss = loss_of(batch)?;
            acc.backward(&loss)?;
            opt.step()?;
            opt.zero_grad();
            // Reading the loss back waits for the step's work on the device.
            let summed = loss.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64;
            final_loss = summed / items_of(batch) as f64;
        }
        let now = Instant::now();
        if (args.warmup..args.warmup + args.steps).contains(&i) {
            step_ms.push((now - last).as_secs_f64() * 1e3);
        }
        last = now;
    }
    if args.profile_steps > 0 {
        gpu_probe::profiler_range(&device, false)?;
    }
    if step_ms.len() != args.steps {
        bail!(
            "timed {} steps of the {} asked for (the loader ended early)",
            step_ms.len(),
            args.steps
        );
    }
    Ok(Timings {
        step_ms,
        final_loss,
    })
}

/// The peak matrix-product rate of `device` in TFLOP/s and the dtype it was measured in: the
/// product of two `size × size` matrices of normal random values (bf16 on a GPU, f32 on the CPU),
/// 3 warm-up products, then timed ones until half a second or 50 products have passed.
fn measure_peak(device: &Device, size: usize) -> Result<(f64, &'static str)> {
    let (dtype, name) = if device.is_cpu() {
        (DType::F32, "f32")
    } else {
        (DType::BF16, "bf16")
    };
    let a = Tensor::randn(0f32, 1.0, (size, size), device)?.to_dtype(dtype)?;
    let b = Tensor::randn(0f32, 1.0, (size, size), device)?.to_dtype(dtype)?;
    for _ in 0..3 {
        a.matmul(&b)?;
    }
    device.synchronize()?;
    let start = Instant::now();
    let mut products = 0usize;
    // Batches of products between synchronizations, so that queueing keeps the device busy.
    while products < 50 && start.elapsed().as_secs_f64() < 0.5 {
        for _ in 0..5 {
            a.matmul(&b)?;
        }
        device.synchronize()?;
        products += 5;
    }
    let seconds = start.elapsed().as_secs_f64();
    let flops = 2.0 * (size as f64).powi(3) * products as f64;
    let tflops = flops / seconds / 1e12;
    if !tflops.is_finite() || tflops <= 0.0 {
        bail!("the peak measurement gave {tflops} TFLOP/s; try a larger --peak-size");
    }
    Ok((tflops, name))
}
