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
use accelerate_core::Accelerator;
use anyhow::{bail, Context, Result};
use candle_core::Var;
use candle_nn::VarMap;

use super::cli::{check_flags, data_and_config, LlamaArgs, RunData};
use super::config::LlamaConfig;
use super::data::{RowBatch, TokenRows};
use super::model::Llama;
use super::model_dir::{check_output_dir, ModelDir};
use crate::run::{
    self, per_row_cross_entropy, sample_rows, AfterResumeFn, BatchCounts, Evaluator, Subset,
    SummaryFields, TrainLoop,
};

/// A run of the llama workload between its flags and its training: flags checked, data read,
/// model size known, accelerator built. Build and prepare the model with [`Self::acc`], then
/// [`train`](Self::train) it.
#[derive(Debug)]
pub struct LlamaRun<'a> {
    args: &'a LlamaArgs,
    /// The run's accelerator (configured by the flags, seeded with --seed).
    pub acc: Accelerator,
    /// The model's size (from --model or --config, or from the size flags and the data's
    /// vocabulary).
    pub config: LlamaConfig,
    /// --model's directory, opened (its config read, its weights listed).
    pub model_dir: Option<ModelDir>,
    dataset: TokenRows,
    validation: Option<TokenRows>,
    source: String,
    after_resume: Option<AfterResume<'a>>,
}

/// A check of what `--resume` loaded (see [`LlamaRun::check_after_resume`]).
struct AfterResume<'a>(Box<AfterResumeFn<'a>>);

impl std::fmt::Debug for AfterResume<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AfterResume")
    }
}

impl<'a> LlamaRun<'a> {
    /// Checks `args`, opens --model, reads the data, builds the accelerator, and checks that
    /// --output-dir can be written (on the main process, every rank agreeing), so that a run
    /// does not end unable to save.
    pub fn start(args: &'a LlamaArgs) -> Result<Self> {
        check_flags(args)?;
        let model_dir = match &args.model {
            Some(dir) => {
                Some(ModelDir::open(dir).with_context(|| format!("--model {}", dir.display()))?)
            }
            None => None,
        };
        let RunData {
            train: dataset,
            validation,
            config,
            source,
        } = data_and_config(args, model_dir.as_ref().map(ModelDir::config))?;
        if validation.is_some() && args.run.eval_fraction.is_some() {
            bail!(
                "--eval-fraction and the data's evaluation split (--validation-file or \
                 --validation-split-percentage) both name the rows to evaluate on; keep one"
            );
        }
        let acc = args.run.accelerator(args.seed)?;
        if let Some(dir) = &args.output_dir {
            let checked = if acc.is_main_process() {
                check_output_dir(dir, args.overwrite_output_dir)
                    .map_err(|e| accelerate_core::Error::Config(format!("{e:#}")))
            } else {
                Ok(())
            };
            acc.agree_across_ranks(dir, "checking the output directory", checked)
                .with_context(|| format!("--output-dir {}", dir.display()))?;
        }
        Ok(Self {
            args,
            acc,
            config,
            model_dir,
            dataset,
            validation,
            source,
            after_resume: None,
        })
    }

    /// Sets `params` (the base model's, named as Hugging Face names them) to the initial weights
    /// of --model or --init-weights; does nothing without either (the seeded weights stay).
    pub fn load_initial_weights(&self, params: &[(String, Var)]) -> Result<()> {
        if let Some(model) = &self.model_dir {
            model
                .load_into(params)
                .with_context(|| format!("--model {}", model.dir().display()))?;
        } else if let Some(path) = &self.args.init_weights {
            accelerate_core::load_into_vars(path, params)
                .with_context(|| format!("--init-weights {}", path.display()))?;
        }
        Ok(())
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
            validation,
            after_resume,
            ..
        } = self;
        let row_len = dataset.row_len();
        let (dataset, eval_split) = match validation {
            Some(validation) => (Subset::whole(dataset), Some(Subset::whole(validation))),
            None => run::hold_out(dataset, args.run.eval_fraction(), args.seed, "rows")?,
        };
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
        let mut train = TrainLoop::new(
            &args.run,
            args.epochs,
            args.batch_size,
            |_, batch: &RowBatch| match &batch.segments {
                None => Ok(model.summed_causal_lm_loss(&batch.input_ids)?),
                Some(segments) => Ok(model.summed_segment_loss(&batch.input_ids, segments)?.0),
            },
            // The loss is per predicted token; tokens/s counts every position of every row the
            // model read, as language-model training counts them.
            move |batch: &RowBatch| BatchCounts {
                samples: batch.input_ids.dims()[0],
                items: Some(batch.predicted),
                tokens: batch.input_ids.dims()[0] * row_len,
            },
            |batch| eval_rows(model, batch),
        );
        train.metrics = args.metrics.as_deref();
        train.summary = SummaryFields {
            tokens_per_s: true,
            ..SummaryFields::default()
        };
        train.after_resume = after_resume.map(|AfterResume(check)| check);
        let opt = args.optimizer.build(params, super::cli::LR_DEFAULTS)?;
        train.run(&mut acc, loader, evaluator, opt)?;
        Ok(acc)
    }
}

/// One evaluation row per row of `batch`: the summed causal-LM loss of its predicted tokens and
/// their number (see [`row_losses`]).
fn eval_rows(model: &Llama, batch: RowBatch) -> anyhow::Result<candle_core::Tensor> {
    let (summed, predicted) = row_losses(model, &batch)?;
    sample_rows(&[&summed, &predicted])
}

/// Per row of `batch`: the summed causal-LM loss of its predicted tokens (`[B]` f32) and their
/// number (`[B]` f32: `T - 1`, or in packed rows those whose predecessor is of the same
/// document). What evaluation gathers and what the Trainer weights by.
pub fn row_losses(
    model: &Llama,
    batch: &RowBatch,
) -> anyhow::Result<(candle_core::Tensor, candle_core::Tensor)> {
    if let Some(segments) = &batch.segments {
        let summed = model.segment_loss_per_row(&batch.input_ids, segments)?;
        let counts: Vec<f32> = segments
            .predicted_per_row()
            .iter()
            .map(|&n| n as f32)
            .collect();
        let predicted = candle_core::Tensor::new(counts, batch.input_ids.device())?;
        return Ok((summed, predicted));
    }
    let logits = model.forward(&batch.input_ids)?;
    let (b, t, v) = logits.dims3()?;
    let predicting = logits.narrow(1, 0, t - 1)?.reshape((b * (t - 1), v))?;
    let targets = batch.input_ids.narrow(1, 1, t - 1)?.flatten_all()?;
    let summed = per_row_cross_entropy(&predicting, &targets)?
        .reshape((b, t - 1))?
        .sum(1)?;
    let predicted = candle_core::Tensor::full((t - 1) as f32, b, logits.device())?;
    Ok((summed, predicted))
}

/// The Trainer trains the llama model on the same rows as the loop: per-row sums of the
/// causal-LM loss, weighted by the predicted tokens of the whole accumulation window.
impl accelerate_trainer::TrainerModel<RowBatch> for Llama {
    fn forward(&self, batch: &RowBatch) -> candle_core::Result<accelerate_trainer::ModelOutput> {
        let (losses, items) =
            row_losses(self, batch).map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
        Ok(accelerate_trainer::ModelOutput {
            losses,
            items: Some(items),
            logits: None,
            labels: None,
        })
    }

    fn num_items(&self, batch: &RowBatch) -> candle_core::Result<Option<usize>> {
        Ok(Some(batch.predicted))
    }
}
