//! Learning-rate schedules, counted in optimizer steps.
//!
//! The semantics are transformers' `LambdaLR` schedules: the learning rate used by optimizer step `i`
//! (0-based) is `base_lr · factor(i)`, for each parameter group with its own base rate. Creating an [`LrScheduler`] applies `factor(0)`; each
//! [`LrScheduler::step`] after an optimizer step applies the factor of the next one. Steps are
//! optimizer updates, not micro-batches and not processes (Accelerate multiplies by the number of
//! processes; we do not).

use std::f64::consts::PI;

use super::LearningRate;
use crate::error::{Error, Result};

/// The shape of a learning-rate schedule, as a factor of the base learning rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Schedule {
    /// Factor 1 throughout.
    Constant,
    /// Linear from 0 to 1 over `warmup_steps`, then 1 (`get_constant_schedule_with_warmup`).
    ConstantWithWarmup {
        /// Steps of the linear warm-up.
        warmup_steps: usize,
    },
    /// Linear warm-up, then linear decay to 0 at `total_steps` (`get_linear_schedule_with_warmup`).
    LinearWarmupDecay {
        /// Steps of the linear warm-up.
        warmup_steps: usize,
        /// Step at which the factor reaches 0 (the total number of optimizer steps).
        total_steps: usize,
    },
    /// Linear warm-up, then half a cosine period down to 0 at `total_steps`
    /// (`get_cosine_schedule_with_warmup` with `num_cycles = 0.5`).
    CosineWithWarmup {
        /// Steps of the linear warm-up.
        warmup_steps: usize,
        /// Step at which the factor reaches 0 (the total number of optimizer steps).
        total_steps: usize,
    },
}

impl Schedule {
    /// The factor of the learning rate used by optimizer step `step` (0-based).
    ///
    /// As in transformers, the cosine schedule is not clamped past `total_steps` (it rises again),
    /// while the linear one stays at 0.
    pub fn factor(&self, step: usize) -> f64 {
        let warmup = |warmup_steps: usize| step as f64 / warmup_steps.max(1) as f64;
        match *self {
            Schedule::Constant => 1.0,
            Schedule::ConstantWithWarmup { warmup_steps } => {
                if step < warmup_steps {
                    warmup(warmup_steps)
                } else {
                    1.0
                }
            }
            Schedule::LinearWarmupDecay {
                warmup_steps,
                total_steps,
            } => {
                if step < warmup_steps {
                    return warmup(warmup_steps);
                }
                let left = total_steps as f64 - step as f64;
                let decay_steps = total_steps.saturating_sub(warmup_steps).max(1) as f64;
                (left / decay_steps).max(0.0)
            }
            Schedule::CosineWithWarmup {
                warmup_steps,
                total_steps,
            } => {
                if step < warmup_steps {
                    return warmup(warmup_steps);
                }
                let decay_steps = total_steps.saturating_sub(warmup_steps).max(1) as f64;
                let progress = (step - warmup_steps) as f64 / decay_steps;
                // num_cycles = 0.5: cos(pi * 0.5 * 2 * progress).
                (0.5 * (1.0 + (PI * progress).cos())).max(0.0)
            }
        }
    }

    /// Rejects schedules that cannot mean what was intended.
    pub fn validate(&self) -> Result<()> {
        let (name, warmup_steps, total_steps) = match *self {
            Schedule::Constant | Schedule::ConstantWithWarmup { .. } => return Ok(()),
            Schedule::LinearWarmupDecay {
                warmup_steps,
                total_steps,
            } => ("LinearWarmupDecay", warmup_steps, total_steps),
            Schedule::CosineWithWarmup {
                warmup_steps,
                total_steps,
            } => ("CosineWithWarmup", warmup_steps, total_steps),
        };
        if total_steps == 0 {
            return Err(Error::Optimizer(format!(
                "{name} has total_steps 0, which would keep the learning rate at 0; set it to the \
                 number of optimizer steps of the run (epochs × update steps per epoch)"
            )));
        }
        if warmup_steps > total_steps {
            return Err(Error::Optimizer(format!(
                "{name} has warmup_steps {warmup_steps} > total_steps {total_steps}; the warm-up \
                 must end within the run (lower warmup_steps or raise total_steps)"
            )));
        }
        Ok(())
    }
}

