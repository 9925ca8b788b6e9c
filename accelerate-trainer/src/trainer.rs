//! [`Trainer`]: the training loop of Hugging Face's `Trainer` on the [`Accelerator`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use accelerate_core::data::{DataLoader, Dataset};
use accelerate_core::optim::{split_decay, AdamW, AdamWConfig, LrScheduler, ParamGroup};
use accelerate_core::{
    Accelerator, AcceleratorBuilder, PreparedOptimizer, PreparedScheduler, TRAIN_GRAD_NORM,
    TRAIN_LEARNING_RATE, TRAIN_LOSS,
};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;

use crate::args::{IntervalStrategy, ResumeFrom, SaveStrategy, TrainingArguments};
use crate::callbacks::TrainerCallback;
use crate::checkpoints;
use crate::control::TrainerControl;
use crate::error::{Error, Result};
use crate::evaluation::evaluate_loader;
use crate::model::{ComputeMetrics, EvalPrediction, Metrics, TrainerModel};
use crate::progress::Progress;
use crate::state::{TrainerState, TRAINER_STATE_NAME};
use crate::steps::micro_step;

/// Tag of the epoch in the trackers, as Hugging Face's `train/epoch`.
pub const TRAIN_EPOCH: &str = "train/epoch";

/// What [`Trainer::train`] returns (Hugging Face's `TrainOutput`).
#[derive(Debug, Clone, PartialEq)]
pub struct TrainOutput {
    /// Optimizer steps taken, counting those before a resume.
    pub global_step: u64,
    /// The mean training loss over the steps this call took (over every rank and sample).
    pub training_loss: f64,
    /// The metrics of the last evaluation (`eval_loss`, `eval_<metric>`), empty without one.
    pub metrics: Metrics,
}

/// Trains a [`TrainerModel`] on a dataset as Hugging Face's `Trainer` does, given
/// [`TrainingArguments`]: AdamW with weight decay on all but biases and norms, the schedule,
/// gradient accumulation, clipping, logging, evaluation, checkpoints and exact resume, on one
/// process or as one rank of an `accelerate-launch` job.
///
/// Build it first, then the model in [`compute_dtype`](Self::compute_dtype) on
/// [`device`](Self::device), then [`train`](Self::train); see the crate documentation.
pub struct Trainer {
    args: TrainingArguments,
    acc: Accelerator,
    callbacks: Vec<Box<dyn TrainerCallback>>,
    compute_metrics: Option<ComputeMetrics>,
    state: TrainerState,
}

/// The prepared pieces of one `train` call.
struct Prepared<D: Dataset> {
    params: Vec<(String, Var)>,
    opt: PreparedOptimizer<AdamW>,
    sched: PreparedScheduler,
    train: DataLoader<D>,
    eval: Option<DataLoader<D>>,
    /// Optimizer steps of the whole run.
    total: u64,
    /// Optimizer steps per epoch.
    steps_per_epoch: u64,
}

impl Trainer {
    /// A Trainer for `args` (validated), with its accelerator set up from them and the
    /// environment `accelerate-launch` gives each rank.
    pub fn new(args: TrainingArguments) -> Result<Self> {
        Self::with_accelerator(args, Accelerator::builder())
    }

    /// [`new`](Self::new) with an accelerator builder of the caller's (a device, a process
    /// state), to which the arguments add accumulation, mixed precision, seed and trackers.
    pub fn with_accelerator(args: TrainingArguments, builder: AcceleratorBuilder) -> Result<Self> {
        args.validate()?;
        let logging_dir = args
            .logging_dir
            .clone()
            .unwrap_or_else(|| args.output_dir.join("runs").join(run_name()));
        let mut builder = builder
            .gradient_accumulation_steps(args.gradient_accumulation_steps)
            .seed(args.seed)
            .report_to(args.report_to.0.iter().copied());
        // Unset, the builder's default applies: $ACCELERATE_MIXED_PRECISION, which
        // `accelerate-launch --mixed-precision` sets.
        if let Some(mode) = args.mixed_precision {
            builder = builder.mixed_precision(mode);
        }
        if !args.report_to.0.is_empty() {
            builder = builder.logging_dir(logging_dir);
        }
        let acc = builder.build()?;
        Ok(Self {
            args,
            acc,
            callbacks: Vec::new(),
            compute_metrics: None,
            state: TrainerState::default(),
        })
    }

