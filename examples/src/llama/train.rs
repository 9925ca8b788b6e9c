//! The training loop of the llama workload, shared by the `llama` example (every parameter
//! trained) and the `lora` example (adapters trained over a frozen base): what differs between
//! them is which parameters they build and prepare, and what they write at the end.
//!
//! The loss is transformers' causal-LM loss with `labels = input_ids`. Accumulation is
//! item-weighted: before each accumulation window the loop tells the accelerator how many tokens
//! this rank's part of the window predicts, and passes `backward` the *sum* of token
//! cross-entropies; the gradient is then that of one batch holding the whole window on all ranks,
//! averaged per predicted token.
//!
//! The evaluation split (`--eval-fraction`) holds out rows; its loss is the mean over all
//! predicted tokens of the held-out rows.

use std::sync::Arc;

use accelerate_core::data::DataLoader;
use accelerate_core::optim::{LrScheduler, Optimizer, Schedule};
use accelerate_core::Accelerator;
use anyhow::Result;
use candle_core::Var;
use candle_nn::VarMap;

use super::cli::{check_flags, data_and_config, LlamaArgs};
use super::config::LlamaConfig;
use super::data::{RowBatch, TokenRows};
use super::model::Llama;
use crate::run::{
    self, per_row_cross_entropy, sample_rows, Evaluator, OptimizerFlags, OptimizerKind, RunMonitor,
    StepCounts, Subset,
};

/// A run of the llama workload between its flags and its training: flags checked, data read,
/// model size known, accelerator built. Build and prepare the model with [`Self::acc`], then
/// [`train`](Self::train) it.
#[derive(Debug)]
pub struct LlamaRun<'a> {
    args: &'a LlamaArgs,
    /// The run's accelerator (configured by the flags, seeded with --seed).
    pub acc: Accelerator,
    /// The model's size (from --config, or from the size flags and the data's vocabulary).
    pub config: LlamaConfig,
    dataset: TokenRows,
    source: String,
    after_resume: Option<AfterResume<'a>>,
}

/// A check of what `--resume` loaded (see [`LlamaRun::check_after_resume`]).
struct AfterResume<'a>(Box<ResumeCheckFn<'a>>);

/// The function of an [`AfterResume`].
type ResumeCheckFn<'a> = dyn FnOnce(&Accelerator) -> Result<()> + 'a;

impl std::fmt::Debug for AfterResume<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AfterResume")
    }
}

impl<'a> LlamaRun<'a> {
    /// Checks `args`, reads the data, and builds the accelerator.
    pub fn start(args: &'a LlamaArgs) -> Result<Self> {
        check_flags(args)?;
        let (dataset, config, source) = data_and_config(args)?;
        let acc = args.run.accelerator(args.seed)?;
        Ok(Self {
            args,
            acc,
            config,
            dataset,
            source,
            after_resume: None,
        })
    }

    /// Runs `check` on every rank once the training loop has loaded --resume's checkpoint (or
    /// found none), before the first step: an error ends the run. The `lora` example refuses a
    /// checkpoint of other adapters or another base with it, comparing what it registered for
    /// checkpointing.
    pub fn check_after_resume(&mut self, check: impl FnOnce(&Accelerator) -> Result<()> + 'a) {
        self.after_resume = Some(AfterResume(Box::new(check)));
    }

    /// The model of the flags' size in a fresh `VarMap`, in the accelerator's compute dtype
    /// (bf16/f16 under mixed precision; `prepare` returns the f32 masters), on its device, with
    /// the weights seeded by --seed (see [`super::init_weights`]), and the layers under
    /// activation checkpointing with --gradient-checkpointing.
    pub fn build_model(&self) -> Result<(VarMap, Llama)> {
        let acc = &self.acc;
        let (varmap, mut model) = super::model::build_in(
            self.config,
            self.args.seed,
            acc.device(),
            acc.compute_dtype(),
        )?;
        model.set_gradient_checkpointing(self.args.gradient_checkpointing);
        Ok((varmap, model))
    }

    /// Prints where the data comes from and the model's size on the main process; `parameters`
    /// says how many there are (and, for a model with frozen ones, how many are trained).
    pub fn announce(&self, parameters: &str) {
        let (acc, config) = (&self.acc, &self.config);
        acc.print(format!("data: {}", self.source));
        acc.print(format!(
            "model: {} layers, hidden {}, {} heads ({} key/value), head_dim {}, intermediate {}, \
             vocabulary {}, {parameters}, gradient checkpointing {}",
            config.num_hidden_layers,
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.intermediate_size,
            config.vocab_size,
            if self.args.gradient_checkpointing {
                "on"
            } else {
                "off"
            }
        ));
    }

