//! The update rule of an elementwise optimizer: the only code an optimizer such as SGD or AdamW
//! writes. Everything around it (per-parameter state, the walk over the parameters, the choice
//! between a fused kernel and tensor ops, save and load) is
//! [`ElementwiseOptimizer`](super::ElementwiseOptimizer)'s.

use candle_core::Tensor;

use crate::error::Result;

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
pub trait UpdateRule: Clone + std::fmt::Debug + Send + 'static {
    /// The kind written into saved state (`"sgd"`, `"adamw"`); a state loads only into its kind.
    const KIND: &'static str;

    /// The optimizer's name in error messages (`"SGD"`, `"AdamW"`).
    const NAME: &'static str;

    /// Whether the update depends on how many updates the parameter has had (AdamW's bias
    /// corrections). If so, the count is saved as `"step.<parameter>"`, as PyTorch does.
    const COUNTS_STEPS: bool;

    /// Checks the hyper-parameters; the error names the bad one and its valid range.
    fn validate(&self) -> Result<()>;

    /// The learning rate this configuration starts with.
    fn lr(&self) -> f64;

    /// Replaces the learning rate (the optimizer reports its handle's current value this way).
    fn set_lr(&mut self, lr: f64);

    /// The hyper-parameters as saved in the state, learning rate included: `(name, value)`.
    fn hyper_parameters(&self) -> Vec<(&'static str, f64)>;

    /// The configuration saved by [`hyper_parameters`](Self::hyper_parameters); `read` returns
    /// the value saved under a name, or an error naming what is missing. The caller validates
    /// the result.
    fn from_hyper_parameters(read: &mut dyn FnMut(&str) -> Result<f64>) -> Result<Self>;

    /// The names of the state tensors every parameter holds under this configuration, in the
    /// order the update functions receive them (`["exp_avg", "exp_avg_sq"]`; none for SGD without
    /// momentum). They are created as zeros at a parameter's first update and saved as
    /// `"<name>.<parameter>"`, PyTorch's names.
    fn state_names(&self) -> &'static [&'static str];

    /// The fused update at learning rate `lr` of a parameter's `step`-th update (from 1):
    /// a kernel over the parameter's f32 elements, its gradient's, and its state tensors' (in
    /// [`state_names`](Self::state_names) order). The optimizer runs it once per parameter, or
    /// on matching chunks of all slices on several threads, so it must treat elements
    /// independently. `first` says the state tensors were just created.
    fn f32_kernel(
        &self,
        lr: f64,
        step: u64,
        first: bool,
    ) -> impl Fn(&mut [f32], &[f32], &mut [&mut [f32]]) + Sync;

    /// The same update with tensor ops: `param` and `grad` are detached copies in the state's
    /// dtype on the parameter's device; `state` is replaced by the new state tensors; the result
    /// is the parameter's new value.
    fn update_tensors(
        &self,
        param: &Tensor,
        grad: &Tensor,
        state: &mut [Tensor],
        lr: f64,
        step: u64,
        first: bool,
    ) -> Result<Tensor>;

    /// The same update in the multi-tensor CUDA kernel: which kernel of
    /// `cuda/multi_tensor.cu`, and the scalars of this parameter's update at learning rate `lr`,
    /// `step` and `first` as in [`f32_kernel`](Self::f32_kernel); `None` (the default) when the
    /// rule has no kernel, and the tensor-op path runs on a GPU instead.
    #[cfg(feature = "cuda")]
    fn cuda_update(&self, lr: f64, step: u64, first: bool) -> Option<CudaUpdate> {
        let _ = (lr, step, first);
        None
    }
}

/// One parameter's update as the multi-tensor CUDA kernel of its rule runs it: the kernel and the
/// scalars it reads (see [`UpdateRule::cuda_update`]).
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CudaUpdate {
    pub(crate) kernel: super::cuda_kernels::Kernel,
    pub(crate) scalars: [f32; super::multi_tensor::SCALARS],
}
