//! Mixed-precision training with f32 master weights (see [`MixedPrecision`]).

use std::str::FromStr;

use candle_core::{DType, Var};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::grads::GradientBuffers;

/// The precision of the forward and backward passes.
///
/// Mixed-precision training with f32 master weights (Apex O2, and Accelerate's f32 master copies).
///
/// candle has no autocast, so the model itself is built in the half-precision *compute* dtype
/// (`VarBuilder::from_varmap(&varmap, accelerator.compute_dtype(), device)`): its forward and
/// backward passes run in bf16 or f16. `MasterWeights` pairs each of those compute `Var`s with an
/// f32 *master* `Var` of the same name; the optimizer is built from the masters, the gradient
/// buffers are f32 and keyed by name, and after every real optimizer step the compute copies are
/// refreshed from the masters (a cast). What is f32: master weights, gradient buffers (so the
/// accumulation over micro-steps and the all-reduce are f32), optimizer state, checkpoints. What is
/// half: the model's own parameters, activations and the gradients of one backward pass.
///
/// The refresh after a step costs nothing for the optimizers of this crate: `prepare` hands them
/// the compute copies ([`Optimizer::set_compute_copies`](crate::optim::Optimizer::set_compute_copies))
/// and their update writes each copy in the same pass over the data as the master. Only the copies
/// a step did not write whole (another optimizer's, a skipped parameter's, ZeRO pieces of other
/// ranks) are cast from their masters afterwards.
///
/// fp16's range is narrow (largest finite value 65504, smallest normal 6.1e-5), so small gradients
/// underflow to zero. Under fp16 a [`DynamicLossScaler`] multiplies the loss by a large scale before
/// the backward pass and divides it out when the gradient is added into the f32 buffers. When the
/// scaled gradients overflow (inf or NaN on the sync micro-step, after the all-reduce so that every
/// rank decides alike) the optimizer step is skipped and the scale backs off; after
/// `growth_interval` consecutive good steps it grows. This is PyTorch's `GradScaler`, defaults
/// included. bf16 has f32's exponent range and needs no scaling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MixedPrecision {
    /// Everything in the model's own dtype (f32); no master copies, no loss scaling.
    #[default]
    No,
    /// Forward and backward in bfloat16, f32 master weights and gradient buffers.
    Bf16,
    /// Forward and backward in float16, f32 master weights and gradient buffers, dynamic loss
    /// scaling.
    Fp16,
}

impl MixedPrecision {
    /// The spellings accepted by [`from_str`](FromStr::from_str), the launcher flag and
    /// `ACCELERATE_MIXED_PRECISION`.
    pub const VALID: &'static str = "no, bf16 or fp16";

    /// The dtype to build the model in and cast float inputs to: F32, BF16 or F16.
    pub fn compute_dtype(self) -> DType {
        match self {
            Self::No => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::Fp16 => DType::F16,
        }
    }

    /// The mode's name as the flag spells it (`no`, `bf16`, `fp16`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::No => "no",
            Self::Bf16 => "bf16",
            Self::Fp16 => "fp16",
        }
    }

    /// Reads `ACCELERATE_MIXED_PRECISION`: `None` when unset or empty, an [`Error::Env`] naming the
    /// variable and the valid values when it holds anything else.
    pub fn from_env() -> Result<Option<Self>> {
        crate::env::read(
            crate::env::MIXED_PRECISION,
            &format!("expected {}", Self::VALID),
            |v| v.parse::<Self>().ok(),
        )
    }
}

impl std::fmt::Display for MixedPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for MixedPrecision {
    type Err = Error;

    /// `no`, `bf16` or `fp16` (any case), as Accelerate spells them.
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "no" => Ok(Self::No),
            "bf16" => Ok(Self::Bf16),
            "fp16" => Ok(Self::Fp16),
            _ => Err(Error::Config(format!(
                "mixed precision {s:?} is not one of {}",
                Self::VALID
            ))),
        }
    }
}

/// Hyper-parameters of a [`DynamicLossScaler`]; the defaults are PyTorch `GradScaler`'s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScalerConfig {
    /// The scale to start with (2^16).
    pub init_scale: f64,
    /// Factor applied after `growth_interval` consecutive steps without overflow (2).
    pub growth_factor: f64,
    /// Factor applied when a step overflows (0.5).
    pub backoff_factor: f64,
    /// Consecutive good steps before the scale grows (2000).
    pub growth_interval: u64,
}

