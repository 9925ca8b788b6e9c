//! The Trainer on 2 ranks (threads of this process) against the equivalent Accelerator loop,
//! written out here, on the same 2 thread-ranks: the same parameters bit for bit.

mod common;

use std::path::Path;

use accelerate_core::data::DataLoader;
use accelerate_core::optim::{split_decay, LrScheduler, Schedule};
use accelerate_core::AcceleratorBuilder;
use accelerate_trainer::{Trainer, TrainingArguments};
use common::{dataset, per_sample_loss, ranks_as_threads, reference_adamw, tiny, values};

const SEED: u64 = 23;
const RANKS: usize = 2;
/// 50 samples, 25 per rank, batches of 4: 7 batches per rank and epoch, in windows of 3
/// (3, 3, 1), so 3 optimizer steps per epoch, 6 in 2 epochs.
const SAMPLES: usize = 50;
const STEPS: usize = 6;

/// Accumulation over 3 batches, decay on the weights only, 2 warm-up steps of a linear
/// schedule, clipping that bites.
fn args(output_dir: &Path) -> TrainingArguments {
    TrainingArguments {
        output_dir: output_dir.to_path_buf(),
        per_device_train_batch_size: 4,
        gradient_accumulation_steps: 3,
        learning_rate: 0.05,
        weight_decay: 0.1,
        max_grad_norm: 0.3,
        num_train_epochs: 2.0,
        warmup_steps: 2,
        seed: SEED,
        disable_tqdm: true,
        ..Default::default()
    }
}

/// One rank of the Accelerator loop of `args`; returns the parameters and how many optimizer
/// steps clipping scaled down.
fn accelerator_loop(
    builder: AcceleratorBuilder,
    args: &TrainingArguments,
) -> (Vec<(String, Vec<f32>)>, usize) {
    let mut acc = builder
        .gradient_accumulation_steps(args.gradient_accumulation_steps)
        .seed(args.seed)
        .build()
        .unwrap();
    assert_eq!(acc.num_processes(), RANKS);
    let (varmap, model) = tiny(SEED);
    let params = acc.prepare(&varmap).unwrap();
    assert_eq!(
        split_decay(params.clone()).no_decay.len(),
        2,
        "the biases take no weight decay"
    );
    let mut opt = reference_adamw(&mut acc, params, args);
    let loader = DataLoader::new(dataset(SAMPLES, 1), args.per_device_train_batch_size)
        .shuffle(true)
        .seed(args.seed);
    let mut loader = acc.prepare(loader).unwrap();
    assert_eq!(
        loader.len(),
        7,
        "a batch count per rank that 3 does not divide"
    );
    let schedule = Schedule::LinearWarmupDecay {
        warmup_steps: 2,
        total_steps: STEPS,
    };
    let mut sched = acc
        .prepare(LrScheduler::new(opt.learning_rate_handle(), schedule).unwrap())
        .unwrap();
    let mut clipped = 0;
    for _epoch in 0..2 {
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
    assert_eq!(acc.optimizer_steps(), STEPS as u64);
    (values(&varmap), clipped)
}

#[test]
fn on_two_ranks_the_trainer_gives_the_parameters_of_the_accelerator_loop_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let reference = ranks_as_threads(RANKS, |builder| {
        accelerator_loop(builder, &args(&dir.path().join("unused")))
    });
    let (expected, clipped) = reference[0].clone();
    assert!(clipped > 0, "the settings must make clipping act");
    assert_eq!(
        reference[1].0, expected,
        "the ranks hold the same parameters"
    );

    let trained = ranks_as_threads(RANKS, |builder| {
        let mut trainer =
            Trainer::with_accelerator(args(&dir.path().join("out")), builder).unwrap();
        let (varmap, model) = tiny(SEED);
        let before = values(&varmap);
        let out = trainer
            .train(&model, &varmap, dataset(SAMPLES, 1), None)
            .unwrap();
        assert_ne!(values(&varmap), before);
        (out.global_step, values(&varmap))
    });
    for (rank, (steps, params)) in trained.into_iter().enumerate() {
        assert_eq!(steps, STEPS as u64, "rank {rank}");
        assert_eq!(params, expected, "rank {rank}");
    }
}