    /// The device to build the model on.
    pub fn device(&self) -> &Device {
        self.acc.device()
    }

    /// The dtype to build the model in: f32, or bf16/f16 under mixed precision (the Trainer
    /// keeps f32 master weights).
    pub fn compute_dtype(&self) -> DType {
        self.acc.compute_dtype()
    }

    /// The accelerator underneath (rank, world size, printing on the main process).
    pub fn accelerator(&self) -> &Accelerator {
        &self.acc
    }

    /// The arguments of the run.
    pub fn args(&self) -> &TrainingArguments {
        &self.args
    }

    /// The state of the run: step, epoch, log history, best checkpoint.
    pub fn state(&self) -> &TrainerState {
        &self.state
    }

    /// Sets the function that turns the gathered evaluation predictions into metrics (Hugging
    /// Face's `compute_metrics`); the model's forward must then return logits and labels.
    pub fn compute_metrics(
        &mut self,
        f: impl FnMut(&EvalPrediction) -> candle_core::Result<Metrics> + 'static,
    ) -> &mut Self {
        self.compute_metrics = Some(Box::new(f));
        self
    }

    /// Adds a callback; callbacks run in the order they were added.
    pub fn add_callback(&mut self, callback: impl TrainerCallback + 'static) -> &mut Self {
        self.callbacks.push(Box::new(callback));
        self
    }

    /// Trains `model`, whose parameters are `params`, on `train`, evaluating on `eval` as
    /// `eval_strategy` says and at the end; saves checkpoints into `output_dir` as
    /// `save_strategy` says, and the final model as `output_dir/model.safetensors` with
    /// `trainer_state.json`. Call it once per Trainer, on every rank.
    pub fn train<D, M>(
        &mut self,
        model: &M,
        params: &VarMap,
        train: Arc<D>,
        eval: Option<Arc<D>>,
    ) -> Result<TrainOutput>
    where
        D: Dataset,
        M: TrainerModel<D::Batch> + ?Sized,
    {
        let args = self.args.clone();
        if args.eval_strategy != IntervalStrategy::No && eval.is_none() {
            return Err(Error::Args(format!(
                "eval_strategy is {:?} but no eval dataset was given; pass one, or set \
                 eval_strategy = no",
                args.eval_strategy
            )));
        }
        let resume = self.resume_agreed()?;
        let mut run = self.prepare(params, train, eval)?;
        let (total, steps_per_epoch) = (run.total, run.steps_per_epoch);
        self.state = TrainerState {
            max_steps: total,
            num_train_epochs: total.div_ceil(steps_per_epoch),
            logging_steps: args.logging_steps,
            eval_steps: args.eval_interval(),
            save_steps: args.save_steps,
            train_batch_size: args.per_device_train_batch_size,
            is_world_process_zero: self.acc.is_main_process(),
            ..TrainerState::default()
        };
        // On every rank, with or without a checkpoint: the ranks agree on the one they resolved
        // (or on none) before anything is loaded.
        self.acc.resume_from(resume.as_ref().map(|(dir, _)| dir))?;
        if let Some((_, saved)) = resume {
            self.state.global_step = saved.global_step;
            self.state.epoch = saved.epoch;
            self.state.log_history = saved.log_history;
            self.state.best_metric = saved.best_metric;
            self.state.best_global_step = saved.best_global_step;
            self.state.best_model_checkpoint = saved.best_model_checkpoint;
        }
        for callback in &mut self.callbacks {
            callback.on_train_begin(&args, &self.state)?;
        }
        let mut progress = Progress::new(
            total,
            self.state.global_step,
            self.acc.is_main_process() && !args.disable_tqdm,
        );
        let output = self.train_loop(model, &mut run, total, steps_per_epoch, &mut progress);
        progress.finish();
        let (training_loss, mut metrics) = output?;
        if let Some(eval_loader) = run.eval.as_mut() {
            if self.last_evaluated_step() != Some(self.state.global_step) {
                // No checkpoint is saved at this step, so it cannot become the best one: the
                // best is chosen among saved checkpoints, as in Hugging Face's Trainer.
                metrics = self
                    .evaluate_now(model, eval_loader, &mut progress, false)?
                    .0;
            }
        }
        if args.load_best_model_at_end {
            self.load_best(&run.params)?;
        }
        self.acc.save_model(&args.output_dir)?;
        let written = match self.acc.is_main_process() {
            true => self.state.write(&args.output_dir),
            false => Ok(()),
        };
        self.agree(&args.output_dir, "writing trainer_state.json", written)?;
        self.acc.end_training()?;
        if metrics.is_empty() {
            metrics = self.last_evaluation();
        }
        Ok(TrainOutput {
            global_step: self.state.global_step,
            training_loss,
            metrics,
        })
    }

