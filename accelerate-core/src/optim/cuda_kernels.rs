//! The optimizer updates of [`kernels`](super::kernels) as multi-tensor CUDA kernels
//! (`cuda/multi_tensor.cu`): one launch updates every parameter of a step on a GPU, reading and
//! writing each parameter, its gradient and its state once, and writing its rounded compute copy
//! (mixed precision) in the same pass. The single-tensor formulation launches a kernel per
//! parameter, plus a cast per compute copy after the step.
//!
//! A step queues its parameters in a [`CudaBatch`] and launches it once at the end; the tensor
//! table of each launch ([`multi_tensor`](super::multi_tensor)) stays on the device in a
//! [`MultiTensorCache`] and is uploaded again only when an address or a size changes. candle's
//! `Var::set` copies into the variable's storage, so the parameters' and compute copies' addresses
//! never change; the state's change when it is created or loaded, and the gradients' only if their
//! buckets are reallocated.
//!
//! The source is compiled once per process with NVRTC (the library candle's CUDA backend already
//! loads) and cached by candle's device under [`MODULE`]; where NVRTC cannot compile it (or the
//! driver cannot load it), every parameter takes the tensor-op path, with one warning
//! ([`runtime_kernels`](crate::runtime_kernels)). Floating-point contraction is off
//! (`--fmad=false`), so each element follows the CPU kernel's operations in the same order and the
//! two paths agree to the last bit wherever `sqrtf` and division are correctly rounded (they are
//! with NVRTC's defaults, `--prec-sqrt=true --prec-div=true`).

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, DType, Tensor};
use half::{bf16, f16};

use super::multi_tensor::{
    plan_launches, CopyKind, LaunchPlan, TensorSlot, CHUNK, MAX_SETS, SCALARS,
};
use crate::cuda_slices::{cuda_address, cuda_address_mut};
use crate::error::{Error, Result};
use crate::runtime_kernels::RuntimeKernels;

/// The kernels' source. Only NVRTC compiles it, on a GPU machine: fused-kernels' CPU emulator
/// builds the `.cu` files of fused-kernels alone, so on a machine without a GPU nothing runs it;
/// the GPU conformance test compares it with the CPU kernels bit for bit.
const SOURCE: &str = include_str!("cuda/multi_tensor.cu");

/// The name candle's device caches the compiled module under.
const MODULE: &str = "accelerate_core_optim_multi_tensor";

/// The compiled kernels, or the tensor-op path when NVRTC cannot compile them.
static KERNELS: RuntimeKernels = RuntimeKernels::new("the fused optimizer kernels", MODULE, SOURCE);

/// Threads per block; each block updates one chunk of [`CHUNK`] elements of one tensor.
const BLOCK: u32 = 256;

/// One parameter's update as the multi-tensor CUDA kernel of its rule runs it: the kernel and the
/// scalars it reads (see [`UpdateRule::cuda_update`](super::UpdateRule::cuda_update)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CudaUpdate {
    pub(crate) kernel: Kernel,
    pub(crate) scalars: [f32; SCALARS],
}

/// The kernels' names in [`SOURCE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// `adamw_multi`.
    AdamW,
    /// `sgd_multi`.
    Sgd,
    /// `lion_multi`.
    Lion,
}

impl Kernel {
    fn name(self) -> &'static str {
        match self {
            Self::AdamW => "adamw_multi",
            Self::Sgd => "sgd_multi",
            Self::Lion => "lion_multi",
        }
    }
}

/// The scalar sets of a launch, passed by value (`ScalarSets` in the source).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ScalarSets([f32; MAX_SETS * SCALARS]);

// SAFETY: a plain array of f32, laid out as the kernels' `struct ScalarSets { float v[64]; }`.
unsafe impl DeviceRepr for ScalarSets {}

