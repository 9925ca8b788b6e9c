//! Shared pieces of the integration tests: a tiny model, seeded data, and reference optimizers
//! written directly from the published update rules with plain candle tensor ops — independent of
//! the fused kernels, gradient buffers and accumulation logic under test.

use std::collections::HashMap;

pub mod conformance_suite;
pub mod slurm_cluster;

// The harness every crate's tests share (processes, ports, skips, the tiny model), re-exported so
// that this crate's tests name it from one place.
pub use accelerate_test_support::env::{INHERITED_JOB_ENV, INHERITED_JOB_ENV_PREFIXES};
pub use accelerate_test_support::{
    alive, built_binary, children_by_rank, free_port, free_ports, named_vars, output_text,
    profile_dir, run_bounded, send_signal, skip, skip_unless_required, summary_value, tiny_mlp,
    tiny_mlp_on, Job, JobOutput, TinyMlp, TINY_CLASSES, TINY_IN,
};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The tiny MLP's units (see [`tiny_mlp`]): `l1` and `l2`, one per layer.
pub fn tiny_units() -> Vec<accelerate_core::UnitSpec> {
    vec![
        accelerate_core::UnitSpec::new("l1", ["l1."]),
        accelerate_core::UnitSpec::new("l2", ["l2."]),
    ]
}

/// The tiny MLP's `Linear` layer `name` (`l1` or `l2`) over a unit's parameters.
pub fn tiny_layer(p: &accelerate_core::UnitParams, name: &str) -> Result<candle_nn::Linear> {
    Ok(candle_nn::Linear::new(
        p.get(&format!("{name}.weight"))?,
        Some(p.get(&format!("{name}.bias"))?),
    ))
}

/// The tiny MLP's logits through the units of a model prepared with [`tiny_units`]: what
/// `TinyMlp::forward` computes, unit by unit.
pub fn tiny_forward_units(
    model: &accelerate_core::PreparedModel,
    x: &Tensor,
) -> accelerate_core::Result<Tensor> {
    use candle_nn::Module;
    let h = model
        .unit("l1")?
        .forward(x, |x, p| tiny_layer(p, "l1")?.forward(x)?.tanh())?;
    model
        .unit("l2")?
        .forward(&h, |h, p| tiny_layer(p, "l2")?.forward(h))
}

/// Seeded classification data: x `[n, 6]`, y `[n]` (u32, in 0..3).
pub fn tiny_data(n: usize, seed: u64) -> Result<(Tensor, Tensor)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let x: Vec<f32> = (0..n * TINY_IN)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let y: Vec<u32> = (0..n)
        .map(|_| rng.random_range(0..TINY_CLASSES as u32))
        .collect();
    Ok((
        Tensor::from_vec(x, (n, TINY_IN), &Device::Cpu)?,
        Tensor::from_vec(y, n, &Device::Cpu)?,
    ))
}

/// Largest absolute difference between two parameter sets with the same names.
pub fn max_abs_diff(a: &[(String, Var)], b: &[(String, Var)]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, va), (nb, vb))| {
            assert_eq!(na, nb);
            let d = (va.as_tensor() - vb.as_tensor()).unwrap().abs().unwrap();
            d.flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        })
        .fold(0.0, f32::max)
}

/// Copies parameter values (to compare before/after).
pub fn snapshot(params: &[(String, Var)]) -> Vec<Vec<f32>> {
    params
        .iter()
        .map(|(_, v)| v.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}

/// PyTorch's SGD and AdamW, written from their documented update rules with tensor ops.
#[derive(Debug)]
pub enum ReferenceOptimizer {
    /// `torch.optim.SGD(lr, momentum)` (no dampening, no Nesterov, no weight decay).
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum factor.
        momentum: f64,
        /// Momentum buffers by name.
        bufs: HashMap<String, Tensor>,
    },
    /// `torch.optim.AdamW(lr, betas, eps, weight_decay)`.
    AdamW {
        /// Learning rate.
        lr: f64,
        /// β1, β2.
        betas: (f64, f64),
        /// ε, added outside the square root.
        eps: f64,
        /// Decoupled weight decay.
        weight_decay: f64,
        /// Step count of each parameter by name: PyTorch keeps it per parameter
        /// (`state["step"]`), so a parameter skipped for lack of a gradient does not advance it.
        steps: HashMap<String, i32>,
        /// First and second moments by name.
        moments: HashMap<String, (Tensor, Tensor)>,
    },
}