impl Default for LossScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl LossScalerConfig {
    /// PyTorch's checks (growth above 1, backoff below 1), plus a finite positive start that f32
    /// can hold.
    fn validate(&self) -> Result<()> {
        let problem = if !(self.init_scale > 0.0 && (self.init_scale as f32).is_finite()) {
            Some(format!(
                "init_scale {} must be positive and finite in f32",
                self.init_scale
            ))
        } else if !(self.growth_factor > 1.0 && self.growth_factor.is_finite()) {
            Some(format!(
                "growth_factor {} must be a finite number above 1",
                self.growth_factor
            ))
        } else if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            Some(format!(
                "backoff_factor {} must lie strictly between 0 and 1",
                self.backoff_factor
            ))
        } else if self.growth_interval == 0 {
            Some("growth_interval must be at least 1 step".into())
        } else {
            None
        };
        match problem {
            Some(p) => Err(Error::Config(format!(
                "loss scaler: {p} (PyTorch's defaults: 2^16, 2, 0.5, 2000)"
            ))),
            None => Ok(()),
        }
    }
}

/// What a checkpoint keeps of a [`DynamicLossScaler`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScalerState {
    /// The current scale.
    pub scale: f64,
    /// Consecutive steps without overflow since the scale last changed.
    pub growth_tracker: u64,
}

/// PyTorch `GradScaler`'s scale update (`_amp_update_scale_`): on overflow the scale is multiplied
/// by `backoff_factor` and the tracker resets; otherwise the tracker counts the good step and, on
/// reaching `growth_interval`, the scale is multiplied by `growth_factor` (unless that would leave
/// f32's range) and the tracker resets.
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicLossScaler {
    config: LossScalerConfig,
    scale: f64,
    growth_tracker: u64,
}

impl DynamicLossScaler {
    /// A scaler starting at `config.init_scale`.
    pub fn new(config: LossScalerConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            config,
            scale: config.init_scale,
            growth_tracker: 0,
        })
    }

    /// The factor the loss is multiplied by before the backward pass.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Consecutive good steps since the scale last changed.
    pub fn growth_tracker(&self) -> u64 {
        self.growth_tracker
    }

    /// The hyper-parameters.
    pub fn config(&self) -> LossScalerConfig {
        self.config
    }

    /// Updates the scale after an optimizer step (`found_inf`: the gradients held inf or NaN and
    /// the step was skipped). Fails when repeated overflows drove the scale below f32's smallest
    /// normal number: the gradients are then non-finite at any scale (a NaN or inf in the loss or
    /// the inputs), and skipping steps forever would hide it.
    pub fn update(&mut self, found_inf: bool) -> Result<()> {
        if found_inf {
            self.scale *= self.config.backoff_factor;
            self.growth_tracker = 0;
            if self.scale < f32::MIN_POSITIVE as f64 {
                return Err(Error::Optimizer(format!(
                    "the fp16 loss scale fell to {:e} after repeated overflows: the gradients are \
                     inf or NaN at any scale; check the loss and the inputs for inf/NaN, or train \
                     in bf16 (--mixed-precision bf16)",
                    self.scale
                )));
            }
            return Ok(());
        }
        let successful = self.growth_tracker + 1;
        if successful == self.config.growth_interval {
            let grown = self.scale * self.config.growth_factor;
            // PyTorch keeps its scale in f32 and does not grow it to inf.
            if (grown as f32).is_finite() {
                self.scale = grown;
            }
            self.growth_tracker = 0;
        } else {
            self.growth_tracker = successful;
        }
        Ok(())
    }

    /// The savable state.
    pub fn state(&self) -> LossScalerState {
        LossScalerState {
            scale: self.scale,
            growth_tracker: self.growth_tracker,
        }
    }

    /// Restores a state saved by [`state`](Self::state); an unusable one is refused and the scaler
    /// is unchanged.
    pub fn load_state(&mut self, state: &LossScalerState) -> Result<()> {
        if !(state.scale > 0.0 && (state.scale as f32).is_finite()) {
            return Err(Error::Optimizer(format!(
                "saved loss scale {} is not a positive f32 number",
                state.scale
            )));
        }
        if state.growth_tracker >= self.config.growth_interval {
            return Err(Error::Optimizer(format!(
                "saved growth tracker {} is not below this run's growth_interval {}; resume with \
                 the loss scaler configuration that saved it",
                state.growth_tracker, self.config.growth_interval
            )));
        }
        self.scale = state.scale;
        self.growth_tracker = state.growth_tracker;
        Ok(())
    }

    /// Back to the initial scale, with no good steps counted.
    pub fn reset(&mut self) {
        self.scale = self.config.init_scale;
        self.growth_tracker = 0;
    }
}

