//! Shared pieces of the integration tests: a tiny model, seeded data, and reference optimizers
//! written directly from the published update rules with plain candle tensor ops — independent of
//! the fused kernels, gradient buffers and accumulation logic under test.

use std::collections::HashMap;

pub mod conformance_suite;
mod job;
pub mod slurm_cluster;

pub use job::{summary_value, Job, JobOutput, INHERITED_JOB_ENV, INHERITED_JOB_ENV_PREFIXES};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::{Linear, Module, VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Says that the running test is skipped and why, as `skipped: <test>: <reason>` on this
/// process's standard error. Written to the stream itself, not through `eprintln!`, which libtest
/// captures and shows only for failing tests: a skipped test passes, so its reason would never
/// be seen. Call it, then return from the test.
pub fn skip(reason: impl std::fmt::Display) {
    use std::io::Write;
    // libtest runs each test on a thread named after it.
    let thread = std::thread::current();
    let test = thread.name().filter(|n| *n != "main").unwrap_or("a test");
    let _ = writeln!(std::io::stderr().lock(), "skipped: {test}: {reason}");
}

/// [`skip`], unless the variable `require` is set (to anything but empty or `0`): CI sets it where
/// it installed what the test needs, and there the skip is a failure that says `reason`.
pub fn skip_unless_required(require: &str, reason: impl std::fmt::Display) {
    let required = std::env::var(require).is_ok_and(|v| !v.is_empty() && v != "0");
    assert!(
        !required,
        "{require} is set, so this test may not skip: {reason}"
    );
    skip(reason);
}

/// Inputs of the tiny model.
pub const TINY_IN: usize = 6;
/// Classes of the tiny model.
pub const TINY_CLASSES: usize = 3;

/// A two-layer tanh MLP, 6 → 8 → 3.
#[derive(Debug)]
pub struct TinyMlp {
    l1: Linear,
    l2: Linear,
}

impl TinyMlp {
    /// Logits.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.l2.forward(&self.l1.forward(x)?.tanh()?)
    }
}

/// The tiny model with seeded weights (same seed, same weights).
pub fn tiny_mlp(seed: u64) -> Result<(VarMap, TinyMlp)> {
    tiny_mlp_on(seed, &Device::Cpu)
}

/// [`tiny_mlp`] with its parameters on `device` (the same values on every device).
pub fn tiny_mlp_on(seed: u64, device: &Device) -> Result<(VarMap, TinyMlp)> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, device);
    let model = TinyMlp {
        l1: candle_nn::linear(TINY_IN, 8, vb.pp("l1"))?,
        l2: candle_nn::linear(8, TINY_CLASSES, vb.pp("l2"))?,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for (_, var) in named_vars(&varmap) {
        let v: Vec<f32> = (0..var.elem_count())
            .map(|_| rng.random_range(-0.5f32..0.5))
            .collect();
        var.set(&Tensor::from_vec(v, var.dims(), device)?)?;
    }
    Ok((varmap, model))
}

/// The parameters of a `VarMap`, sorted by name.
pub fn named_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let mut v: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
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

/// The directory of the build profile the tests were built with (`target/release` or
/// `target/debug`), where `cargo test` also puts the launcher and the examples.
pub fn profile_dir() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test>-<hash>
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("test executable lives in target/<profile>/deps")
        .to_path_buf()
}

/// Path of a binary built by `cargo test --workspace`, with a clear message when it is missing.
pub fn built_binary(relative: &str) -> std::path::PathBuf {
    let path = profile_dir().join(relative);
    assert!(
        path.exists(),
        "{} is missing: run the tests with `cargo test --release --workspace`, which builds the \
         launcher and the examples",
        path.display()
    );
    path
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

/// Runs a command to completion, killing it (and failing the test) if it takes longer than
/// `limit`: a test must never hang.
pub fn run_bounded(
    cmd: &mut std::process::Command,
    limit: std::time::Duration,
) -> std::process::Output {
    use std::io::Read;
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let out_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let err_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} did not finish within {limit:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    std::process::Output {
        status,
        stdout: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
    }
}

/// A finished command's status, stdout and stderr, for assertion messages.
pub fn output_text(o: &std::process::Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
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

/// Pids of a launcher's children, by the rank in their environment.
pub fn children_by_rank(launcher_pid: u32) -> Vec<(usize, u32)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Field 4 (after the parenthesised command) is the parent pid.
        let after = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
        let ppid: u32 = after
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        if ppid != launcher_pid {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let rank = env
            .split(|&b| b == 0)
            .find_map(|kv| kv.strip_prefix(b"RANK="))
            .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok());
        if let Some(rank) = rank {
            found.push((rank, pid));
        }
    }
    found
}

/// Sends `signal` (a name `kill` knows, as `TERM` or `KILL`) to process `pid`; fails the test if
/// `kill` cannot.
pub fn send_signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .expect("running kill");
    assert!(status.success(), "kill -{signal} {pid} failed: {status}");
}

/// Whether process `pid` exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit_once(')')
                .map(|x| x.1)
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
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
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (builder, f) = (&builder, &f);
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
                    f(builder().process_state(state).build().unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A TCP port on loopback that was free a moment ago (the listener that found it is closed), for
/// a store that a test's ranks host themselves.
pub fn free_port() -> u16 {
    free_ports(1)
}

/// The first of `n` consecutive loopback ports that were free a moment ago and that no other test
/// of this process has been given: tests run in parallel threads, and two that found the same
/// free port (or one the other's store takes at port + 1) would join each other's jobs.
fn free_ports(n: u16) -> u16 {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let first = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("binding a loopback port")
            .local_addr()
            .expect("a bound address")
            .port();
        let Some(last) = first.checked_add(n - 1) else {
            continue;
        };
        let ports = first..=last;
        let free = ports.clone().all(|p| {
            !given.contains(&p)
                && (p == first || std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        });
        if free {
            given.extend(ports);
            return first;
        }
    }
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