/// What a scheduler needs to resume: how many optimizer steps it has seen and its base rates.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SchedulerState {
    /// Optimizer steps taken so far.
    pub steps: usize,
    /// The learning rate the factors multiply (the first parameter group's).
    pub base_lr: f64,
    /// The base rates of the parameter groups after the first, in group order (empty with one
    /// group, and in states saved before groups existed).
    #[serde(default)]
    pub group_base_lrs: Vec<f64>,
}

impl SchedulerState {
    /// Every group's base rate, in group order.
    pub fn base_lrs(&self) -> Vec<f64> {
        std::iter::once(self.base_lr)
            .chain(self.group_base_lrs.iter().copied())
            .collect()
    }
}

/// Sets a [`LearningRate`] to `base_lr · schedule.factor(steps)` after every optimizer step, each
/// parameter group's rate from its own base rate (PyTorch's `LambdaLR`).
#[derive(Debug, Clone)]
pub struct LrScheduler {
    lr: LearningRate,
    schedule: Schedule,
    base_lrs: Vec<f64>,
    steps: usize,
    last_lrs: Vec<f64>,
}

impl LrScheduler {
    /// A scheduler driving `lr`, whose current rates become the base learning rates (one per
    /// parameter group); the rates of step 0 are applied at once. Fails on an invalid schedule
    /// (warm-up longer than the run, no steps) or a base rate that is negative or not finite.
    pub fn new(lr: LearningRate, schedule: Schedule) -> Result<Self> {
        schedule.validate()?;
        let base_lrs = lr.get_all();
        for &base_lr in &base_lrs {
            check_base_lr(base_lr)?;
        }
        let mut scheduler = Self {
            lr,
            schedule,
            last_lrs: base_lrs.clone(),
            base_lrs,
            steps: 0,
        };
        scheduler.apply();
        Ok(scheduler)
    }

    /// Records one optimizer step and sets the learning rate of the next one.
    pub fn step(&mut self) {
        self.steps += 1;
        self.apply();
    }

    /// Optimizer steps recorded so far.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// The learning rate this scheduler last set (the one the next optimizer step uses), of the
    /// first parameter group.
    pub fn last_lr(&self) -> f64 {
        self.last_lrs[0]
    }

    /// The learning rates this scheduler last set, one per parameter group (PyTorch's
    /// `get_last_lr()`).
    pub fn last_lrs(&self) -> &[f64] {
        &self.last_lrs
    }

    /// The learning rate the factors multiply, of the first parameter group.
    pub fn base_lr(&self) -> f64 {
        self.base_lrs[0]
    }

    /// The learning rates the factors multiply, one per parameter group.
    pub fn base_lrs(&self) -> &[f64] {
        &self.base_lrs
    }

    /// The schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Whether this scheduler writes `lr` (the handle of the optimizer it drives).
    pub(crate) fn drives(&self, lr: &LearningRate) -> bool {
        self.lr.shares_value_with(lr)
    }

    /// What [`load_state`](Self::load_state) needs to resume.
    pub fn state(&self) -> SchedulerState {
        SchedulerState {
            steps: self.steps,
            base_lr: self.base_lrs[0],
            group_base_lrs: self.base_lrs[1..].to_vec(),
        }
    }

    /// Resumes from `state` and sets the learning rates for step `state.steps` at once, so the
    /// result does not depend on whether the optimizer's state was loaded before or after. A state
    /// with another number of parameter groups is refused, and nothing changes.
    pub fn load_state(&mut self, state: &SchedulerState) -> Result<()> {
        let base_lrs = state.base_lrs();
        if base_lrs.len() != self.base_lrs.len() {
            return Err(Error::Optimizer(format!(
                "the scheduler state holds base learning rates for {} parameter group(s) but this \
                 scheduler drives {}; build the optimizer with the same groups as the run that \
                 saved it",
                base_lrs.len(),
                self.base_lrs.len()
            )));
        }
        for &base_lr in &base_lrs {
            check_base_lr(base_lr)?;
        }
        self.steps = state.steps;
        self.base_lrs = base_lrs;
        self.apply();
        Ok(())
    }