/// The model's half-precision compute `Var`s and their f32 master copies, by name (sorted).
#[derive(Debug)]
pub struct MasterWeights {
    masters: Vec<(String, Var)>,
    compute: Vec<(String, Var)>,
}

impl MasterWeights {
    /// Creates an f32 master for every parameter of `compute` (sorted by name). A parameter that is
    /// already f32 (kept in full precision on purpose, like a normalisation layer under Apex O2) is
    /// its own master. Every half-precision parameter must be in `mode`'s compute dtype, and at
    /// least one must be.
    pub fn new(compute: Vec<(String, Var)>, mode: MixedPrecision) -> Result<Self> {
        let dtype = mode.compute_dtype();
        let mut halves = 0;
        for (name, var) in &compute {
            match var.dtype() {
                DType::F32 => {}
                d if d == dtype => halves += 1,
                d => {
                    return Err(Error::Parameters(format!(
                        "parameter {name:?} is {d:?} but mixed precision {mode} computes in \
                         {dtype:?}; build the model with `accelerator.compute_dtype()`"
                    )))
                }
            }
        }
        if halves == 0 {
            return Err(Error::Parameters(format!(
                "mixed precision {mode} is on but every parameter is f32, so nothing would run in \
                 {dtype:?}; build the model with `VarBuilder::from_varmap(&varmap, \
                 accelerator.compute_dtype(), accelerator.device())`"
            )));
        }
        let masters = compute
            .iter()
            .map(|(name, var)| {
                let master = if var.dtype() == DType::F32 {
                    var.clone()
                } else {
                    Var::from_tensor(&var.as_tensor().detach().to_dtype(DType::F32)?)?
                };
                Ok((name.clone(), master))
            })
            .collect::<Result<_>>()?;
        Ok(Self { masters, compute })
    }

    /// The f32 masters (what the optimizer updates, what is broadcast and saved).
    pub fn masters(&self) -> &[(String, Var)] {
        &self.masters
    }

    /// The compute copies the model runs with (where a backward pass leaves its gradients).
    pub fn compute(&self) -> &[(String, Var)] {
        &self.compute
    }

    /// Copies the masters into the compute copies (rounded to the compute dtype).
    pub fn refresh_compute(&self) -> Result<()> {
        self.refresh_compute_except(|_| false)
    }

    /// Copies the masters into the compute copies, except those of the parameters for which
    /// `fresh(name)` holds: after an optimizer step, the copies the optimizer already wrote from
    /// the updated masters ([`Optimizer::wrote_compute_copy`](crate::optim::Optimizer::wrote_compute_copy)).
    pub fn refresh_compute_except(&self, fresh: impl Fn(&str) -> bool) -> Result<()> {
        for ((name, master), (_, compute)) in self.masters.iter().zip(&self.compute) {
            if master.as_tensor().id() != compute.as_tensor().id() && !fresh(name) {
                compute.set(&master.as_tensor().to_dtype(compute.dtype())?)?;
            }
        }
        Ok(())
    }
}

/// The mixed-precision part of the training state shared by the accelerator and its prepared
/// objects.
#[derive(Debug, Default)]
pub(crate) struct MixedPrecisionState {
    pub mode: MixedPrecision,
    /// Present once parameters were prepared under bf16 or fp16.
    pub weights: Option<MasterWeights>,
    /// Present under fp16.
    pub scaler: Option<DynamicLossScaler>,
    /// Whether the current window's reduced gradients held inf or NaN (fp16): its step is skipped.
    pub window_overflowed: bool,
}

impl MixedPrecisionState {
    pub fn new(mode: MixedPrecision, scaler: LossScalerConfig) -> Result<Self> {
        let scaler = match mode {
            MixedPrecision::Fp16 => Some(DynamicLossScaler::new(scaler)?),
            _ => None,
        };
        Ok(Self {
            mode,
            weights: None,
            scaler,
            window_overflowed: false,
        })
    }