/// The parameters of one step that run on a GPU, queued to be updated by one launch per device.
#[derive(Debug, Default)]
pub(crate) struct CudaBatch {
    kernel: Option<Kernel>,
    slots: Vec<(CudaDevice, TensorSlot)>,
}

impl CudaBatch {
    /// Queues the update of `param` (from `grad`, with `state`, writing `copy` if given) by
    /// `update`; `Ok(false)`, with nothing queued, when some tensor is not a contiguous CUDA tensor
    /// of the right dtype (f32; bf16 or f16 for the copy) on the parameter's GPU, the rule keeps
    /// more than two state tensors, or the kernels could not be compiled or loaded. The caller
    /// keeps the tensors alive until [`launch`](Self::launch).
    pub fn push(
        &mut self,
        update: &CudaUpdate,
        param: &Tensor,
        grad: &Tensor,
        state: &[Tensor],
        copy: Option<&Tensor>,
    ) -> Result<bool> {
        if state.len() > 2 || self.kernel.is_some_and(|k| k != update.kernel) {
            return Ok(false);
        }
        let Ok(cuda) = param.device().as_cuda_device() else {
            return Ok(false);
        };
        if KERNELS.function(cuda, update.kernel.name())?.is_none() {
            return Ok(false);
        }
        // A kernel on the parameter's stream cannot read another GPU's memory: a tensor elsewhere
        // takes the tensor-op path, which moves it.
        let on_param_device = |t: &Tensor| t.device().same_device(param.device());
        if !on_param_device(grad)
            || !state.iter().all(on_param_device)
            || !copy.is_none_or(on_param_device)
        {
            return Ok(false);
        }
        let n = param.elem_count();
        if grad.elem_count() != n
            || state.iter().any(|s| s.elem_count() != n)
            || copy.is_some_and(|c| c.elem_count() != n)
        {
            return Err(Error::Optimizer(format!(
                "a parameter on the GPU has {n} elements but its gradient, state or compute copy \
                 has another count (they must all be the same length)"
            )));
        }
        let Some((device, p)) = cuda_address_mut::<f32>(param, DType::F32)? else {
            return Ok(false);
        };
        let Some((_, g)) = cuda_address::<f32>(grad, DType::F32)? else {
            return Ok(false);
        };
        let mut addresses = [0u64; 2];
        for (address, tensor) in addresses.iter_mut().zip(state) {
            let Some((_, a)) = cuda_address_mut::<f32>(tensor, DType::F32)? else {
                return Ok(false);
            };
            *address = a;
        }
        let (copy, copy_kind) = match copy.map(|c| (c, c.dtype())) {
            None => (0, CopyKind::None),
            Some((c, DType::BF16)) => match cuda_address_mut::<bf16>(c, DType::BF16)? {
                Some((_, a)) => (a, CopyKind::Bf16),
                None => return Ok(false),
            },
            Some((c, DType::F16)) => match cuda_address_mut::<f16>(c, DType::F16)? {
                Some((_, a)) => (a, CopyKind::F16),
                None => return Ok(false),
            },
            Some(_) => return Ok(false),
        };
        self.kernel = Some(update.kernel);
        self.slots.push((
            device,
            TensorSlot {
                p,
                g,
                state: addresses,
                copy,
                copy_kind,
                n: n as u64,
                scalars: update.scalars,
            },
        ));
        Ok(true)
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Launches every queued update: one launch per device in the usual case (more only when the
    /// parameters need more than [`MAX_SETS`] distinct scalar sets), with the tensor tables kept
    /// in `cache`.
    pub fn launch(self, cache: &mut MultiTensorCache) -> Result<()> {
        let Some(kernel) = self.kernel else {
            return Ok(());
        };
        let mut by_device: Vec<(CudaDevice, Vec<TensorSlot>)> = Vec::new();
        for (device, slot) in self.slots {
            match by_device.iter_mut().find(|(d, _)| d.id() == device.id()) {
                Some((_, slots)) => slots.push(slot),
                None => by_device.push((device, vec![slot])),
            }
        }
        for (device, slots) in by_device {
            for (i, plan) in plan_launches(&slots).iter().enumerate() {
                let tables = cache.tables_of(&device);
                if tables.len() == i {
                    tables.push(DeviceTable::upload(&device, plan)?);
                } else {
                    tables[i].refresh(&device, plan)?;
                }
                launch_plan(&device, kernel, &cache.tables_of(&device)[i].table, plan)?;
                cache.launches += 1;
            }
        }
        Ok(())
    }
}

/// One launch of `kernel` over `plan`, whose table is `table` on the device.
fn launch_plan(
    device: &CudaDevice,
    kernel: Kernel,
    table: &CudaSlice<u64>,
    plan: &LaunchPlan,
) -> Result<()> {
    // `push` loaded it on this device before queueing anything.
    let func = KERNELS.function(device, kernel.name())?.ok_or_else(|| {
        Error::Optimizer(format!(
            "the fused optimizer kernel {} is not loaded on the GPU (see the warning above)",
            kernel.name()
        ))
    })?;
    let count = plan.tensors() as u32;
    let chunk = CHUNK;
    let sets = ScalarSets(plan.sets);
    let stream = device.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(table).arg(&count).arg(&chunk).arg(&sets);
    let config = LaunchConfig {
        grid_dim: (plan.blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature in SOURCE; the table holds `count`
    // tensors whose addresses were taken from live tensors of the lengths recorded beside them
    // (checked in `push`), kept alive by the caller until this launch is queued, and the grid has
    // exactly the blocks the table assigns.
    unsafe { args.launch(config) }.w()?;
    Ok(())
}

/// The tensor tables of an optimizer's launches, on each device, kept between steps.
#[derive(Debug, Default)]
pub(crate) struct MultiTensorCache {
    devices: Vec<(CudaDevice, Vec<DeviceTable>)>,
    /// Kernel launches so far (tests check that a step is one launch).
    launches: u64,
}

impl MultiTensorCache {
    fn tables_of(&mut self, device: &CudaDevice) -> &mut Vec<DeviceTable> {
        let i = match self.devices.iter().position(|(d, _)| d.id() == device.id()) {
            Some(i) => i,
            None => {
                self.devices.push((device.clone(), Vec::new()));
                self.devices.len() - 1
            }
        };
        &mut self.devices[i].1
    }

    /// Kernel launches so far.
    #[cfg(test)]
    pub fn launches(&self) -> u64 {
        self.launches
    }

    /// Tables uploaded so far (tests check that an unchanged table is not uploaded again).
    #[cfg(test)]
    pub fn uploads(&self) -> u64 {
        self.devices
            .iter()
            .flat_map(|(_, tables)| tables.iter().map(|t| t.uploads))
            .sum()
    }
}

/// One launch's tensor table, on the device and as last uploaded.
struct DeviceTable {
    host: Vec<u64>,
    table: CudaSlice<u64>,
    uploads: u64,
}

impl std::fmt::Debug for DeviceTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceTable")
            .field("words", &self.host.len())
            .field("uploads", &self.uploads)
            .finish()
    }
}

impl DeviceTable {
    fn upload(device: &CudaDevice, plan: &LaunchPlan) -> Result<Self> {
        let table = device.cuda_stream().clone_htod(&plan.table).w()?;
        Ok(Self {
            host: plan.table.clone(),
            table,
            uploads: 1,
        })
    }

    /// Uploads `plan`'s table if it differs from the one on the device. The copy is queued on the
    /// stream, after the launches that read the old table.
    fn refresh(&mut self, device: &CudaDevice, plan: &LaunchPlan) -> Result<()> {
        if self.host == plan.table {
            return Ok(());
        }
        let stream = device.cuda_stream();
        if self.table.len() == plan.table.len() {
            stream.memcpy_htod(&plan.table, &mut self.table).w()?;
        } else {
            self.table = stream.clone_htod(&plan.table).w()?;
        }
        self.host.clone_from(&plan.table);
        self.uploads += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use crate::grads::GradientBuffers;
    use crate::optim::conformance::bits;
    use crate::optim::{Optimizer, Sgd, SgdConfig};

    /// f32 values at the edges of bf16 and f16 rounding: ties to even each way, the largest finite
    /// values and what rounds past them, subnormals, the smallest magnitudes, zeros of both signs,
    /// infinities and NaN.
    fn edge_values() -> Vec<f32> {
        let mut v = vec![
            0.0,
            -0.0,
            1.0,
            1.0 + 2f32.powi(-8),       // bf16 tie, to even: 1
            1.0 + 3.0 * 2f32.powi(-8), // bf16 tie, to even: up
            1.0 + 2f32.powi(-11),      // f16 tie, to even: 1
            1.0 + 3.0 * 2f32.powi(-11),
            65504.0,
            65519.996,
            65520.0, // f16: ties to inf
            -1e6,
            f32::MAX,
            -f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-45,
            2f32.powi(-25), // f16: half the smallest subnormal, to even: 0
            1.5 * 2f32.powi(-25),
            2f32.powi(-24),
            6.0e-5, // f16 subnormal
            6.1035156e-5,
            3.0e-38,
        ];
        // And ordinary values over every exponent.
        let mut x = 0x1234_5678u32;
        for e in -30..30 {
            x = x.wrapping_mul(1664525).wrapping_add(1013904223);
            let m = 1.0 + (x >> 9) as f32 / (1u32 << 23) as f32;
            v.push(m * 2f32.powi(e) * if x & 1 == 0 { 1.0 } else { -1.0 });
        }
        v
    }

    /// The compute copies the kernel writes are bitwise what candle's CUDA cast of the updated
    /// master gives (`cast_f32_bf16`, `cast_f32_f16`: the refresh the kernel replaces). An SGD step
    /// at learning rate 0 with a zero gradient leaves the masters as they are (NaN aside, which
    /// the GPU's arithmetic makes canonical before both roundings), so the edge values reach the
    /// rounding.
    #[test]
    #[ignore = "needs a GPU (scripts/gpu-build.sh build, then run on a GPU machine)"]
    fn the_compute_copies_round_as_candles_cuda_cast() {
        let cuda = Device::new_cuda(0).expect("a GPU (this test is ignored without one)");
        let values = edge_values();
        let n = values.len();
        for dtype in [candle_core::DType::BF16, candle_core::DType::F16] {
            let master = Var::from_tensor(&Tensor::new(values.as_slice(), &cuda).unwrap()).unwrap();
            let params = vec![("w".to_string(), master.clone())];
            let copy = Var::zeros(n, dtype, &cuda).unwrap();
            let config = SgdConfig {
                lr: 0.0,
                ..SgdConfig::default()
            };
            let mut opt = Sgd::new(params.clone(), config).unwrap();
            opt.set_compute_copies(&[("w".to_string(), copy.clone())])
                .unwrap();
            let mut grads = GradientBuffers::new(&params, 1 << 20).unwrap();
            grads
                .accumulate_one(
                    "w",
                    &Tensor::zeros(n, candle_core::DType::F32, &cuda).unwrap(),
                    1.0,
                )
                .unwrap();
            opt.step(grads.gradients()).unwrap();
            assert_eq!(opt.fallback_updates, 0);
            assert!(opt.wrote_compute_copy("w"));
            let cast = master.as_tensor().to_dtype(dtype).unwrap();
            let (got, want) = (bits(&copy), bits(&cast));
            for (i, v) in values.iter().enumerate() {
                assert_eq!(got[i], want[i], "{dtype:?}: {v:e} ({:#010x})", v.to_bits());
            }
        }
    }
}