    /// Evaluates `model` on `dataset` (a loader prepared for it, in order, split across ranks):
    /// `eval_loss` and the metrics of `compute_metrics`, the same on every rank and for any
    /// number of ranks. Logs them at the current step.
    pub fn evaluate<D, M>(&mut self, model: &M, dataset: Arc<D>) -> Result<Metrics>
    where
        D: Dataset,
        M: TrainerModel<D::Batch> + ?Sized,
    {
        let mut loader = self.acc.prepare(DataLoader::new(
            dataset,
            self.args.per_device_eval_batch_size,
        ))?;
        let mut progress = Progress::new(0, 0, false);
        Ok(self
            .evaluate_now(model, &mut loader, &mut progress, false)?
            .0)
    }

    /// The checkpoint to resume from and its `trainer_state.json` (read first: a directory
    /// without the Trainer's state is refused before anything is loaded), or none; every rank
    /// stops if any fails to find or read it, and the main process refuses to resume next to
    /// newer checkpoints when the run saves (see [`checkpoints::check_no_newer`]). A
    /// collective: whether each rank found a checkpoint, they join the same agreements.
    fn resume_agreed(&self) -> Result<Option<(PathBuf, TrainerState)>> {
        let args = &self.args;
        let mut found = None;
        let local = self.checkpoint_to_resume().and_then(|dir| {
            found = dir
                .map(|dir| TrainerState::read(&dir).map(|state| (dir, state)))
                .transpose()?;
            Ok(())
        });
        self.agree(
            &args.output_dir,
            "finding the checkpoint to resume from",
            local,
        )?;
        let checked = match (&found, self.acc.is_main_process()) {
            (Some((_, saved)), true) if args.save_strategy != SaveStrategy::No => {
                checkpoints::check_no_newer(&args.output_dir, saved.global_step, "resumes from")
            }
            _ => Ok(()),
        };
        self.agree(
            &args.output_dir,
            "checking output_dir for newer checkpoints",
            checked,
        )?;
        Ok(found)
    }

    /// The checkpoint `resume_from_checkpoint` names, if any; refuses to start over in an
    /// `output_dir` that holds another run's checkpoints.
    fn checkpoint_to_resume(&self) -> Result<Option<PathBuf>> {
        let output_dir = &self.args.output_dir;
        match &self.args.resume_from_checkpoint {
            Some(ResumeFrom::Latest) => {
                let (latest, incomplete) = checkpoints::latest(output_dir)?;
                for skipped in &incomplete {
                    self.acc.print(format!(
                        "resume_from_checkpoint: {} has no {TRAINER_STATE_NAME} (a save cut \
                         short); resuming from {}",
                        skipped.display(),
                        latest
                            .as_deref()
                            .map_or("the start".into(), |d| d.display().to_string())
                    ));
                }
                Ok(latest)
            }
            Some(ResumeFrom::Checkpoint(dir)) => {
                if !dir.is_dir() {
                    return Err(Error::Args(format!(
                        "resume_from_checkpoint {}: no such checkpoint directory; give a \
                         checkpoint-<step> directory, or `latest`",
                        dir.display()
                    )));
                }
                Ok(Some(dir.clone()))
            }
            None => {
                let existing = checkpoints::list(output_dir)?;
                if let Some((step, _)) = existing.last() {
                    return Err(Error::Args(format!(
                        "output_dir {} already holds {} checkpoint(s) of a run (up to \
                         checkpoint-{step}); continue it with resume_from_checkpoint \
                         (--resume-from-checkpoint), or give another output_dir, or delete them \
                         to start over",
                        output_dir.display(),
                        existing.len()
                    )));
                }
                Ok(None)
            }
        }
    }