    fn apply(&mut self) {
        let factor = self.schedule.factor(self.steps);
        self.last_lrs = self.base_lrs.iter().map(|b| b * factor).collect();
        self.lr
            .set_all(&self.last_lrs)
            .expect("one base rate per group of the handle, checked at new and load_state");
    }
}

fn check_base_lr(base_lr: f64) -> Result<()> {
    if base_lr.is_finite() && base_lr >= 0.0 {
        Ok(())
    } else {
        Err(Error::Optimizer(format!(
            "base learning rate is {base_lr}; it must be finite and >= 0 (set the optimizer's \
             lr, or the saved scheduler state's base_lr)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use super::*;
    use crate::optim::test_util::{buffers, named, values};
    use crate::optim::{Optimizer, Sgd, SgdConfig};

    /// The learning rates a scheduler sets for optimizer steps 0..n.
    fn sequence(base: f64, schedule: Schedule, n: usize) -> Vec<f64> {
        let lr = LearningRate::new(base);
        let mut s = LrScheduler::new(lr.clone(), schedule).unwrap();
        let mut out = vec![lr.get()];
        for _ in 1..n {
            s.step();
            assert_eq!(s.last_lr(), lr.get());
            out.push(lr.get());
        }
        assert_eq!(s.steps(), n - 1);
        out
    }

    fn assert_seq(actual: &[f64], expected: &[f64]) {
        assert_eq!(actual.len(), expected.len());
        for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
            assert!((a - e).abs() < 1e-12, "step {i}: got {a}, expected {e}");
        }
    }

    #[test]
    fn constant_and_constant_with_warmup() {
        assert_seq(&sequence(0.3, Schedule::Constant, 4), &[0.3; 4]);
        assert_seq(
            &sequence(0.4, Schedule::ConstantWithWarmup { warmup_steps: 4 }, 7),
            &[0.0, 0.1, 0.2, 0.3, 0.4, 0.4, 0.4],
        );
    }

    #[test]
    fn linear_warmup_then_decay_to_zero() {
        // Warm-up 0, 0.05, then (6 - i) / 4 · 0.1, then 0 for good.
        assert_seq(
            &sequence(
                0.1,
                Schedule::LinearWarmupDecay {
                    warmup_steps: 2,
                    total_steps: 6,
                },
                9,
            ),
            &[0.0, 0.05, 0.1, 0.075, 0.05, 0.025, 0.0, 0.0, 0.0],
        );
        // Without warm-up it starts at the base rate.
        assert_seq(
            &sequence(
                1.0,
                Schedule::LinearWarmupDecay {
                    warmup_steps: 0,
                    total_steps: 4,
                },
                5,
            ),
            &[1.0, 0.75, 0.5, 0.25, 0.0],
        );
    }

    #[test]
    fn cosine_warmup_then_half_period() {
        let half_sqrt2 = std::f64::consts::FRAC_1_SQRT_2;
        // Progress (i - 2) / 4 after a 2-step warm-up; 0.5 · (1 + cos(π · progress)).
        let expected = [
            0.0,
            0.5,
            1.0,
            0.5 * (1.0 + half_sqrt2),
            0.5,
            0.5 * (1.0 - half_sqrt2),
            0.0,
            // transformers does not clamp the progress: past the end the cosine climbs again.
            0.5 * (1.0 - half_sqrt2),
        ];
        assert_seq(
            &sequence(
                1.0,
                Schedule::CosineWithWarmup {
                    warmup_steps: 2,
                    total_steps: 6,
                },
                8,
            ),
            &expected,
        );
        assert_eq!(
            Schedule::CosineWithWarmup {
                warmup_steps: 2,
                total_steps: 6
            }
            .factor(10),
            1.0
        );
    }

    #[test]
    fn invalid_schedules_are_rejected() {
        let lr = LearningRate::new(0.1);
        let err = LrScheduler::new(
            lr.clone(),
            Schedule::LinearWarmupDecay {
                warmup_steps: 5,
                total_steps: 4,
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("warmup_steps 5") && err.contains("total_steps 4"),
            "{err}"
        );
        let err = LrScheduler::new(
            lr.clone(),
            Schedule::CosineWithWarmup {
                warmup_steps: 0,
                total_steps: 0,
            },
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("total_steps 0"), "{err}");
        lr.set(-1.0);
        assert!(LrScheduler::new(lr, Schedule::Constant).is_err());
    }

    #[test]
    fn state_round_trip_resumes_the_sequence() {
        let schedule = Schedule::LinearWarmupDecay {
            warmup_steps: 2,
            total_steps: 10,
        };
        let lr = LearningRate::new(0.2);
        let mut s = LrScheduler::new(lr.clone(), schedule).unwrap();
        for _ in 0..4 {
            s.step();
        }
        let saved = s.state();
        assert_eq!(
            saved,
            SchedulerState {
                steps: 4,
                base_lr: 0.2,
                group_base_lrs: vec![]
            }
        );

        // A fresh run whose optimizer lr differs: the saved base wins, the rate of step 4 is set.
        let lr2 = LearningRate::new(0.7);
        let mut resumed = LrScheduler::new(lr2.clone(), schedule).unwrap();
        resumed.load_state(&saved).unwrap();
        assert!((lr2.get() - 0.2 * 6.0 / 8.0).abs() < 1e-15);
        s.step();
        resumed.step();
        assert_eq!((resumed.steps(), lr2.get()), (s.steps(), lr.get()));
        assert!(resumed
            .load_state(&SchedulerState {
                steps: 0,
                base_lr: f64::NAN,
                group_base_lrs: vec![]
            })
            .is_err());
    }

    #[test]
    fn each_group_is_scaled_from_its_own_base_rate() {
        // LambdaLR: group i's rate at step s is base_i · factor(s).
        let lr = LearningRate::per_group(&[0.1, 0.02, 0.0]);
        let schedule = Schedule::LinearWarmupDecay {
            warmup_steps: 1,
            total_steps: 3,
        };
        let mut s = LrScheduler::new(lr.clone(), schedule).unwrap();
        let factors = [0.0, 1.0, 0.5, 0.0];
        for (step, f) in factors.iter().enumerate() {
            if step > 0 {
                s.step();
            }
            let expected = [0.1 * f, 0.02 * f, 0.0];
            assert_eq!(lr.get_all(), expected, "step {step}");
            assert_eq!(s.last_lrs(), expected);
        }
        let saved = s.state();
        assert_eq!(
            (saved.base_lr, saved.group_base_lrs.clone()),
            (0.1, vec![0.02, 0.0])
        );

        // Resuming takes every group's saved base rate; another group count is refused.
        let lr2 = LearningRate::per_group(&[1.0, 1.0, 1.0]);
        let mut resumed = LrScheduler::new(lr2.clone(), schedule).unwrap();
        let mut at_step_2 = saved.clone();
        at_step_2.steps = 2;
        resumed.load_state(&at_step_2).unwrap();
        assert_eq!(lr2.get_all(), [0.05, 0.01, 0.0]);
        let mut one = LrScheduler::new(LearningRate::new(0.3), schedule).unwrap();
        let err = one.load_state(&saved).unwrap_err().to_string();
        assert!(
            err.contains("3 parameter group(s)") && err.contains("drives 1"),
            "{err}"
        );
        assert_eq!(
            (one.steps(), one.base_lrs()),
            (0, &[0.3][..]),
            "nothing loaded"
        );
    }

    #[test]
    fn the_scheduler_drives_the_optimizer() {
        // SGD with g = 1: every step moves p by exactly the rate the scheduler set for it.
        let mut opt = Sgd::new(
            named(&[("w", &[1.0])], DType::F64),
            SgdConfig {
                lr: 0.1,
                ..Default::default()
            },
        )
        .unwrap();
        let mut s = LrScheduler::new(
            opt.learning_rate().clone(),
            Schedule::LinearWarmupDecay {
                warmup_steps: 2,
                total_steps: 4,
            },
        )
        .unwrap();
        let mut trajectory = vec![];
        for _ in 0..5 {
            opt.step(buffers(opt.params(), &[("w", &[1.0])]).gradients())
                .unwrap();
            s.step();
            trajectory.push(values(&opt.params()[0].1)[0]);
        }
        // Rates 0, 0.05, 0.1, 0.05, 0.
        assert_seq(&trajectory, &[1.0, 0.95, 0.85, 0.8, 0.8]);
    }
}
