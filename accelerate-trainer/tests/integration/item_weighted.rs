//! Item-weighted losses through the Trainer: a tagger whose samples hold a varying number of
//! tokens that count (the others are padding), whose per-sample losses are sums over those
//! tokens, and whose `num_items` counts them. On 1 and 2 ranks the Trainer gives bitwise the
//! parameters of an Accelerator loop written out here with `loader.windows(K)`,
//! `set_window_items` and summed losses; and its first step follows the gradient of one batch
//! holding the whole window, the sum of the token losses over the total token count.

use std::path::Path;
use std::sync::Arc;

use crate::common::{
    equivalence_args, named, ranks_as_threads, reference_adamw, tiny, values, Tiny, CLASSES, INPUTS,
};
use accelerate_core::data::{DataLoader, TensorDataset};
use accelerate_core::optim::{LrScheduler, Schedule};
use accelerate_core::AcceleratorBuilder;
use accelerate_trainer::{ModelOutput, SchedulerType, Trainer, TrainerModel, TrainingArguments};
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const SEED: u64 = 5;
/// Token positions per sample.
const POSITIONS: usize = 4;
/// The label of a padding position: it does not count.
const PADDING: u32 = CLASSES as u32;

/// Tags every position of a sample with the tiny classifier.
struct Tagger(Tiny);

impl Tagger {
    /// Per-sample sums of the token losses over the positions that count, and the counts.
    fn losses(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let counts = y.lt(PADDING)?;
        let labels = counts.where_cond(y, &y.zeros_like()?)?;
        let log_probs = candle_nn::ops::log_softmax(&self.0.logits(x)?, 2)?;
        let token_losses = log_probs
            .gather(&labels.unsqueeze(2)?, 2)?
            .squeeze(2)?
            .neg()?;
        let counts = counts.to_dtype(DType::F32)?;
        Ok(((token_losses * &counts)?.sum(1)?, counts.sum(1)?))
    }
}

impl TrainerModel<(Tensor, Tensor)> for Tagger {
    fn forward(&self, (x, y): &(Tensor, Tensor)) -> candle_core::Result<ModelOutput> {
        let (losses, items) = self.losses(x, y)?;
        Ok(ModelOutput {
            items: Some(items),
            ..ModelOutput::losses(losses)
        })
    }

    fn num_items(&self, (_, y): &(Tensor, Tensor)) -> candle_core::Result<Option<usize>> {
        let counts = y.lt(PADDING)?.to_dtype(DType::U32)?.sum_all()?;
        Ok(Some(counts.to_scalar::<u32>()? as usize))
    }
}

/// `n` seeded samples: x `[n, 4, 6]`, labels `[n, 4]` of which the first 1 to 4 positions count
/// (learnable classes) and the rest are padding.
fn tokens(n: usize, seed: u64) -> (Tensor, Tensor) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let x: Vec<f32> = (0..n * POSITIONS * INPUTS)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let mut y = Vec::with_capacity(n * POSITIONS);
    for sample in x.chunks(POSITIONS * INPUTS) {
        let counted = rng.random_range(1..=POSITIONS);
        for (position, r) in sample.chunks(INPUTS).enumerate() {
            let s = [r[0] - r[3], r[1] + r[4], r[2] - r[5]];
            let class = (0..3).max_by(|&a, &b| s[a].total_cmp(&s[b])).unwrap() as u32;
            y.push(if position < counted { class } else { PADDING });
        }
    }
    (
        Tensor::from_vec(x, (n, POSITIONS, INPUTS), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, (n, POSITIONS), &Device::Cpu).unwrap(),
    )
}

fn token_dataset(n: usize) -> Arc<TensorDataset> {
    let (x, y) = tokens(n, 8);
    Arc::new(TensorDataset::new(x, y).unwrap())
}

/// 50 samples in batches of 4, windows of 3 (1 rank: 13 batches, 5 steps per epoch; 2 ranks: 7
/// batches each, 3 steps per epoch): the settings of [`equivalence_args`].
const SAMPLES: usize = 50;

/// One rank of the item-weighted Accelerator loop of `args`: windows of K batches, the window's
/// token count declared before its first backward pass, summed losses.
fn accelerator_loop(
    builder: AcceleratorBuilder,
    args: &TrainingArguments,
) -> Vec<(String, Vec<f32>)> {
    let k = args.gradient_accumulation_steps;
    let mut acc = builder
        .gradient_accumulation_steps(k)
        .seed(args.seed)
        .build()
        .unwrap();
    let (varmap, tiny) = tiny(SEED);
    let model = Tagger(tiny);
    let params = acc.prepare(&varmap).unwrap();
    let mut opt = reference_adamw(&mut acc, params, args);
    let loader = DataLoader::new(token_dataset(SAMPLES), args.per_device_train_batch_size)
        .shuffle(true)
        .seed(args.seed);
    let mut loader = acc.prepare(loader).unwrap();
    assert_ne!(loader.len() % k, 0, "a short last window");
    let total = acc.num_update_steps(loader.len()) * 2;
    let schedule = Schedule::LinearWarmupDecay {
        warmup_steps: 2,
        total_steps: total,
    };
    let mut sched = acc
        .prepare(LrScheduler::new(opt.learning_rate_handle(), schedule).unwrap())
        .unwrap();
    let mut window_counts = Vec::new();
    for _epoch in 0..2 {
        for window in loader.windows(k) {
            let batches = window.unwrap();
            let items: usize = batches
                .iter()
                .map(|b| model.num_items(b).unwrap().unwrap())
                .sum();
            window_counts.push(items);
            acc.set_window_items(items).unwrap();
            for (x, y) in &batches {
                let _step = acc.accumulate();
                let loss = model.losses(x, y).unwrap().0.sum_all().unwrap();
                acc.backward(&loss).unwrap();
                if acc.sync_gradients() {
                    acc.clip_grad_norm(args.max_grad_norm).unwrap();
                }
                opt.step().unwrap();
                sched.step();
                opt.zero_grad();
            }
        }
    }
    assert_eq!(acc.optimizer_steps(), total as u64);
    window_counts.sort();
    window_counts.dedup();
    assert!(
        window_counts.len() > 2,
        "token counts vary: {window_counts:?}"
    );
    values(&varmap)
}

