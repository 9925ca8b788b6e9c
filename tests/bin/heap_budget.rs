//! A training program whose heap is counted and, on request, capped: the memory proof of ZeRO
//! stage 3 (`tests/integration/fsdp_memory.rs`).
//!
//! Its global allocator is the system's, wrapped to count the bytes live and their peak. With
//! `ACCELERATE_TEST_HEAP_BUDGET=<bytes>` an allocation that would take the live bytes past the
//! budget fails (returns null), so Rust aborts the process with "memory allocation of N bytes
//! failed". A budget on what the program allocates is what a rank's memory is; an address-space
//! limit (`RLIMIT_AS`) would also count what glibc's arenas and the threads' stacks reserve
//! without using.
//!
//! It trains a model whose parameters dominate: `--layers` units of one `--width`² linear layer
//! with bias and tanh each, AdamW, an MSE loss against fixed random targets, `--steps` optimizer
//! steps of a global batch of `--batch` rows split evenly over the ranks, through the core API
//! (`Model::units`, `unit(name).forward`) at whatever ZeRO stage the launcher sets. The main
//! process prints one `result: {json}` line: the losses, the trained model's loss on a probe
//! batch and its output on the batch's first rows, Σθ² over the trained parameters, and each
//! rank's heap figures (see [`run`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use accelerate_core::optim::{AdamW, AdamWConfig};
use accelerate_core::{Accelerator, Model, PreparedModel, ReduceOp, UnitSpec};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::Linear;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The variable that sets the budget, in bytes.
const BUDGET_VAR: &str = "ACCELERATE_TEST_HEAP_BUDGET";

/// Bytes live on the heap.
static LIVE: AtomicUsize = AtomicUsize::new(0);
/// The most bytes live at once since the last [`reset_peak`].
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// The most bytes that may be live (no limit until `main` reads the variable).
static BUDGET: AtomicUsize = AtomicUsize::new(usize::MAX);

/// The system allocator, counting (see the module documentation).
struct Counting;

impl Counting {
    /// Counts `size` more bytes live; `false`, counting nothing, if that passes the budget.
    fn reserve(size: usize) -> bool {
        let budget = BUDGET.load(Relaxed);
        let mut live = LIVE.load(Relaxed);
        loop {
            let next = live.saturating_add(size);
            if next > budget {
                return false;
            }
            match LIVE.compare_exchange_weak(live, next, Relaxed, Relaxed) {
                Ok(_) => {
                    PEAK.fetch_max(next, Relaxed);
                    return true;
                }
                Err(now) => live = now,
            }
        }
    }

    fn release(size: usize) {
        LIVE.fetch_sub(size, Relaxed);
    }
}

