//! Shared pieces of the Trainer's tests: a tiny seeded classifier, seeded data, and ranks that
//! are threads of the test process.

use std::sync::Arc;

use accelerate_core::data::TensorDataset;
use accelerate_core::{AcceleratorBuilder, Launcher, ProcessState};
use accelerate_test_support::{free_ports, tiny_mlp, TinyMlp, TINY_CLASSES, TINY_IN};
use accelerate_trainer::{ModelOutput, TrainerModel};
use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Inputs and classes of the tiny classifier (the workspace's shared tiny model).
pub const INPUTS: usize = TINY_IN;
pub const CLASSES: usize = TINY_CLASSES;

/// The parameters of a `VarMap`, sorted by name.
pub use accelerate_test_support::named_vars as named;

/// The workspace's tiny classifier (6 → 8 (tanh) → 3, PyTorch names `l1.weight`, `l1.bias`,
/// `l2.weight`, `l2.bias`) as a [`TrainerModel`].
pub struct Tiny(TinyMlp);

impl Tiny {
    pub fn logits(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(x)
    }
}

/// Per-sample cross-entropy, written out: `-log_softmax(logits)[label]`.
pub fn per_sample_loss(logits: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    let log_probs = candle_nn::ops::log_softmax(logits, 1)?;
    log_probs.gather(&y.unsqueeze(1)?, 1)?.squeeze(1)?.neg()
}

impl TrainerModel<(Tensor, Tensor)> for Tiny {
    fn forward(&self, (x, y): &(Tensor, Tensor)) -> candle_core::Result<ModelOutput> {
        let logits = self.logits(x)?;
        Ok(ModelOutput::losses(per_sample_loss(&logits, y)?).with_predictions(logits, y.clone()))
    }
}

/// The tiny model with seeded weights in U(-0.5, 0.5).
pub fn tiny(seed: u64) -> (VarMap, Tiny) {
    let (varmap, model) = tiny_mlp(seed).unwrap();
    (varmap, Tiny(model))
}

/// Every parameter's values, sorted by name.
pub fn values(varmap: &VarMap) -> Vec<(String, Vec<f32>)> {
    named(varmap)
        .into_iter()
        .map(|(n, v)| (n, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// Seeded data: x `[n, 6]` in [-1, 1), labels the argmax of a fixed linear map (learnable).
pub fn data(n: usize, seed: u64) -> (Tensor, Tensor) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let x: Vec<f32> = (0..n * INPUTS)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let y: Vec<u32> = x
        .chunks(INPUTS)
        .map(|r| {
            let s = [r[0] - r[3], r[1] + r[4], r[2] - r[5]];
            (0..3).max_by(|&a, &b| s[a].total_cmp(&s[b])).unwrap() as u32
        })
        .collect();
    (
        Tensor::from_vec(x, (n, INPUTS), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, n, &Device::Cpu).unwrap(),
    )
}

/// A dataset of `n` seeded samples.
pub fn dataset(n: usize, seed: u64) -> Arc<TensorDataset> {
    let (x, y) = data(n, seed);
    Arc::new(TensorDataset::new(x, y).unwrap())
}

/// Runs `f` on `n` ranks that are threads of this process (joined as under torchrun, rank 0
/// hosting the store on loopback) and returns each rank's result in rank order.
pub fn ranks_as_threads<R: Send>(n: usize, f: impl Fn(AcceleratorBuilder) -> R + Sync) -> Vec<R> {
    ranks_as_threads_knowing_rank(n, |_, builder| f(builder))
}

/// [`ranks_as_threads`] with each rank's index passed to `f` (for ranks that see different
/// files, as machines that do not share a directory do).
pub fn ranks_as_threads_knowing_rank<R: Send>(
    n: usize,
    f: impl Fn(usize, AcceleratorBuilder) -> R + Sync,
) -> Vec<R> {
    // The job's port and the store's, p + 1.
    let port = free_ports(2);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let f = &f;
                scope.spawn(move || {
                    let state = ProcessState {
                        rank,
                        world_size: n,
                        local_rank: rank,
                        local_world_size: n,
                        master_addr: "127.0.0.1".into(),
                        master_port: port,
                        job_token: format!("trainer-test-{port}"),
                        restart_count: 0,
                        launcher: Launcher::Torchrun,
                    };
                    f(
                        rank,
                        accelerate_core::Accelerator::builder().process_state(state),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The reference loops' optimizer, written out apart from the Trainer: AdamW with PyTorch's
/// betas and epsilon, weight decay on the weights and none on the biases (Hugging Face's split),
/// prepared on `acc`.
pub fn reference_adamw(
    acc: &mut accelerate_core::Accelerator,
    params: Vec<(String, candle_core::Var)>,
    args: &accelerate_trainer::TrainingArguments,
) -> accelerate_core::PreparedOptimizer<accelerate_core::optim::AdamW> {
    use accelerate_core::optim::{split_decay, AdamW, AdamWConfig, ParamGroup};
    let split = split_decay(params);
    let config = |weight_decay| AdamWConfig {
        lr: args.learning_rate,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay,
    };
    let opt = AdamW::with_groups(vec![
        ParamGroup::new(split.decay, config(args.weight_decay)),
        ParamGroup::new(split.no_decay, config(0.0)),
    ])
    .unwrap();
    acc.prepare(opt).unwrap()
}

/// Stops the loop after `step`, as a kill after that checkpoint would.
pub struct StopAt(pub u64);

impl accelerate_trainer::TrainerCallback for StopAt {
    fn on_step_end(
        &mut self,
        _: &accelerate_trainer::TrainingArguments,
        s: &accelerate_trainer::TrainerState,
        c: &mut accelerate_trainer::TrainerControl,
    ) {
        c.should_training_stop |= s.global_step == self.0;
    }
}

/// The settings of the equivalence tests, for both the Trainer and the reference loops:
/// batches of 4 accumulated over 3, weight decay on the weights only, 2 warm-up steps of a
/// linear schedule, clipping that bites, 2 epochs.
pub fn equivalence_args(
    output_dir: &std::path::Path,
    seed: u64,
) -> accelerate_trainer::TrainingArguments {
    accelerate_trainer::TrainingArguments {
        output_dir: output_dir.to_path_buf(),
        per_device_train_batch_size: 4,
        gradient_accumulation_steps: 3,
        learning_rate: 0.05,
        weight_decay: 0.1,
        max_grad_norm: 0.3,
        num_train_epochs: 2.0,
        warmup_steps: 2,
        seed,
        disable_tqdm: true,
        ..Default::default()
    }
}

/// What one rank of [`reference_loop`] ended with.
pub struct ReferenceRun {
    /// The parameters, by name.
    pub params: Vec<(String, Vec<f32>)>,
    /// Optimizer steps whose gradient clipping scaled down.
    pub clipped: usize,
    /// Batches of one epoch on this rank.
    pub batches: usize,
    /// Optimizer steps taken (also the length of the schedule).
    pub steps: u64,
}

/// One rank of the Accelerator loop of `args`, written out apart from the Trainer: the tiny
/// classifier seeded `seed` on `dataset(samples, 1)`, the mean per-sample cross-entropy,
/// [`reference_adamw`], a linear warm-up schedule over every step of the run, clipping on sync
/// micro-steps.
pub fn reference_loop(
    builder: AcceleratorBuilder,
    args: &accelerate_trainer::TrainingArguments,
    seed: u64,
    samples: usize,
) -> ReferenceRun {
    use accelerate_core::data::DataLoader;
    use accelerate_core::optim::{split_decay, LrScheduler, Schedule};
    let mut acc = builder
        .gradient_accumulation_steps(args.gradient_accumulation_steps)
        .seed(args.seed)
        .build()
        .unwrap();
    let (varmap, model) = tiny(seed);
    let params = acc.prepare(&varmap).unwrap();
    assert_eq!(
        split_decay(params.clone()).no_decay.len(),
        2,
        "the biases take no weight decay"
    );
    let mut opt = reference_adamw(&mut acc, params, args);
    let loader = DataLoader::new(dataset(samples, 1), args.per_device_train_batch_size)
        .shuffle(true)
        .seed(args.seed);
    let mut loader = acc.prepare(loader).unwrap();
    let epochs = args.num_train_epochs as usize;
    let total = acc.num_update_steps(loader.len()) * epochs;
    let schedule = Schedule::LinearWarmupDecay {
        warmup_steps: args.warmup_steps,
        total_steps: total,
    };
    let mut sched = acc
        .prepare(LrScheduler::new(opt.learning_rate_handle(), schedule).unwrap())
        .unwrap();
    let mut clipped = 0;
    for _epoch in 0..epochs {
        for batch in loader.iter() {
            let (x, y) = batch.unwrap();
            let _step = acc.accumulate();
            let loss = per_sample_loss(&model.logits(&x).unwrap(), &y)
                .unwrap()
                .mean_all()
                .unwrap();
            acc.backward(&loss).unwrap();
            if acc.sync_gradients() {
                let norm = acc.clip_grad_norm(args.max_grad_norm).unwrap().unwrap();
                clipped += usize::from(norm > args.max_grad_norm);
            }
            opt.step().unwrap();
            sched.step();
            opt.zero_grad();
        }
    }
    assert_eq!(acc.optimizer_steps(), total as u64);
    ReferenceRun {
        params: values(&varmap),
        clipped,
        batches: loader.len(),
        steps: total as u64,
    }
}
