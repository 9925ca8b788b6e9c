//! The optimizer updates of [`kernels`](super::kernels) as CUDA kernels: one launch per parameter
//! reads and writes the parameter, its gradient and its state once, where the tensor-op
//! formulation launches a kernel (and allocates a tensor) per elementwise operation.
//!
//! The source is compiled once per process with NVRTC (the library candle's CUDA backend already
//! loads) and cached by candle's device under [`MODULE`]. Floating-point contraction is off
//! (`--fmad=false`), so each element follows the CPU kernel's operations in the same order and the
//! two paths agree to the last bit wherever `sqrtf` and division are correctly rounded (they are
//! with NVRTC's defaults, `--prec-sqrt=true --prec-div=true`).

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::{
    CudaView, CudaViewMut, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::cuda_backend::WrapErr;
use candle_core::CudaDevice;

use super::kernels::{AdamWCoefficients, SgdCoefficients};
use crate::error::{Error, Result};

/// The name candle's device caches the compiled module under.
const MODULE: &str = "accelerate_core_optim";

/// Threads per block; each thread strides over the parameter.
const BLOCK: u32 = 256;

/// At most this many blocks: enough to fill an H100/H200 several times over.
const MAX_BLOCKS: u32 = 4096;

const SOURCE: &str = r#"
extern "C" __global__ void adamw_f32(
    float* p, const float* g, float* m, float* v, const unsigned long long n,
    const float decay, const float one_minus_beta1, const float beta2,
    const float one_minus_beta2, const float step_size, const float bias_correction2_sqrt,
    const float eps, const int small_weight)
{
    const float neg_step_size = -step_size;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        const float gi = g[i];
        const float decayed = p[i] * decay;
        const float mi = m[i];
        // torch.lerp(m, g, 1 - beta1), switching formula at weight 0.5 as PyTorch does.
        const float m_new = small_weight ? mi + one_minus_beta1 * (gi - mi)
                                         : gi - (gi - mi) * (1.0f - one_minus_beta1);
        const float v_new = v[i] * beta2 + one_minus_beta2 * gi * gi;
        const float denom = sqrtf(v_new) / bias_correction2_sqrt + eps;
        p[i] = decayed + neg_step_size * m_new / denom;
        m[i] = m_new;
        v[i] = v_new;
    }
}

extern "C" __global__ void sgd_f32(
    float* p, const float* g, float* buf, const unsigned long long n, const float lr,
    const float momentum, const float one_minus_dampening, const float weight_decay,
    const int nesterov, const int first)
{
    const float neg_lr = -lr;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        const float d = weight_decay != 0.0f ? g[i] + weight_decay * p[i] : g[i];
        if (momentum == 0.0f) {
            p[i] += neg_lr * d;
            continue;
        }
        const float b_new = first ? d : buf[i] * momentum + one_minus_dampening * d;
        buf[i] = b_new;
        const float step = nesterov ? d + momentum * b_new : b_new;
        p[i] += neg_lr * step;
    }
}
"#;

/// The module's PTX, compiled on first use (the error is kept: compiling again would fail again).
fn ptx() -> Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    let compiled = PTX.get_or_init(|| {
        let options = CompileOptions {
            fmad: Some(false),
            ..Default::default()
        };
        compile_ptx_with_opts(SOURCE, options)
            .map(|ptx| ptx.to_src())
            .map_err(|e| e.to_string())
    });
    compiled.as_deref().map_err(|e| {
        Error::Optimizer(format!(
            "NVRTC could not compile the fused optimizer kernels: {e} (NVRTC comes with the CUDA \
             toolkit; put its libnvrtc on LD_LIBRARY_PATH)"
        ))
    })
}

fn launch_config(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS as usize) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One AdamW update of `p` (with gradient `g` and moments `m`, `v`, all of one length) on
/// `device`'s stream; the same arithmetic as [`kernels::adamw`](super::kernels::adamw).
pub(crate) fn adamw(
    device: &CudaDevice,
    p: &mut CudaViewMut<'_, f32>,
    g: &CudaView<'_, f32>,
    m: &mut CudaViewMut<'_, f32>,
    v: &mut CudaViewMut<'_, f32>,
    c: &AdamWCoefficients,
) -> Result<()> {
    let n = p.len();
    check_lengths("AdamW", n, &[g.len(), m.len(), v.len()])?;
    let func = device.get_or_load_custom_func("adamw_f32", MODULE, ptx()?)?;
    let mut args = func.builder();
    let n64 = n as u64;
    let small_weight = i32::from(c.one_minus_beta1.abs() < 0.5);
    args.arg(p)
        .arg(g)
        .arg(m)
        .arg(v)
        .arg(&n64)
        .arg(&c.decay)
        .arg(&c.one_minus_beta1)
        .arg(&c.beta2)
        .arg(&c.one_minus_beta2)
        .arg(&c.step_size)
        .arg(&c.bias_correction2_sqrt)
        .arg(&c.eps)
        .arg(&small_weight);
    // SAFETY: the arguments match the kernel's signature in SOURCE, and every slice holds `n`
    // elements (checked above).
    unsafe { args.launch(launch_config(n)) }.w()?;
    Ok(())
}

/// One SGD update of `p` on `device`'s stream; `buf` is the momentum buffer (`None` without
/// momentum) and `first` says it holds nothing yet. The arithmetic of
/// [`kernels::sgd`](super::kernels::sgd).
pub(crate) fn sgd(
    device: &CudaDevice,
    p: &mut CudaViewMut<'_, f32>,
    g: &CudaView<'_, f32>,
    buf: Option<&mut CudaViewMut<'_, f32>>,
    first: bool,
    c: &SgdCoefficients,
) -> Result<()> {
    let n = p.len();
    match &buf {
        Some(buf) => check_lengths("SGD", n, &[g.len(), buf.len()])?,
        None if c.momentum != 0.0 => {
            return Err(Error::Optimizer(
                "SGD with momentum needs its momentum buffer on the GPU".into(),
            ))
        }
        None => check_lengths("SGD", n, &[g.len()])?,
    }
    let func = device.get_or_load_custom_func("sgd_f32", MODULE, ptx()?)?;
    let n64 = n as u64;
    let (nesterov, first) = (i32::from(c.nesterov), i32::from(first));
    let mut args = func.builder();
    args.arg(p).arg(g);
    match buf {
        Some(buf) => args.arg(buf),
        // Without momentum the kernel never reads or writes `buf`: the gradient's pointer fills
        // the argument.
        None => args.arg(g),
    };
    args.arg(&n64)
        .arg(&c.lr)
        .arg(&c.momentum)
        .arg(&c.one_minus_dampening)
        .arg(&c.weight_decay)
        .arg(&nesterov)
        .arg(&first);
    // SAFETY: the arguments match the kernel's signature in SOURCE, and every slice holds `n`
    // elements (checked above).
    unsafe { args.launch(launch_config(n)) }.w()?;
    Ok(())
}

fn check_lengths(optimizer: &str, n: usize, others: &[usize]) -> Result<()> {
    if others.iter().any(|&len| len != n) {
        return Err(Error::Optimizer(format!(
            "{optimizer} on the GPU: the parameter has {n} elements but its gradient or state has \
             {others:?} (they must all be the same length)"
        )));
    }
    Ok(())
}