    /// The factor the loss is multiplied by before backward (1 without fp16).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, |s| s.scale())
    }

    /// The `Var`s whose gradients a backward pass produces: the compute copies under mixed
    /// precision, else `params` themselves.
    pub fn grad_sources<'a>(&'a self, params: &'a [(String, Var)]) -> &'a [(String, Var)] {
        self.weights.as_ref().map_or(params, |w| w.compute())
    }

    /// On the sync micro-step, after the all-reduce: under fp16 checks the gradients for inf/NaN,
    /// records whether the step must be skipped, and updates the scale.
    pub fn after_sync(&mut self, buffers: &GradientBuffers) -> Result<()> {
        if self.scaler.is_none() {
            return Ok(());
        }
        let overflow = !buffers.all_finite()?;
        self.after_sync_verdict(overflow)
    }

    /// [`after_sync`](Self::after_sync) when the ranks already agreed whether some gradient
    /// overflowed (ZeRO stage 3, where each rank holds only its pieces).
    pub fn after_sync_verdict(&mut self, overflow: bool) -> Result<()> {
        let Some(scaler) = self.scaler.as_mut() else {
            return Ok(());
        };
        self.window_overflowed = overflow;
        scaler.update(overflow)
    }

    /// After a load: the compute copies take the masters' values.
    pub fn refresh_compute(&self) -> Result<()> {
        self.refresh_compute_except(|_| false)
    }

    /// After a real optimizer step: the compute copies take the masters' values, except those the
    /// optimizer wrote itself (`fresh(name)`).
    pub fn refresh_compute_except(&self, fresh: impl Fn(&str) -> bool) -> Result<()> {
        match &self.weights {
            Some(w) => w.refresh_compute_except(fresh),
            None => Ok(()),
        }
    }

    /// Hands `optimizer` the compute copies of its parameters, so that its steps write them
    /// (nothing without mixed precision).
    pub fn give_compute_copies(&self, optimizer: &mut dyn crate::optim::Optimizer) -> Result<()> {
        match &self.weights {
            Some(w) => optimizer.set_compute_copies(w.compute()),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn scaler(interval: u64) -> DynamicLossScaler {
        DynamicLossScaler::new(LossScalerConfig {
            growth_interval: interval,
            ..LossScalerConfig::default()
        })
        .unwrap()
    }

    #[test]
    fn defaults_are_pytorch_grad_scalers() {
        let s = DynamicLossScaler::new(LossScalerConfig::default()).unwrap();
        assert_eq!(s.scale(), 2f64.powi(16));
        let c = s.config();
        assert_eq!(
            (c.growth_factor, c.backoff_factor, c.growth_interval),
            (2.0, 0.5, 2000)
        );
    }

    #[test]
    fn grows_after_exactly_growth_interval_good_steps() {
        let mut s = scaler(5);
        for round in 1..=3 {
            for good in 1..5 {
                s.update(false).unwrap();
                assert_eq!(s.growth_tracker(), good);
                assert_eq!(s.scale(), 65536.0 * 2f64.powi(round - 1), "before growth");
            }
            s.update(false).unwrap();
            // scale = init * growth^round, tracker reset.
            assert_eq!(s.scale(), 65536.0 * 2f64.powi(round));
            assert_eq!(s.growth_tracker(), 0);
        }
    }

    #[test]
    fn backs_off_on_inf_and_nan_and_resets_the_tracker() {
        let mut s = scaler(4);
        for _ in 0..3 {
            s.update(false).unwrap();
        }
        assert_eq!(s.growth_tracker(), 3);
        // An overflow (inf or NaN alike: both are "not finite") halves and resets.
        s.update(true).unwrap();
        assert_eq!((s.scale(), s.growth_tracker()), (32768.0, 0));
        s.update(true).unwrap();
        assert_eq!((s.scale(), s.growth_tracker()), (16384.0, 0));
        // The reset tracker needs a full interval again: 3 good steps do not grow it.
        for _ in 0..3 {
            s.update(false).unwrap();
        }
        assert_eq!(s.scale(), 16384.0);
        s.update(false).unwrap();
        assert_eq!((s.scale(), s.growth_tracker()), (32768.0, 0));
    }

    #[test]
    fn overflow_detection_sees_inf_and_nan_in_the_buffers() {
        let var = Var::zeros(3, DType::F32, &Device::Cpu).unwrap();
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let mut state =
                MixedPrecisionState::new(MixedPrecision::Fp16, LossScalerConfig::default())
                    .unwrap();
            let mut buffers = GradientBuffers::new(&[("w".into(), var.clone())], 1024).unwrap();
            let ok = Tensor::new(&[1f32, 2.0, 3.0], &Device::Cpu).unwrap();
            buffers.accumulate_one("w", &ok, 1.0).unwrap();
            state.after_sync(&buffers).unwrap();
            assert!(!state.window_overflowed);
            assert_eq!(state.loss_scale(), 65536.0);
            let g = Tensor::new(&[1f32, bad, 3.0], &Device::Cpu).unwrap();
            buffers.accumulate_one("w", &g, 1.0).unwrap();
            state.after_sync(&buffers).unwrap();
            assert!(state.window_overflowed, "{bad}");
            assert_eq!(state.loss_scale(), 32768.0, "{bad}");
            assert_eq!(state.scaler.as_ref().unwrap().growth_tracker(), 0);
        }
    }

    #[test]
    fn growth_stops_below_f32_overflow_and_underflow_is_an_error() {
        let mut s = DynamicLossScaler::new(LossScalerConfig {
            init_scale: 2f64.powi(127),
            growth_interval: 1,
            ..LossScalerConfig::default()
        })
        .unwrap();
        s.update(false).unwrap();
        // 2^128 is inf in f32: PyTorch keeps the old scale.
        assert_eq!(s.scale(), 2f64.powi(127));
        let mut s = scaler(10);
        // 2^16 * 0.5^n < 2^-126 first for n = 143.
        for _ in 0..142 {
            s.update(true).unwrap();
        }
        let e = s.update(true).unwrap_err().to_string();
        assert!(e.contains("inf or NaN at any scale"), "{e}");
    }

    #[test]
    fn state_round_trips_and_bad_states_or_configs_are_refused() {
        let mut s = scaler(10);
        s.update(true).unwrap();
        s.update(false).unwrap();
        let saved = s.state();
        let mut t = scaler(10);
        t.load_state(&saved).unwrap();
        assert_eq!(t, s);
        let e = t
            .load_state(&LossScalerState {
                scale: 1.0,
                growth_tracker: 10,
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("growth_interval 10"), "{e}");
        assert!(t
            .load_state(&LossScalerState {
                scale: f64::NAN,
                growth_tracker: 0
            })
            .is_err());
        assert_eq!(t, s, "a refused state changes nothing");
        for bad in [
            LossScalerConfig {
                growth_factor: 1.0,
                ..LossScalerConfig::default()
            },
            LossScalerConfig {
                backoff_factor: 1.0,
                ..LossScalerConfig::default()
            },
            LossScalerConfig {
                growth_interval: 0,
                ..LossScalerConfig::default()
            },
            LossScalerConfig {
                init_scale: 0.0,
                ..LossScalerConfig::default()
            },
        ] {
            let e = DynamicLossScaler::new(bad).unwrap_err().to_string();
            assert!(e.contains("PyTorch's defaults"), "{e}");
        }
    }

    #[test]
    fn modes_parse_and_name_the_valid_values() {
        assert_eq!(
            "BF16".parse::<MixedPrecision>().unwrap(),
            MixedPrecision::Bf16
        );
        assert_eq!(
            "fp16".parse::<MixedPrecision>().unwrap(),
            MixedPrecision::Fp16
        );
        assert_eq!("no".parse::<MixedPrecision>().unwrap(), MixedPrecision::No);
        let e = "fp8".parse::<MixedPrecision>().unwrap_err().to_string();
        assert!(
            e.contains("\"fp8\"") && e.contains("no, bf16 or fp16"),
            "{e}"
        );
        assert_eq!(MixedPrecision::Bf16.compute_dtype(), DType::BF16);
        assert_eq!(MixedPrecision::Fp16.compute_dtype(), DType::F16);
        assert_eq!(MixedPrecision::No.compute_dtype(), DType::F32);
    }

    #[test]
    fn masters_are_f32_copies_and_refresh_rounds_into_the_compute_copies() {
        let half = Var::new(&[0.5f32, -1.25], &Device::Cpu)
            .unwrap()
            .as_tensor()
            .to_dtype(DType::BF16)
            .unwrap();
        let compute = Var::from_tensor(&half).unwrap();
        let kept = Var::new(&[3f32], &Device::Cpu).unwrap();
        let w = MasterWeights::new(
            vec![("a".into(), compute.clone()), ("norm".into(), kept.clone())],
            MixedPrecision::Bf16,
        )
        .unwrap();
        let master = &w.masters()[0].1;
        assert_eq!(master.dtype(), DType::F32);
        assert_eq!(master.to_vec1::<f32>().unwrap(), vec![0.5, -1.25]);
        assert_eq!(w.masters()[1].1.as_tensor().id(), kept.as_tensor().id());
        // 1 + 2^-10 is not a bf16 number (8 mantissa bits): the compute copy rounds it to 1.
        master
            .set(&Tensor::new(&[1.0f32 + 2f32.powi(-10), 2.0], &Device::Cpu).unwrap())
            .unwrap();
        w.refresh_compute().unwrap();
        let got = compute
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(got, vec![1.0, 2.0]);
        assert_eq!(master.to_vec1::<f32>().unwrap()[0], 1.0 + 2f32.powi(-10));

        let e = MasterWeights::new(vec![("k".into(), kept)], MixedPrecision::Bf16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("compute_dtype()"), "{e}");
        let e = MasterWeights::new(vec![("a".into(), compute)], MixedPrecision::Fp16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"a\" is BF16 but mixed precision fp16"), "{e}");
    }
}