impl ReferenceOptimizer {
    /// SGD with momentum.
    pub fn sgd(lr: f64, momentum: f64) -> Self {
        Self::Sgd {
            lr,
            momentum,
            bufs: HashMap::new(),
        }
    }

    /// AdamW with PyTorch's default betas and eps.
    pub fn adamw(lr: f64, weight_decay: f64) -> Self {
        Self::AdamW {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay,
            steps: HashMap::new(),
            moments: HashMap::new(),
        }
    }

    /// Sets the learning rate (for schedules).
    pub fn set_lr(&mut self, new: f64) {
        match self {
            Self::Sgd { lr, .. } | Self::AdamW { lr, .. } => *lr = new,
        }
    }

    /// One update from candle's gradients.
    pub fn step(&mut self, params: &[(String, Var)], grads: &GradStore) -> Result<()> {
        match self {
            Self::Sgd { lr, momentum, bufs } => {
                for (name, var) in params {
                    let Some(g) = grads.get(var.as_tensor()) else {
                        continue;
                    };
                    let buf = match bufs.get(name) {
                        None => g.clone(),
                        Some(b) => ((b * *momentum)? + g)?,
                    };
                    var.set(&(var.as_tensor() - (&buf * *lr)?)?)?;
                    bufs.insert(name.clone(), buf);
                }
            }
            Self::AdamW {
                lr,
                betas,
                eps,
                weight_decay,
                steps,
                moments,
            } => {
                let (b1, b2) = *betas;
                for (name, var) in params {
                    let Some(g) = grads.get(var.as_tensor()) else {
                        continue;
                    };
                    let t = steps.entry(name.clone()).or_insert(0);
                    *t += 1;
                    let (m, v) = match moments.get(name) {
                        Some(mv) => mv.clone(),
                        None => (g.zeros_like()?, g.zeros_like()?),
                    };
                    let m = ((m * b1)? + (g * (1.0 - b1))?)?;
                    let v = ((v * b2)? + (g.sqr()? * (1.0 - b2))?)?;
                    let m_hat = (&m / (1.0 - b1.powi(*t)))?;
                    let v_hat = (&v / (1.0 - b2.powi(*t)))?;
                    let p = (var.as_tensor() * (1.0 - *lr * *weight_decay))?;
                    let update = (m_hat / (v_hat.sqrt()? + *eps)?)?;
                    var.set(&(p - (update * *lr)?)?)?;
                    moments.insert(name.clone(), (m, v));
                }
            }
        }
        Ok(())
    }
}

