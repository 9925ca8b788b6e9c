//! The update rule of an elementwise optimizer: the only code an optimizer such as SGD or AdamW
//! writes. Everything around it (per-parameter state, the walk over the parameters, the choice
//! between a fused kernel and tensor ops, save and load) is
//! [`ElementwiseOptimizer`](super::ElementwiseOptimizer)'s.

use candle_core::Tensor;

#[cfg(feature = "cuda")]
use super::cuda_kernels::CudaUpdate;
use super::require;
use crate::error::{Error, Result};

/// The learning rate's name among the hyper-parameters (PyTorch's).
const LR: &str = "lr";

/// The per-element update of an optimizer whose parameters are updated independently, element by
/// element, from their gradient and a fixed number of state tensors of the parameter's shape.
///
/// The implementing type is the optimizer's configuration (its hyper-parameters): [`SgdConfig`]
/// and [`AdamWConfig`] are rules. Every update is written twice, once over f32 slices (the fused
/// path: one pass over the data, no temporary tensors) and once with candle tensor ops (any device
/// and dtype); the two must compute the same thing. A CUDA kernel is optional.
///
/// Under mixed precision the optimizer also writes each updated parameter's half-precision compute
/// copy: the fused path runs [`f32_kernel`](Self::f32_kernel) on cache-sized tiles and rounds each
/// tile into the copy right after, so a rule needs no code of its own for it.
///
/// [`SgdConfig`]: super::SgdConfig
/// [`AdamWConfig`]: super::AdamWConfig
///
/// `Default` is the configuration a saved state is loaded into (every hyper-parameter is then
/// replaced by the saved one).
pub trait UpdateRule: Clone + Default + std::fmt::Debug + Send + 'static {
    /// The kind written into saved state (`"sgd"`, `"adamw"`); a state loads only into its kind.
    const KIND: &'static str;

    /// The optimizer's name in error messages (`"SGD"`, `"AdamW"`).
    const NAME: &'static str;

    /// Whether the update depends on how many updates the parameter has had (AdamW's bias
    /// corrections). If so, the count is saved as `"step.<parameter>"`, as PyTorch does.
    const COUNTS_STEPS: bool;

    /// The hyper-parameters as saved in the state (`"lr"`, the learning rate, among them), each
    /// with where it lives in this configuration and its valid values: the one list of them that
    /// [`validate`](Self::validate), saving, loading and the learning-rate handle go through.
    fn hyper_parameters_mut(&mut self) -> Vec<HyperParameter<'_>>;

    /// Checks that involve several hyper-parameters at once, after each one's own range (SGD's
    /// Nesterov momentum needs a momentum); none by default.
    fn check_together(&self) -> Result<()> {
        Ok(())
    }

    /// Checks the hyper-parameters, each against its valid values in the listed order, then
    /// together; the error names the bad one and its valid range.
    fn validate(&self) -> Result<()> {
        for hyper_parameter in self.clone().hyper_parameters_mut() {
            hyper_parameter.check::<Self>()?;
        }
        self.check_together()
    }

    /// The learning rate this configuration starts with. Panics if the rule lists no `"lr"`
    /// hyper-parameter (a rule without a learning rate is a bug in the rule).
    fn lr(&self) -> f64 {
        self.hyper_parameters()
            .into_iter()
            .find_map(|(name, value)| (name == LR).then_some(value))
            .unwrap_or_else(|| panic!("{} lists no \"{LR}\" hyper-parameter", Self::NAME))
    }

    /// Replaces the learning rate (the optimizer reports its handle's current value this way).
    fn set_lr(&mut self, lr: f64) {
        for hyper_parameter in self.hyper_parameters_mut() {
            if hyper_parameter.name == LR {
                hyper_parameter.replace(lr);
            }
        }
    }

    /// The hyper-parameters as saved in the state, learning rate included: `(name, value)`.
    fn hyper_parameters(&self) -> Vec<(&'static str, f64)> {
        self.clone()
            .hyper_parameters_mut()
            .iter()
            .map(|h| (h.name, h.value()))
            .collect()
    }

    /// The configuration saved by [`hyper_parameters`](Self::hyper_parameters); `read` returns
    /// the value saved under a name, or an error naming what is missing. A flag saved as another
    /// value than 0 or 1 is refused; the caller validates the rest.
    fn from_hyper_parameters(read: &mut dyn FnMut(&str) -> Result<f64>) -> Result<Self> {
        let mut config = Self::default();
        for hyper_parameter in config.hyper_parameters_mut() {
            let saved = read(hyper_parameter.name)?;
            hyper_parameter.load::<Self>(saved)?;
        }
        Ok(config)
    }

    /// The names of the state tensors every parameter holds under this configuration, in the
    /// order the update functions receive them (`["exp_avg", "exp_avg_sq"]`; none for SGD without
    /// momentum). They are created as zeros at a parameter's first update and saved as
    /// `"<name>.<parameter>"`, PyTorch's names.
    fn state_names(&self) -> &'static [&'static str];

    /// The fused update of one parameter at step `at`:
    /// a kernel over the parameter's f32 elements, its gradient's, and its state tensors' (in
    /// [`state_names`](Self::state_names) order). The optimizer runs it once per parameter, or
    /// on matching chunks of all slices on several threads, so it must treat elements
    /// independently.
    fn f32_kernel(&self, at: Step) -> impl Fn(&mut [f32], &[f32], &mut [&mut [f32]]) + Sync;

    /// The same update with tensor ops: `param` and `grad` are detached copies in the state's
    /// dtype on the parameter's device; `state` is replaced by the new state tensors; the result
    /// is the parameter's new value.
    fn update_tensors(
        &self,
        param: &Tensor,
        grad: &Tensor,
        state: &mut [Tensor],
        at: Step,
    ) -> Result<Tensor>;

    /// The same update in the multi-tensor CUDA kernel: which kernel of
    /// `cuda/multi_tensor.cu`, and the scalars of this parameter's update at step `at`; `None` (the default) when the
    /// rule has no kernel, and the tensor-op path runs on a GPU instead.
    #[cfg(feature = "cuda")]
    fn cuda_update(&self, at: Step) -> Option<CudaUpdate> {
        let _ = at;
        None
    }
}