    /// Prepares the parameters, AdamW (decay on all but biases and norms), and the loaders.
    fn prepare<D: Dataset>(
        &mut self,
        params: &VarMap,
        train: Arc<D>,
        eval: Option<Arc<D>>,
    ) -> Result<Prepared<D>> {
        let args = &self.args;
        let params = self.acc.prepare(params)?;
        let split = split_decay(params.clone());
        let config = |weight_decay| AdamWConfig {
            lr: args.learning_rate,
            beta1: args.adam_beta1,
            beta2: args.adam_beta2,
            eps: args.adam_epsilon,
            weight_decay,
        };
        let opt = AdamW::with_groups(vec![
            ParamGroup::new(split.decay, config(args.weight_decay)),
            ParamGroup::new(split.no_decay, config(0.0)),
        ])?;
        let opt = self.acc.prepare(opt)?;
        let train = self.acc.prepare(
            DataLoader::new(train, args.per_device_train_batch_size)
                .shuffle(true)
                .seed(args.seed),
        )?;
        let eval = match eval {
            Some(dataset) => Some(
                self.acc
                    .prepare(DataLoader::new(dataset, args.per_device_eval_batch_size))?,
            ),
            None => None,
        };
        let steps_per_epoch = self.acc.num_update_steps(train.len()) as u64;
        if steps_per_epoch == 0 {
            return Err(Error::Args(
                "the training set gives no batch on this rank; give at least one sample per \
                 process"
                    .into(),
            ));
        }
        let total = args.total_steps(steps_per_epoch);
        let schedule = LrScheduler::new(opt.learning_rate_handle(), args.schedule(total as usize))?;
        let sched = self.acc.prepare(schedule)?;
        Ok(Prepared {
            params,
            opt,
            sched,
            train,
            eval,
            total,
            steps_per_epoch,
        })
    }