/// Flags of a small `llama`-workload run (1 layer, hidden 32, rows of 16 tokens of the built-in
/// text, seed 5) with SGD at lr 0.3, whose step is proportional to the gradient (AdamW's would
/// hide a wrongly scaled accumulated gradient): `batch` rows per micro-batch, `steps` optimizer
/// steps. The `llama` and `lora` examples take them alike.
pub fn small_llama_args(batch: usize, steps: u64) -> Vec<String> {
    [
        "--layers",
        "1",
        "--width",
        "32",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--intermediate",
        "48",
        "--context",
        "16",
        "--seed",
        "5",
        "--optimizer",
        "sgd",
        "--lr",
        "0.3",
        "--batch-size",
        &batch.to_string(),
        "--max-steps",
        &steps.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Arguments of the restart tests' `mlp` run (256 optimizer steps of AdamW on 2 ranks with K = 2,
/// a checkpoint every 16 in `ckpt`, resuming from the latest, weights saved to `out`): long
/// enough to kill a rank after the first checkpoint and before the end.
pub fn restart_mlp_args(out: &std::path::Path, ckpt: &std::path::Path) -> Vec<String> {
    [
        "--hidden",
        "128",
        "--samples",
        "4096",
        "--batch-size",
        "8",
        "--grad-accum",
        "2",
        "--optimizer",
        "adamw",
        "--lr",
        "0.003",
        "--seed",
        "5",
        "--epochs",
        "2",
        "--checkpoint-every",
        "16",
        "--resume",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
        "--save-model",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Arguments of a small (hidden width 16), shuffled `mlp` run of two epochs that saves its
/// weights to `out`: AdamW at lr 0.003 or SGD at 0.1.
pub fn small_mlp_args(
    samples: usize,
    batch: usize,
    optimizer: &str,
    seed: u64,
    out: &std::path::Path,
) -> Vec<String> {
    let lr = if optimizer == "sgd" { "0.1" } else { "0.003" };
    [
        "--hidden",
        "16",
        "--samples",
        &samples.to_string(),
        "--batch-size",
        &batch.to_string(),
        "--optimizer",
        optimizer,
        "--lr",
        lr,
        "--seed",
        &seed.to_string(),
        "--epochs",
        "2",
        "--save-model",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Reads every tensor of a safetensors file as flat f32 values, by name.
pub fn load_flat(path: &std::path::Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// Largest absolute difference between two sets of named flat tensors with the same names.
pub fn max_abs_diff_flat(
    a: &std::collections::BTreeMap<String, Vec<f32>>,
    b: &std::collections::BTreeMap<String, Vec<f32>>,
) -> f32 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter()
        .flat_map(|(n, va)| va.iter().zip(&b[n]).map(|(x, y)| (x - y).abs()))
        .fold(0.0, f32::max)
}

/// The per-step losses of an example's `--metrics` file (one JSON object per line).
pub fn metric_losses(path: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["loss"].as_f64().unwrap()
        })
        .collect()
}

/// Runs `f` on `n` ranks that are threads of this process, joined as under torchrun (rank 0 hosts
/// the store on MASTER_PORT + 1, on loopback), and returns each rank's result in rank order.
/// `builder` configures each rank's accelerator; the process state is set here.
pub fn ranks_as_threads<R: Send>(
    n: usize,
    builder: impl Fn() -> accelerate_core::AcceleratorBuilder + Sync,
    f: impl Fn(accelerate_core::Accelerator) -> R + Sync,
) -> Vec<R> {
    use accelerate_core::{Launcher, ProcessState};
    let port = free_ports(2);
    // Every rank finishes joining before any runs `f`: rank 0 hosts the store, and a rank 0 whose
    // `f` needs no collective would otherwise drop it while a peer still reads its last keys.
    let joined = std::sync::Barrier::new(n);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (builder, f, joined) = (&builder, &f, &joined);
                scope.spawn(move || {
                    let state = ProcessState {
                        rank,
                        world_size: n,
                        local_rank: rank,
                        local_world_size: n,
                        master_addr: "127.0.0.1".into(),
                        master_port: port,
                        job_token: format!("ranks-as-threads-{port}"),
                        restart_count: 0,
                        launcher: Launcher::Torchrun,
                    };
                    let accelerator = builder().process_state(state).build();
                    joined.wait();
                    f(accelerator.unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Kills (SIGKILL) the worker of `rank` that launcher `launcher` started, as soon as `checkpoint`
/// exists: the restart tests' way to fail a rank after the first checkpoint and before the end.
/// Fails the test if the launcher ends first or nothing happens within `limit`.
pub fn kill_rank_once_checkpointed(
    launcher: &mut std::process::Child,
    rank: usize,
    checkpoint: &std::path::Path,
    limit: std::time::Duration,
) {
    let start = std::time::Instant::now();
    let victim = loop {
        if checkpoint.is_dir() {
            if let Some((_, pid)) = children_by_rank(launcher.id())
                .into_iter()
                .find(|(r, _)| *r == rank)
            {
                break pid;
            }
        }
        assert!(
            launcher.try_wait().unwrap().is_none(),
            "the job ended before the kill"
        );
        assert!(start.elapsed() < limit, "no checkpoint appeared");
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    send_signal(victim, "KILL");
}

/// An optimizer that steps `inner` and passes the mixed-precision compute copies on to it only
/// when `keep_copies` is set. Without them the runtime treats it as any optimizer that keeps no
/// copies: it casts every master into its compute copy after the step. That cast is the reference
/// the copies written by an update's own pass are compared with.
pub struct CopiesOrCast {
    /// The optimizer that does the work.
    pub inner: Box<dyn accelerate_core::optim::Optimizer + Send>,
    /// Whether `inner` gets the compute copies.
    pub keep_copies: bool,
}

impl accelerate_core::optim::Optimizer for CopiesOrCast {
    fn step(
        &mut self,
        grads: accelerate_core::optim::Gradients<'_>,
    ) -> accelerate_core::Result<()> {
        self.inner.step(grads)
    }

    fn learning_rate(&self) -> &accelerate_core::optim::LearningRate {
        self.inner.learning_rate()
    }

    fn params(&self) -> &[(String, Var)] {
        self.inner.params()
    }

    fn state(&self) -> accelerate_core::Result<accelerate_core::optim::OptimizerState> {
        self.inner.state()
    }

    fn load_state(
        &mut self,
        state: &accelerate_core::optim::OptimizerState,
    ) -> accelerate_core::Result<()> {
        self.inner.load_state(state)
    }

    fn set_compute_copies(&mut self, copies: &[(String, Var)]) -> accelerate_core::Result<()> {
        if self.keep_copies {
            self.inner.set_compute_copies(copies)
        } else {
            Ok(())
        }
    }

    fn wrote_compute_copy(&self, name: &str) -> bool {
        self.keep_copies && self.inner.wrote_compute_copy(name)
    }

    fn shard(
        &mut self,
        pieces: &std::collections::BTreeMap<String, std::ops::Range<usize>>,
    ) -> accelerate_core::Result<()> {
        self.inner.shard(pieces)
    }
}

/// The bits of every element of `t` (f32 as u32, bf16/f16 widened from u16), for comparisons that
/// must be exact.
pub fn tensor_bits(t: &Tensor) -> Vec<u32> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => t
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .map(|x| u32::from(x.to_bits()))
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()
            .unwrap()
            .iter()
            .map(|x| u32::from(x.to_bits()))
            .collect(),
        d => panic!("tensor_bits of a {d:?} tensor"),
    }
}

/// The update rules the sharding comparisons (ZeRO stages 1 to 3) train the tiny MLP with:
/// SGD (lr 0.1, momentum 0.9) and AdamW (lr 0.02, weight decay 0.1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Opt {
    /// `torch.optim.SGD(lr=0.1, momentum=0.9)`.
    SgdMomentum,
    /// `torch.optim.AdamW(lr=0.02, weight_decay=0.1)`.
    AdamW,
}

/// The tiny MLP (seed 3) after `steps` steps of one process on the whole global batch of
/// `n · k · batch` samples of `tiny_data(_, 5)` per step, with PyTorch's rules written out
/// ([`ReferenceOptimizer`]): what `n` ranks × K = `k` micro-batches of `batch` must end with.
pub fn global_batch_reference(
    n: usize,
    k: usize,
    batch: usize,
    steps: usize,
    opt: Opt,
) -> Vec<Vec<f32>> {
    let global = n * k * batch;
    let (x, y) = tiny_data(global * steps, 5).unwrap();
    let (varmap, model) = tiny_mlp(3).unwrap();
    let params = named_vars(&varmap);
    let mut optimizer = match opt {
        Opt::SgdMomentum => ReferenceOptimizer::sgd(0.1, 0.9),
        Opt::AdamW => ReferenceOptimizer::adamw(0.02, 0.1),
    };
    for s in 0..steps {
        let logits = model
            .forward(&x.narrow(0, s * global, global).unwrap())
            .unwrap();
        let loss =
            candle_nn::loss::cross_entropy(&logits, &y.narrow(0, s * global, global).unwrap())
                .unwrap();
        optimizer.step(&params, &loss.backward().unwrap()).unwrap();
    }
    snapshot(&params)
}

/// Largest absolute difference between two flattened parameter lists of the same layout.
pub fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The bit patterns of a flattened parameter list, to compare bit for bit.
pub fn bits(a: &[Vec<f32>]) -> Vec<u32> {
    a.iter().flatten().map(|x| x.to_bits()).collect()
}

/// `opt` with its rule's settings ([`Opt`]) over `params`, prepared by `acc`, as one call that
/// steps it and zeroes the gradients (a no-op on micro-steps that do not sync).
pub fn prepared_step(
    acc: &mut accelerate_core::Accelerator,
    params: Vec<(String, Var)>,
    opt: Opt,
) -> Box<dyn FnMut()> {
    use accelerate_core::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
    match opt {
        Opt::SgdMomentum => {
            let cfg = SgdConfig {
                lr: 0.1,
                momentum: 0.9,
                ..SgdConfig::default()
            };
            let mut o = acc.prepare(Sgd::new(params, cfg).unwrap()).unwrap();
            Box::new(move || {
                o.step().unwrap();
                o.zero_grad();
            })
        }
        Opt::AdamW => {
            let cfg = AdamWConfig {
                lr: 0.02,
                weight_decay: 0.1,
                ..AdamWConfig::default()
            };
            let mut o = acc.prepare(AdamW::new(params, cfg).unwrap()).unwrap();
            Box::new(move || {
                o.step().unwrap();
                o.zero_grad();
            })
        }
    }
}