// SAFETY: every call is passed to `System` unchanged; only the counters are added, and a refused
// allocation returns null, which `GlobalAlloc` allows.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !Self::reserve(layout.size()) {
            return std::ptr::null_mut();
        }
        let p = System.alloc(layout);
        if p.is_null() {
            Self::release(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !Self::reserve(layout.size()) {
            return std::ptr::null_mut();
        }
        let p = System.alloc_zeroed(layout);
        if p.is_null() {
            Self::release(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        Self::release(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = layout.size();
        if new_size > old && !Self::reserve(new_size - old) {
            return std::ptr::null_mut();
        }
        let p = System.realloc(ptr, layout, new_size);
        match (p.is_null(), new_size > old) {
            (true, true) => Self::release(new_size - old),
            (false, false) => Self::release(old - new_size),
            _ => {}
        }
        p
    }
}

#[global_allocator]
static HEAP: Counting = Counting;

/// Forgets the peak so far: the next one is measured from the bytes live now.
fn reset_peak() {
    PEAK.store(LIVE.load(Relaxed), Relaxed);
}

/// The run's sizes.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    layers: usize,
    width: usize,
    batch: usize,
    steps: usize,
}

fn parse_args() -> Result<Sizes> {
    let mut sizes = Sizes {
        layers: 16,
        width: 512,
        batch: 48,
        steps: 3,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let [flag, value] = pair else {
            bail!("{:?} needs a value", pair[0]);
        };
        let value: usize = value
            .parse()
            .with_context(|| format!("{flag} takes a whole number, got {value:?}"))?;
        match flag.as_str() {
            "--layers" => sizes.layers = value,
            "--width" => sizes.width = value,
            "--batch" => sizes.batch = value,
            "--steps" => sizes.steps = value,
            other => bail!("unknown flag {other:?}; use --layers, --width, --batch or --steps"),
        }
    }
    if sizes.layers == 0 || sizes.width == 0 || sizes.batch == 0 || sizes.steps == 0 {
        bail!("--layers, --width, --batch and --steps must each be at least 1");
    }
    Ok(sizes)
}

fn main() {
    let result = std::env::var(BUDGET_VAR)
        .ok()
        .map(|v| {
            v.parse::<usize>()
                .with_context(|| format!("{BUDGET_VAR} takes a number of bytes, got {v:?}"))
        })
        .transpose()
        .and_then(|budget| {
            if let Some(b) = budget {
                BUDGET.store(b, Relaxed);
            }
            run(parse_args()?)
        });
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Layer `i`'s name: its unit's and its parameters' prefix.
fn layer_name(i: usize) -> String {
    format!("l{i:02}")
}

/// `n` seeded values uniform in `[-bound, bound)`.
fn uniform(rng: &mut ChaCha8Rng, n: usize, bound: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-bound..bound)).collect()
}

/// The whole model, seeded (the same on every rank and in every run, so runs at different world
/// sizes and stages start alike): `nn.Linear`'s bounds, `1/sqrt(width)`.
fn build_model(s: Sizes) -> Result<Vec<(String, Var)>> {
    let mut rng = ChaCha8Rng::seed_from_u64(33);
    let bound = 1.0 / (s.width as f32).sqrt();
    let mut vars = Vec::with_capacity(2 * s.layers);
    for i in 0..s.layers {
        let w = Tensor::from_vec(
            uniform(&mut rng, s.width * s.width, bound),
            (s.width, s.width),
            &Device::Cpu,
        )?;
        let b = Tensor::from_vec(uniform(&mut rng, s.width, bound), s.width, &Device::Cpu)?;
        vars.push((format!("{}.weight", layer_name(i)), Var::from_tensor(&w)?));
        vars.push((format!("{}.bias", layer_name(i)), Var::from_tensor(&b)?));
    }
    Ok(vars)
}

/// The model through its units: each layer `tanh(x·Wᵀ + b)`.
fn forward(model: &PreparedModel, x: &Tensor, layers: usize) -> Result<Tensor> {
    let mut h = x.clone();
    for i in 0..layers {
        let name = layer_name(i);
        let (w, b) = (format!("{name}.weight"), format!("{name}.bias"));
        h = model.unit(&name)?.forward(&h, move |x, p| {
            Linear::new(p.get(&w)?, Some(p.get(&b)?)).forward(x)?.tanh()
        })?;
    }
    Ok(h)
}

/// One number per rank, every rank's, in rank order (a collective).
fn per_rank(acc: &Accelerator, value: f64) -> Result<Vec<f64>> {
    let mut slots = vec![0f64; acc.num_processes()];
    slots[acc.process_index()] = value;
    let all = acc.reduce(&Tensor::new(slots.as_slice(), &Device::Cpu)?, ReduceOp::Sum)?;
    Ok(all.to_vec1::<f64>()?)
}

/// Trains and prints the result line. Its heap figures are bytes, one per rank in rank order:
/// `base_bytes` live once the accelerator and the data exist, before the model (what the run
/// holds whatever the model); `setup_peak_bytes` the peak from the start through `prepare` and
/// the optimizer's construction (every rank builds the whole model once, before `prepare` cuts
/// it); `train_peak_bytes` the peak over the training steps and the probe; `held_*` the bytes
/// live after setup and between steps; `forward_`, `backward_` and `step_peak_bytes` the peaks of
/// each part of a step.
fn run(s: Sizes) -> Result<()> {
    let mut acc = Accelerator::new()?;
    let (n, rank) = (acc.num_processes(), acc.process_index());
    if !s.batch.is_multiple_of(n) {
        bail!(
            "--batch {} does not split evenly over {n} ranks; give a multiple of {n}",
            s.batch
        );
    }
    let local = s.batch / n;
    // The data: steps global batches and one probe batch, inputs and targets, on every rank.
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let rows = (s.steps + 1) * s.batch;
    let x = Tensor::from_vec(
        uniform(&mut rng, rows * s.width, 1.0),
        (rows, s.width),
        &Device::Cpu,
    )?;
    let y = Tensor::from_vec(
        uniform(&mut rng, rows * s.width, 0.5),
        (rows, s.width),
        &Device::Cpu,
    )?;
    let base = LIVE.load(Relaxed);

    let units: Vec<UnitSpec> = (0..s.layers)
        .map(|i| UnitSpec::new(layer_name(i), [format!("{}.", layer_name(i))]))
        .collect();
    let model = acc.prepare_model(Model::new(build_model(s)?).units(units))?;
    let config = AdamWConfig {
        lr: 1e-3,
        ..AdamWConfig::default()
    };
    let mut opt = acc.prepare(AdamW::new(model.parameters().to_vec(), config)?)?;
    let setup_peak = PEAK.load(Relaxed);
    reset_peak();

    let held_after_setup = LIVE.load(Relaxed);
    // Peaks of the forward pass, the backward pass and the optimizer step, over the steps.
    let mut phases = [0usize; 3];
    let mut phase = |i: usize| {
        let peak = PEAK.load(Relaxed);
        phases[i] = phases[i].max(peak);
        reset_peak();
        peak
    };
    let mut losses = Vec::with_capacity(s.steps);
    let mut train_peak = 0;
    let mut held_between_steps = 0;
    for step in 0..s.steps {
        let start = step * s.batch + rank * local;
        let _micro = acc.accumulate();
        let out = forward(&model, &x.narrow(0, start, local)?, s.layers)?;
        let loss = candle_nn::loss::mse(&out, &y.narrow(0, start, local)?)?;
        train_peak = train_peak.max(phase(0));
        acc.backward(&loss)?;
        train_peak = train_peak.max(phase(1));
        opt.step()?;
        opt.zero_grad();
        train_peak = train_peak.max(phase(2));
        let global = acc.reduce(&loss.detach().reshape(1)?, ReduceOp::Mean)?;
        losses.push(global.to_vec1::<f32>()?[0]);
        drop((out, loss, global));
        held_between_steps = held_between_steps.max(LIVE.load(Relaxed));
    }
    // The trained model on the probe batch, the same on every rank: it depends on every weight.
    let probe_at = s.steps * s.batch;
    let probe = forward(&model, &x.narrow(0, probe_at, s.batch)?, s.layers)?.detach();
    let probe_loss = candle_nn::loss::mse(&probe, &y.narrow(0, probe_at, s.batch)?)?;
    train_peak = train_peak.max(phase(0));

    // Σθ² over every parameter: each rank's own elements (its pieces under stage 3, where the
    // ranks' pieces partition the model; the whole model otherwise).
    let mut sq = 0f64;
    for (_, v) in model.parameters() {
        let t = v.as_tensor().to_dtype(DType::F64)?;
        sq += t.sqr()?.sum_all()?.to_scalar::<f64>()?;
    }
    let sq = match acc.zero_stage() {
        3 => per_rank(&acc, sq)?.iter().sum(),
        _ => sq,
    };
    let bases = per_rank(&acc, base as f64)?;
    let setups = per_rank(&acc, setup_peak as f64)?;
    let trains = per_rank(&acc, train_peak as f64)?;
    let held_setup = per_rank(&acc, held_after_setup as f64)?;
    let held_steps = per_rank(&acc, held_between_steps as f64)?;
    let forward_peaks = per_rank(&acc, phases[0] as f64)?;
    let backward_peaks = per_rank(&acc, phases[1] as f64)?;
    let step_peaks = per_rank(&acc, phases[2] as f64)?;
    let params: usize = (0..s.layers).map(|_| s.width * s.width + s.width).sum();
    acc.print(format!(
        "result: {}",
        serde_json::json!({
            "zero_stage": acc.zero_stage(),
            "ranks": n,
            "parameters": params,
            "layers": s.layers,
            "width": s.width,
            "batch": s.batch,
            "losses": losses,
            "probe_loss": probe_loss.to_scalar::<f32>()?,
            "probe": probe.narrow(0, 0, s.batch.min(4))?.flatten_all()?.to_vec1::<f32>()?,
            "param_sq": sq,
            "base_bytes": bases,
            "setup_peak_bytes": setups,
            "train_peak_bytes": trains,
            "held_after_setup_bytes": held_setup,
            "held_between_steps_bytes": held_steps,
            "forward_peak_bytes": forward_peaks,
            "backward_peak_bytes": backward_peaks,
            "step_peak_bytes": step_peaks,
        })
    ));
    Ok(())
}