    /// The optimizer steps: returns the mean training loss of this call's steps and the metrics
    /// of the last evaluation in it.
    fn train_loop<D, M>(
        &mut self,
        model: &M,
        run: &mut Prepared<D>,
        total: u64,
        steps_per_epoch: u64,
        progress: &mut Progress,
    ) -> Result<(f64, Metrics)>
    where
        D: Dataset,
        M: TrainerModel<D::Batch> + ?Sized,
    {
        let args = self.args.clone();
        let k = args.gradient_accumulation_steps;
        let mut metrics = Metrics::new();
        // This rank's share of the loss of the steps since the last log, summed on the device
        // and read at a log only (a read waits for the device), and of every step of this call
        // (each a mean over ranks once reduced).
        let mut logged_loss: Option<Tensor> = None;
        let mut run_loss = 0f64;
        let (mut logged_steps, mut run_steps) = (0u64, 0u64);
        let mut grad_norm = None;
        let mut stop = self.state.global_step >= total;
        while !stop {
            let mut evaluated_this_step = false;
            for window in run.train.windows(k) {
                let batches = window?;
                let mut items = None;
                for batch in &batches {
                    if let Some(n) = model.num_items(batch)? {
                        *items.get_or_insert(0) += n;
                    }
                }
                if let Some(items) = items {
                    self.acc.set_window_items(items)?;
                }
                for batch in &batches {
                    let max_grad_norm = Some(args.max_grad_norm).filter(|&max| max > 0.0);
                    let done = micro_step(
                        &self.acc,
                        &mut run.opt,
                        &mut run.sched,
                        max_grad_norm,
                        || {
                            let out = model.forward(batch)?;
                            if out.losses.rank() != 1 {
                                return Err(Error::Args(format!(
                                    "the model's forward returned losses of shape {:?}; the \
                                     Trainer needs one loss per sample, [batch]",
                                    out.losses.dims()
                                )));
                            }
                            // In f32 whatever the model's dtype (a bf16 mean would round the loss).
                            let losses = out.losses.to_dtype(DType::F32)?;
                            Ok(match items {
                                Some(_) => losses.sum_all()?,
                                None => losses.mean_all()?,
                            })
                        },
                    )?;
                    let step = done.step;
                    let scaled = (done.loss.detach().to_dtype(DType::F64)? * step.loss_scale)?;
                    logged_loss = Some(match logged_loss.take() {
                        None => scaled,
                        Some(sum) => (sum + scaled)?,
                    });
                    if step.sync && max_grad_norm.is_some() {
                        grad_norm = done.grad_norm;
                    }
                    if !step.sync {
                        continue;
                    }
                    self.state.global_step += 1;
                    self.state.epoch = self.state.global_step as f64 / steps_per_epoch as f64;
                    logged_steps += 1;
                    run_steps += 1;
                    progress.step();
                    let step_now = self.state.global_step;
                    let mut control = TrainerControl::default();
                    for callback in &mut self.callbacks {
                        callback.on_step_end(&args, &self.state, &mut control);
                    }
                    self.agree_control(&mut control)?;
                    if step_now % args.logging_steps == 0 || control.should_log {
                        let local = read_sum(logged_loss.take())?;
                        run_loss += local;
                        let loss = self.mean_over_ranks(local)? / logged_steps as f64;
                        self.log_train(loss, run.sched.last_lr(), grad_norm, &mut control)?;
                        progress.train_loss(loss);
                        logged_steps = 0;
                        self.agree_control(&mut control)?;
                    }
                    evaluated_this_step = false;
                    let mut new_best = false;
                    let evaluate_now = (args.eval_strategy == IntervalStrategy::Steps
                        && step_now % args.eval_interval() == 0)
                        || control.should_evaluate;
                    if let (true, Some(eval_loader)) = (evaluate_now, run.eval.as_mut()) {
                        let (m, best, c) = self.evaluate_now(model, eval_loader, progress, true)?;
                        (metrics, new_best, evaluated_this_step) = (m, best, true);
                        control.should_training_stop |= c.should_training_stop;
                        control.should_save |= c.should_save;
                        self.agree_control(&mut control)?;
                    }
                    let save_now = match args.save_strategy {
                        SaveStrategy::Steps => step_now % args.save_steps == 0,
                        SaveStrategy::Best => new_best,
                        _ => false,
                    } || control.should_save;
                    if save_now {
                        self.save_checkpoint(&mut control)?;
                        self.agree_control(&mut control)?;
                    }
                    if control.should_training_stop || step_now >= total {
                        stop = true;
                        break;
                    }
                }
                if stop {
                    break;
                }
            }
            // The end of an epoch, or of training within one (as Hugging Face's epoch-end hooks).
            {
                let mut control = TrainerControl::default();
                let mut new_best = false;
                if args.eval_strategy == IntervalStrategy::Epoch && !evaluated_this_step {
                    if let Some(eval_loader) = run.eval.as_mut() {
                        let (m, best, c) = self.evaluate_now(model, eval_loader, progress, true)?;
                        (metrics, new_best) = (m, best);
                        control = c;
                        self.agree_control(&mut control)?;
                    }
                }
                let save_now = match args.save_strategy {
                    SaveStrategy::Epoch => true,
                    SaveStrategy::Best => new_best,
                    _ => false,
                } || control.should_save;
                // Complete only with its trainer_state.json: one cut short is saved again.
                let already_saved =
                    checkpoints::checkpoint_path(&args.output_dir, self.state.global_step)
                        .join(TRAINER_STATE_NAME)
                        .is_file();
                if save_now && !already_saved {
                    self.save_checkpoint(&mut control)?;
                    self.agree_control(&mut control)?;
                }
                stop |= control.should_training_stop || self.state.global_step >= total;
            }
        }
        run_loss += read_sum(logged_loss.take())?;
        let training_loss = match run_steps {
            0 => f64::NAN,
            n => self.mean_over_ranks(run_loss)? / n as f64,
        };
        Ok((training_loss, metrics))
    }

    /// Makes the callbacks' requests the same on every rank (a request of any rank holds for
    /// all): a callback deciding by something of its own process (the wall clock, a file) would
    /// otherwise send some ranks into an evaluation's gathers or a save that the others never
    /// join. A collective on several ranks, whether this rank has callbacks or not: a program
    /// may add a callback on the main process only.
    fn agree_control(&self, control: &mut TrainerControl) -> Result<()> {
        if self.acc.num_processes() == 1 {
            return Ok(());
        }
        let local = [
            control.should_log,
            control.should_evaluate,
            control.should_save,
            control.should_training_stop,
        ];
        for [log, evaluate, save, stop] in self.acc.gather_object(&local)? {
            control.should_log |= log;
            control.should_evaluate |= evaluate;
            control.should_save |= save;
            control.should_training_stop |= stop;
        }
        Ok(())
    }

    /// The mean of a per-rank value over all ranks.
    fn mean_over_ranks(&self, local: f64) -> Result<f64> {
        let all = self.acc.gather_object(&local)?;
        Ok(all.iter().sum::<f64>() / all.len() as f64)
    }