    /// Trains `model`, whose trained parameters `acc.prepare` returned as `params` (the f32
    /// masters under mixed precision), with the optimizer, schedule and stopping rule of the
    /// flags; prints the summary line and returns the accelerator for what the caller writes.
    pub fn train(self, model: &Llama, params: Vec<(String, Var)>) -> Result<Accelerator> {
        let Self {
            args,
            mut acc,
            dataset,
            after_resume,
            ..
        } = self;
        let row_len = dataset.row_len();
        let (dataset, eval_split) =
            run::hold_out(dataset, args.run.eval_fraction(), args.seed, "rows")?;
        let loader = DataLoader::new(Arc::new(dataset), args.batch_size)
            .shuffle(!args.no_shuffle)
            .seed(args.seed);
        let loader = acc.prepare(loader)?;
        let evaluator = Evaluator::prepare(
            &mut acc,
            eval_split,
            args.batch_size,
            "rows",
            Some("tokens"),
        )?;
        // --max-steps alone runs its steps whatever the size of the data (a benchmark's way to
        // call it), rather than stopping at the end of one epoch.
        let epochs = args.epochs.unwrap_or_else(|| {
            let per_epoch = acc.num_update_steps(loader.len()).max(1) as u64;
            args.run
                .max_steps
                .map_or(1, |m| m.div_ceil(per_epoch).max(1) as usize)
        });
        let total_steps = args.run.total_steps(&acc, loader.len(), epochs);
        let schedule = args.run.schedule(total_steps);
        let training = Training {
            args,
            acc,
            model,
            loader,
            evaluator,
            schedule,
            total_steps,
            epochs,
            row_len,
            after_resume,
        };
        let opt = args.optimizer.build(
            params,
            OptimizerFlags {
                lr: args.lr.unwrap_or(match args.optimizer {
                    OptimizerKind::Adamw => 3e-3,
                    OptimizerKind::Sgd => 0.1,
                }),
                momentum: args.momentum,
                weight_decay: args.weight_decay,
            },
        )?;
        training.train_with(opt)
    }
}

/// Everything a run needs but the optimizer, which --optimizer picks.
struct Training<'a> {
    args: &'a LlamaArgs,
    acc: Accelerator,
    model: &'a Llama,
    loader: DataLoader<Subset<TokenRows>>,
    evaluator: Evaluator<TokenRows>,
    schedule: Schedule,
    total_steps: u64,
    epochs: usize,
    row_len: usize,
    after_resume: Option<AfterResume<'a>>,
}

impl Training<'_> {
    /// Prepares `opt` and trains with it.
    fn train_with(self, opt: Box<dyn Optimizer + Send>) -> Result<Accelerator> {
        let Training {
            args,
            mut acc,
            model,
            mut loader,
            mut evaluator,
            schedule,
            total_steps,
            epochs,
            row_len,
            after_resume,
        } = self;
        let mut opt = acc.prepare_optimizer(opt)?;
        let mut sched = acc.prepare(LrScheduler::new(opt.learning_rate_handle(), schedule)?)?;
        args.run.resume_if_asked(&acc, &loader)?;
        if let Some(AfterResume(check)) = after_resume {
            check(&acc)?;
        }
        let mut monitor = RunMonitor::start(
            &acc,
            args.metrics.as_deref(),
            total_steps,
            args.run.logging_steps(),
        )?;
        run::announce_training(&acc, "", args.batch_size, total_steps);

        let k = acc.gradient_accumulation_steps();
        'epochs: for _epoch in loader.next_epoch()..epochs as u64 {
            if args.run.reached_max_steps(acc.optimizer_steps()) {
                break;
            }
            for window in loader.windows(k) {
                let window = window?;
                // This rank's predicted tokens in the whole window, before its first backward.
                let window_items: usize = window.iter().map(|b| b.predicted).sum();
                acc.set_window_items(window_items)?;
                let mut window_samples = 0usize;
                for batch in window {
                    let step = acc.accumulate();
                    let loss = model.summed_causal_lm_loss(&batch.input_ids)?;
                    acc.backward(&loss)?;
                    monitor.micro_step(&loss)?;
                    window_samples += batch.input_ids.dims()[0];
                    monitor.grad_norm(args.run.clip_if_syncing(&acc)?);
                    let lr = run::step_optimizer(&mut opt, &mut sched)?;
                    if !step.sync {
                        continue;
                    }
                    // The loss per predicted token of the whole global batch; tokens/s counts
                    // every position of every row the model read, as language-model training
                    // counts them.
                    let n = acc.optimizer_steps();
                    let counts = StepCounts {
                        items: window_items as f64,
                        samples: window_samples as f64,
                        tokens: (window_samples * row_len) as f64,
                    };
                    monitor.end_step(&acc, n, lr, counts)?;
                    if args.run.eval_due(n) {
                        evaluator.evaluate(&acc, n, |batch| eval_rows(model, batch))?;
                    }
                    if args.run.end_of_step(&acc, n)? {
                        break 'epochs;
                    }
                }
            }
        }
        let totals = monitor.finish(&acc)?;
        evaluator.at_end(&acc, acc.optimizer_steps(), |batch| eval_rows(model, batch))?;
        acc.end_training()?;
        let wall = totals.wall;
        let sync = acc.gradient_sync_stats();
        acc.print(format!(
            "samples/s={:.1} tokens/s={:.0} final_loss={:.6} wall={:.2}s steps={} \
             micro_steps={} grad_all_reduces={} mixed_precision={} skipped_steps={}{}",
            totals.samples / wall,
            totals.tokens / wall,
            totals.last_loss,
            wall,
            acc.optimizer_steps(),
            totals.micro_steps,
            sync.all_reduces,
            acc.mixed_precision(),
            totals.skipped_steps,
            evaluator.summary_fields()
        ));
        Ok(acc)
    }
}

/// One evaluation row per row of `batch`: the summed causal-LM loss of its predicted tokens and
/// their number (`T - 1`).
fn eval_rows(model: &Llama, batch: RowBatch) -> anyhow::Result<candle_core::Tensor> {
    let logits = model.forward(&batch.input_ids)?;
    let (b, t, v) = logits.dims3()?;
    let predicting = logits.narrow(1, 0, t - 1)?.reshape((b * (t - 1), v))?;
    let targets = batch.input_ids.narrow(1, 1, t - 1)?.flatten_all()?;
    let summed = per_row_cross_entropy(&predicting, &targets)?
        .reshape((b, t - 1))?
        .sum(1)?;
    let predicted = candle_core::Tensor::full((t - 1) as f32, b, logits.device())?;
    sample_rows(&[&summed, &predicted])
}