fn trainer_run(builder: AcceleratorBuilder, args: TrainingArguments) -> Vec<(String, Vec<f32>)> {
    let mut trainer = Trainer::with_accelerator(args, builder).unwrap();
    let (varmap, tiny) = tiny(SEED);
    trainer
        .train(&Tagger(tiny), &varmap, token_dataset(SAMPLES), None)
        .unwrap();
    values(&varmap)
}

#[test]
fn item_weighted_training_gives_the_accelerator_loop_bitwise_on_1_and_2_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let mut per_world = Vec::new();
    for ranks in [1, 2] {
        let out = dir.path().join(format!("out-{ranks}"));
        let expected = ranks_as_threads(ranks, |b| {
            accelerator_loop(b, &equivalence_args(&out, SEED))
        });
        let trained = ranks_as_threads(ranks, |b| trainer_run(b, equivalence_args(&out, SEED)));
        for rank in 0..ranks {
            assert_eq!(trained[rank], expected[0], "{ranks} ranks, rank {rank}");
            assert_eq!(expected[rank], expected[0], "{ranks} ranks, rank {rank}");
        }
        per_world.push(expected[0].clone());
    }
    assert_ne!(
        per_world[0],
        values(&tiny(SEED).0),
        "training moved the parameters"
    );
}

/// Arguments under which one optimizer step is a plain gradient step: AdamW with β1 = β2 = 0
/// and an epsilon far above |g| divides the gradient by epsilon (`|g| + 1e8` is 1e8 in f32), so
/// the update is `-(lr / eps) g = -0.1 g`; no decay, no clipping, a constant rate, one step.
fn gradient_step_args(output_dir: &Path, accumulation: usize) -> TrainingArguments {
    TrainingArguments {
        output_dir: output_dir.to_path_buf(),
        per_device_train_batch_size: 4,
        gradient_accumulation_steps: accumulation,
        learning_rate: 1e7,
        adam_beta1: 0.0,
        adam_beta2: 0.0,
        adam_epsilon: 1e8,
        weight_decay: 0.0,
        max_grad_norm: 0.0,
        lr_scheduler_type: SchedulerType::Constant,
        max_steps: Some(1),
        seed: SEED,
        disable_tqdm: true,
        ..Default::default()
    }
}

/// The gradient of the mean token loss of the whole set in one batch: the sum of every counted
/// token's loss over the number of counted tokens.
fn whole_window_gradient(samples: usize) -> Vec<(String, Vec<f32>)> {
    let (varmap, tiny) = tiny(SEED);
    let (x, y) = tokens(samples, 8);
    let (losses, items) = Tagger(tiny).losses(&x, &y).unwrap();
    let loss = (losses.sum_all().unwrap()
        / items.sum_all().unwrap().to_scalar::<f32>().unwrap() as f64)
        .unwrap();
    let grads = loss.backward().unwrap();
    named(&varmap)
        .into_iter()
        .map(|(name, var)| {
            let g = grads.get(var.as_tensor()).unwrap();
            (name, g.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        })
        .collect()
}

#[test]
fn the_first_step_follows_the_gradient_of_one_batch_holding_the_whole_window() {
    // 24 samples, batches of 4: one window holds the whole set on 1 rank (K = 6) and on 2 ranks
    // (K = 3 each), whatever the shuffle; their batches hold different token counts.
    const WHOLE: usize = 24;
    let gradient = whole_window_gradient(WHOLE);
    let before = values(&tiny(SEED).0);
    let dir = tempfile::tempdir().unwrap();
    for (ranks, k) in [(1, 6), (2, 3)] {
        let out = dir.path().join(format!("out-{ranks}"));
        let trained = ranks_as_threads(ranks, |builder| {
            let mut trainer =
                Trainer::with_accelerator(gradient_step_args(&out, k), builder).unwrap();
            let (varmap, tiny) = tiny(SEED);
            let model = Tagger(tiny);
            let out = trainer
                .train(&model, &varmap, token_dataset(WHOLE), None)
                .unwrap();
            assert_eq!(out.global_step, 1);
            values(&varmap)
        });
        for (rank, after) in trained.iter().enumerate() {
            for (((name, p0), (_, p1)), (_, g)) in before.iter().zip(after).zip(&gradient) {
                for i in 0..g.len() {
                    let (moved, expected) = (p1[i] - p0[i], -0.1 * g[i]);
                    assert!(
                        (moved - expected).abs() <= 1e-6 + 1e-4 * expected.abs(),
                        "{ranks} ranks, rank {rank}, {name}[{i}]: moved {moved}, expected {expected}"
                    );
                }
            }
        }
    }
}