    /// Logs the training metrics at the current step to the trackers and the log history.
    fn log_train(
        &mut self,
        loss: f64,
        learning_rate: f64,
        grad_norm: Option<f64>,
        control: &mut TrainerControl,
    ) -> Result<()> {
        let step = self.state.global_step;
        let epoch = self.state.epoch;
        let mut tracked = vec![
            (TRAIN_LOSS, loss),
            (TRAIN_LEARNING_RATE, learning_rate),
            (TRAIN_EPOCH, epoch),
        ];
        let mut logs = Metrics::from([
            ("loss".to_string(), loss),
            ("learning_rate".to_string(), learning_rate),
            ("epoch".to_string(), epoch),
        ]);
        if let Some(norm) = grad_norm {
            tracked.push((TRAIN_GRAD_NORM, norm));
            logs.insert("grad_norm".into(), norm);
        }
        self.acc.log(tracked, step)?;
        let mut record = logs.clone();
        record.insert("step".into(), step as f64);
        self.state.log_history.push(record);
        for callback in &mut self.callbacks {
            callback.on_log(&self.args, &self.state, control, &logs);
        }
        Ok(())
    }

    /// Evaluates at the current step: logs the metrics, runs the callbacks, and, with
    /// `rank_best`, updates the best metric. Returns the metrics, whether they are a new best,
    /// and the callbacks' requests.
    fn evaluate_now<D, M>(
        &mut self,
        model: &M,
        loader: &mut DataLoader<D>,
        progress: &mut Progress,
        rank_best: bool,
    ) -> Result<(Metrics, bool, TrainerControl)>
    where
        D: Dataset,
        M: TrainerModel<D::Batch> + ?Sized,
    {
        let metrics = evaluate_loader(&self.acc, model, loader, self.compute_metrics.as_mut())?;
        let step = self.state.global_step;
        let tracked: Vec<(String, f64)> = metrics
            .iter()
            .map(|(name, &value)| {
                let name = name.strip_prefix("eval_").unwrap_or(name);
                (format!("eval/{name}"), value)
            })
            .collect();
        self.acc.log(tracked, step)?;
        let mut record = metrics.clone();
        record.insert("epoch".into(), self.state.epoch);
        record.insert("step".into(), step as f64);
        self.state.log_history.push(record);
        progress.evaluation(&metrics);
        let mut control = TrainerControl::default();
        for callback in &mut self.callbacks {
            callback.on_evaluate(&self.args, &self.state, &mut control, &metrics);
        }
        let new_best = rank_best && self.track_best(&metrics)?;
        Ok((metrics, new_best, control))
    }

    /// Records `metrics` as the best so far if `metric_for_best_model` improved (tracked when a
    /// metric, `load_best_model_at_end` or `save_strategy = best` asks for it).
    fn track_best(&mut self, metrics: &Metrics) -> Result<bool> {
        let args = &self.args;
        if args.metric_for_best_model.is_none()
            && !args.load_best_model_at_end
            && args.save_strategy != SaveStrategy::Best
        {
            return Ok(false);
        }
        let name = args.metric_for_best();
        let Some(&value) = metrics.get(&name) else {
            return Err(Error::Args(format!(
                "metric_for_best_model is {name}, but the evaluation gave only {:?}; name one of \
                 them (or return it from compute_metrics)",
                metrics.keys().collect::<Vec<_>>()
            )));
        };
        let better = match self.state.best_metric {
            None => true,
            Some(best) if args.metric_greater_is_better() => value > best,
            Some(best) => value < best,
        };
        if better {
            self.state.best_metric = Some(value);
            self.state.best_global_step = Some(self.state.global_step);
        }
        Ok(better)
    }