/// Where in training an update happens: what every update function of a rule is given.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    /// The learning rate of this step (the [`LearningRate`](super::LearningRate) handle's value).
    pub lr: f64,
    /// How many updates the parameter has had, this one included (from 1; AdamW's bias
    /// corrections use it).
    pub count: u64,
    /// Whether the parameter's state tensors were just created (SGD's first momentum buffer).
    pub first: bool,
}

/// The values a hyper-parameter may take; [`UpdateRule::validate`]'s error states the range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Valid {
    /// Finite and at least 0 (a learning rate, a weight decay, `eps`).
    NonNegative,
    /// In `[0, 1)` (AdamW's betas).
    BelowOne,
    /// In `[0, 1]` (Lion's betas).
    UpToOne,
    /// Any finite value (SGD's dampening).
    Finite,
}

impl Valid {
    fn holds(self, value: f64) -> bool {
        match self {
            Valid::NonNegative => value.is_finite() && value >= 0.0,
            Valid::BelowOne => (0.0..1.0).contains(&value),
            Valid::UpToOne => (0.0..=1.0).contains(&value),
            Valid::Finite => value.is_finite(),
        }
    }

    fn range(self) -> &'static str {
        match self {
            Valid::NonNegative => "must be >= 0",
            Valid::BelowOne => "must be in [0, 1)",
            Valid::UpToOne => "must be in [0, 1]",
            Valid::Finite => "must be finite",
        }
    }
}

/// One hyper-parameter of an [`UpdateRule`] as [`UpdateRule::hyper_parameters_mut`] lists it:
/// its name in the saved state and the field of the configuration that holds it.
#[derive(Debug)]
pub struct HyperParameter<'a> {
    name: &'static str,
    field: Field<'a>,
}

#[derive(Debug)]
enum Field<'a> {
    Real(&'a mut f64, Valid),
    /// Saved as 0 or 1.
    Flag(&'a mut bool),
}

impl<'a> HyperParameter<'a> {
    /// A real-valued hyper-parameter saved as `name`, valid as `valid` says.
    pub fn real(name: &'static str, field: &'a mut f64, valid: Valid) -> Self {
        Self {
            name,
            field: Field::Real(field, valid),
        }
    }

    /// An on/off hyper-parameter saved as `name`, as 0 or 1.
    pub fn flag(name: &'static str, field: &'a mut bool) -> Self {
        Self {
            name,
            field: Field::Flag(field),
        }
    }

    /// The value as saved.
    fn value(&self) -> f64 {
        match &self.field {
            Field::Real(v, _) => **v,
            Field::Flag(on) => f64::from(u8::from(**on)),
        }
    }

    fn replace(self, value: f64) {
        match self.field {
            Field::Real(v, _) => *v = value,
            Field::Flag(on) => *on = value == 1.0,
        }
    }

    /// Sets the value saved in a state of rule `R`; refuses a flag other than 0 or 1.
    fn load<R: UpdateRule>(self, saved: f64) -> Result<()> {
        if matches!(self.field, Field::Flag(_)) && saved != 0.0 && saved != 1.0 {
            return Err(Error::Optimizer(format!(
                "{} state scalar {:?} is {saved}; it must be 0 or 1",
                R::NAME,
                self.name
            )));
        }
        self.replace(saved);
        Ok(())
    }

    /// Checks the value against its valid range, naming rule `R` in the error.
    fn check<R: UpdateRule>(&self) -> Result<()> {
        let Field::Real(value, valid) = &self.field else {
            return Ok(());
        };
        let what = if self.name == LR {
            "learning rate"
        } else {
            self.name
        };
        require(
            valid.holds(**value),
            &format!("{} {what}", R::NAME),
            **value,
            valid.range(),
        )
    }
}

/// `fn hyper_parameters_mut` for a configuration whose hyper-parameters are its fields of the same
/// names (so the saved name is the field's): the reals with their valid values, then the flags.
macro_rules! hyper_parameters {
    ($(#[$doc:meta])* $($real:ident: $valid:ident),+ $(; flags $($flag:ident),+)? $(,)?) => {
        $(#[$doc])*
        fn hyper_parameters_mut(&mut self) -> Vec<$crate::optim::HyperParameter<'_>> {
            use $crate::optim::{HyperParameter, Valid};
            vec![
                $(HyperParameter::real(stringify!($real), &mut self.$real, Valid::$valid),)+
                $($(HyperParameter::flag(stringify!($flag), &mut self.$flag),)+)?
            ]
        }
    };
}

pub(crate) use hyper_parameters;