    /// Saves `output_dir/checkpoint-<step>`: the accelerator's state (with `model.safetensors`)
    /// and `trainer_state.json`; then rotates under `save_total_limit`. Refused, before anything
    /// is written, next to newer complete checkpoints (see [`checkpoints::check_no_newer`]).
    fn save_checkpoint(&mut self, control: &mut TrainerControl) -> Result<()> {
        let output_dir = self.args.output_dir.clone();
        let step = self.state.global_step;
        let dir = checkpoints::checkpoint_path(&output_dir, step);
        let checked = match self.acc.is_main_process() {
            true => checkpoints::check_no_newer(&output_dir, step, "is saving"),
            false => Ok(()),
        };
        self.agree(
            &output_dir,
            "checking output_dir for newer checkpoints",
            checked,
        )?;
        // save_state writes model.safetensors (listed in its manifest; a second, sharded
        // save_model of a large model would delete it and break the checkpoint).
        self.acc.save_state(&dir)?;
        if self.state.best_global_step == Some(step) {
            self.state.best_model_checkpoint = Some(dir.clone());
        }
        let written = match self.acc.is_main_process() {
            true => self.state.write(&dir),
            false => Ok(()),
        };
        self.agree(&dir, "writing trainer_state.json", written)?;
        // The checkpoint is complete on every rank: rotation can only warn from here on.
        if let (Some(limit), true) = (self.args.save_total_limit, self.acc.is_main_process()) {
            let best = self.best_checkpoint();
            if let Err(e) = checkpoints::rotate(&output_dir, limit, &dir, best.as_deref()) {
                eprintln!(
                    "accelerate-trainer: warning: save_total_limit: {} is saved, but the oldest \
                     checkpoints were not rotated: {e}",
                    dir.display()
                );
            }
        }
        for callback in &mut self.callbacks {
            callback.on_save(&self.args, &self.state, control);
        }
        Ok(())
    }

    /// The best checkpoint's directory: by its name in this run's `output_dir` (a resumed run
    /// may spell `output_dir` otherwise, or the directory may have moved), else where it was
    /// recorded (a run resumed into another `output_dir` from a checkpoint elsewhere).
    fn best_checkpoint(&self) -> Option<PathBuf> {
        let recorded = self.state.best_model_checkpoint.as_ref()?;
        let here = recorded
            .file_name()
            .map(|name| self.args.output_dir.join(name));
        match here {
            Some(here) if here.is_dir() || !recorded.is_dir() => Some(here),
            _ => Some(recorded.clone()),
        }
    }

    /// Loads the weights of the best checkpoint into the parameters.
    fn load_best(&mut self, params: &[(String, Var)]) -> Result<()> {
        let Some(dir) = self.best_checkpoint().filter(|dir| {
            let found = dir.join(accelerate_core::MODEL_SAFETENSORS).is_file();
            if !found {
                self.acc.print(format!(
                    "load_best_model_at_end: the best checkpoint {} is gone; keeping the last \
                     weights",
                    dir.display()
                ));
            }
            found
        }) else {
            self.acc.print(
                "load_best_model_at_end: no checkpoint holds the best evaluation; keeping the \
                 last weights",
            );
            return Ok(());
        };
        accelerate_core::load_into_vars(dir.join(accelerate_core::MODEL_SAFETENSORS), params)?;
        self.acc.model().refresh_compute_parameters()?;
        Ok(())
    }

    /// The step of the last evaluation in the log history.
    fn last_evaluated_step(&self) -> Option<u64> {
        self.state
            .log_history
            .iter()
            .rev()
            .find(|r| r.contains_key("eval_loss"))
            .and_then(|r| r.get("step"))
            .map(|&s| s as u64)
    }

    /// The metrics of the last evaluation in the log history.
    fn last_evaluation(&self) -> Metrics {
        self.state
            .log_history
            .iter()
            .rev()
            .find(|r| r.contains_key("eval_loss"))
            .map(|r| {
                r.iter()
                    .filter(|(k, _)| k.starts_with("eval_"))
                    .map(|(k, &v)| (k.clone(), v))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Every rank's outcome of a step done on the main process, agreed on by all.
    fn agree(&self, path: &Path, what: &str, local: Result<()>) -> Result<()> {
        let local = local.map_err(|e| accelerate_core::Error::Config(e.to_string()));
        Ok(self.acc.agree_across_ranks(path, what, local)?)
    }
}

/// The value of a sum kept on the device (0 for none).
fn read_sum(sum: Option<Tensor>) -> Result<f64> {
    Ok(match sum {
        Some(sum) => sum.to_scalar::<f64>()?,
        None => 0.0,
    })
}

/// `<unix seconds>_<host>`: a fresh directory name per run under `output_dir/runs`, as Hugging
/// Face's `<time>_<host>`.
fn run_name() -> String {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // $HOSTNAME is a shell variable that bash does not export; the kernel's name is there.
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into());
    format!("{seconds}_{host}")
}
