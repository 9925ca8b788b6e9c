// The optimizer updates of accelerate-core (optim/kernels.rs, optim/lion.rs) as multi-tensor CUDA
// kernels: one launch updates every parameter of a list, each with its own sizes, pointers and
// scalars, in one pass over its f32 master, gradient and state, and writes the rounded bf16/f16
// compute copy of mixed precision in the same pass.
//
// Compiled at run time by NVRTC with --fmad=false (see optim/cuda_kernels.rs), so every element
// follows the CPU kernel's operations in the same order, and the f32 results agree with the CPU to
// the last bit (sqrtf and division are correctly rounded under NVRTC's defaults). No header is
// included: NVRTC provides __float_as_uint, sqrtf and the launch built-ins.
//
// The launch: block b updates elements [c * chunk, min(n, (c + 1) * chunk)) of tensor t, where t is
// the last tensor with tensors[t].first_block <= b and c = b - tensors[t].first_block. Tensors of
// zero elements own no block. The tensor table lives in device memory and is uploaded again only
// when a pointer or a size changes; the per-step scalars (learning rate, bias corrections) come
// by value in the launch's parameters, as at most MAX_SETS sets of SCALARS floats that the tensors
// pick by index.

#define MAX_SETS 8
#define SCALARS 8

// Where a tensor's compute copy is and what it holds (TensorArgs::meta, bits 0-7).
#define COPY_NONE 0
#define COPY_BF16 1
#define COPY_F16 2

// One parameter: 8 words, as optim/cuda_kernels.rs writes them.
struct TensorArgs {
    unsigned long long p;            // float*: the f32 master (read and written)
    unsigned long long g;            // const float*: its gradient
    unsigned long long s0;           // float*: first state tensor (exp_avg, momentum_buffer), or 0
    unsigned long long s1;           // float*: second state tensor (exp_avg_sq), or 0
    unsigned long long copy;         // unsigned short*: the bf16/f16 compute copy, or 0
    unsigned long long n;            // elements
    unsigned long long first_block;  // the tensor's first block in the grid
    unsigned long long meta;         // bits 0-7: COPY_*; bits 8-15: the scalar set it reads
};

// The per-step scalars of every tensor of a launch, by value.
struct ScalarSets {
    float v[MAX_SETS * SCALARS];
};

// f32 -> bf16, round to nearest, ties to even: the result of cvt.rn.bf16.f32 (what candle's
// cast_f32_bf16 compiles to), NaN included (the canonical NaN 0x7fff).
__device__ __forceinline__ unsigned short f32_to_bf16_rn(const float f)
{
    const unsigned int x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return 0x7fffu;
    }
    // Adding 0x7fff plus the lowest kept bit carries into bit 16 exactly when the 16 dropped bits
    // are above half, or exactly half with an odd kept part; a carry out of the exponent gives inf.
    return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// f32 -> IEEE f16, round to nearest, ties to even: the result of cvt.rn.f16.f32 (what candle's
// cast_f32_f16 compiles to), written as cuda_fp16.hpp's software path: the truncated result and
// the dropped bits as a fraction of 2^32, then one increment for rounding up.
__device__ __forceinline__ unsigned short f32_to_f16_rn(const float f)
{
    const unsigned int x = __float_as_uint(f);
    unsigned int u = x & 0x7fffffffu;
    const unsigned int sign = (x >> 16) & 0x8000u;
    unsigned int result;
    unsigned int remainder;
    if (u >= 0x7f800000u) {
        // inf keeps its sign; NaN becomes the canonical NaN.
        remainder = 0u;
        result = (u == 0x7f800000u) ? (sign | 0x7c00u) : 0x7fffu;
    } else if (u > 0x477fefffu) {
        // At least 65520 (halfway from the largest finite f16, 65504, to 2^16): rounds to inf.
        remainder = 0x80000000u;
        result = sign | 0x7bffu;
    } else if (u >= 0x38800000u) {
        // Normal in f16: rebias the exponent, keep 10 mantissa bits.
        remainder = u << 19;
        u -= 0x38000000u;
        result = sign | (u >> 13);
    } else if (u < 0x33000001u) {
        // At most 2^-25, half the smallest subnormal: rounds to zero (a tie goes to even, 0).
        remainder = u;
        result = sign;
    } else {
        // Subnormal in f16: shift the mantissa, with its implicit bit, into place.
        const unsigned int exponent = u >> 23;
        const unsigned int shift = 0x7eu - exponent;
        unsigned int mantissa = (u & 0x7fffffu) | 0x800000u;
        remainder = mantissa << (32u - shift);
        result = sign | (mantissa >> shift);
        result &= 0xffffu;
    }
    if ((remainder > 0x80000000u) || ((remainder == 0x80000000u) && ((result & 1u) != 0u))) {
        result++;
    }
    return (unsigned short)result;
}

// The tensor that owns block `block`: the last one whose first block is at most `block`.
__device__ __forceinline__ unsigned int tensor_of_block(
    const TensorArgs* tensors, const unsigned int count, const unsigned long long block)
{
    unsigned int lo = 0;
    unsigned int hi = count - 1;
    while (lo < hi) {
        const unsigned int mid = lo + (hi - lo + 1) / 2;
        if (tensors[mid].first_block <= block) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// Writes `value`, rounded, into element i of the tensor's compute copy (if it has one).
__device__ __forceinline__ void store_copy(
    const unsigned int kind, unsigned short* copy, const unsigned long long i, const float value)
{
    if (kind == COPY_BF16) {
        copy[i] = f32_to_bf16_rn(value);
    } else if (kind == COPY_F16) {
        copy[i] = f32_to_f16_rn(value);
    }
}

// This block's tensor, its element range and its scalars.
struct BlockWork {
    TensorArgs t;
    unsigned long long begin;
    unsigned long long end;
    unsigned int copy_kind;
    float s[SCALARS];
};

__device__ __forceinline__ BlockWork block_work(
    const TensorArgs* tensors, const unsigned int count, const unsigned long long chunk,
    const ScalarSets& sets)
{
    BlockWork w;
    w.t = tensors[tensor_of_block(tensors, count, blockIdx.x)];
    w.begin = (blockIdx.x - w.t.first_block) * chunk;
    w.end = w.begin + chunk < w.t.n ? w.begin + chunk : w.t.n;
    w.copy_kind = (unsigned int)(w.t.meta & 0xffu);
    const unsigned int set = (unsigned int)((w.t.meta >> 8) & 0xffu);
    for (int k = 0; k < SCALARS; ++k) {
        w.s[k] = sets.v[set * SCALARS + k];
    }
    return w;
}

// The loop of every rule's kernel: each thread strides over this block's elements, updates one
// element with `Rule` (built once from the block's scalars) and writes its rounded compute copy.
// `Rule::update` takes the element's parameter and gradient, and its state tensors (which it
// reads and writes at element i), and returns the new parameter.
template <typename Rule>
__device__ __forceinline__ void update_block(
    const TensorArgs* tensors, const unsigned int count, const unsigned long long chunk,
    const ScalarSets& sets)
{
    const BlockWork w = block_work(tensors, count, chunk, sets);
    const Rule rule(w.s);
    float* p = (float*)w.t.p;
    const float* g = (const float*)w.t.g;
    float* s0 = (float*)w.t.s0;
    float* s1 = (float*)w.t.s1;
    unsigned short* copy = (unsigned short*)w.t.copy;
    for (unsigned long long i = w.begin + threadIdx.x; i < w.end; i += blockDim.x) {
        const float p_new = rule.update(p[i], g[i], s0, s1, i);
        p[i] = p_new;
        store_copy(w.copy_kind, copy, i, p_new);
    }
}

// The kernel `name` that runs update_block<Rule>. A macro because a kernel looked up by its
// unmangled name (extern "C") cannot be a template.
#define MULTI_TENSOR_KERNEL(name, Rule)                                                          \
    extern "C" __global__ void name(                                                             \
        const TensorArgs* tensors, const unsigned int count, const unsigned long long chunk,     \
        const ScalarSets sets)                                                                   \
    {                                                                                            \
        update_block<Rule>(tensors, count, chunk, sets);                                         \
    }

// AdamW (optim/kernels.rs, adamw). Scalars: decay (1 - lr wd), 1 - beta1, beta2, 1 - beta2,
// step_size (lr / (1 - beta1^t)), sqrt(1 - beta2^t), eps, and 1 when |1 - beta1| < 0.5 (which
// formula of torch.lerp applies) else 0. s0 = exp_avg, s1 = exp_avg_sq.
struct AdamW {
    float decay;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float neg_step_size;
    float bias_correction2_sqrt;
    float eps;
    bool small_weight;

    __device__ explicit AdamW(const float* s)
        : decay(s[0]), one_minus_beta1(s[1]), beta2(s[2]), one_minus_beta2(s[3]),
          neg_step_size(-s[4]), bias_correction2_sqrt(s[5]), eps(s[6]), small_weight(s[7] != 0.0f)
    {
    }

    __device__ float update(
        const float pi, const float gi, float* m, float* v, const unsigned long long i) const
    {
        const float decayed = pi * decay;
        const float mi = m[i];
        // torch.lerp(m, g, 1 - beta1), switching formula at weight 0.5 as PyTorch does.
        const float m_new = small_weight ? mi + one_minus_beta1 * (gi - mi)
                                         : gi - (gi - mi) * (1.0f - one_minus_beta1);
        const float v_new = v[i] * beta2 + one_minus_beta2 * gi * gi;
        const float denom = sqrtf(v_new) / bias_correction2_sqrt + eps;
        m[i] = m_new;
        v[i] = v_new;
        return decayed + neg_step_size * m_new / denom;
    }
};
MULTI_TENSOR_KERNEL(adamw_multi, AdamW)

// SGD (optim/kernels.rs, sgd). Scalars: lr, momentum, 1 - dampening, weight_decay, 1 for
// Nesterov, 1 when the momentum buffer was just created (it takes the gradient). s0 =
// momentum_buffer, absent (0) without momentum.
struct Sgd {
    float neg_lr;
    float momentum;
    float one_minus_dampening;
    float weight_decay;
    bool nesterov;
    bool first;

    __device__ explicit Sgd(const float* s)
        : neg_lr(-s[0]), momentum(s[1]), one_minus_dampening(s[2]), weight_decay(s[3]),
          nesterov(s[4] != 0.0f), first(s[5] != 0.0f)
    {
    }

    __device__ float update(
        const float pi, const float gi, float* buf, float*, const unsigned long long i) const
    {
        const float d = weight_decay != 0.0f ? gi + weight_decay * pi : gi;
        if (momentum == 0.0f) {
            return pi + neg_lr * d;
        }
        const float b_new = first ? d : buf[i] * momentum + one_minus_dampening * d;
        buf[i] = b_new;
        const float step = nesterov ? d + momentum * b_new : b_new;
        return pi + neg_lr * step;
    }
};
MULTI_TENSOR_KERNEL(sgd_multi, Sgd)

// Lion (optim/lion.rs). Scalars: decay (1 - lr wd), lr, beta1, 1 - beta1, beta2, 1 - beta2.
// s0 = exp_avg. sign(0) = 0.
struct Lion {
    float decay;
    float lr;
    float beta1;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;

    __device__ explicit Lion(const float* s)
        : decay(s[0]), lr(s[1]), beta1(s[2]), one_minus_beta1(s[3]), beta2(s[4]),
          one_minus_beta2(s[5])
    {
    }

    __device__ float update(
        const float pi, const float gi, float* m, float*, const unsigned long long i) const
    {
        const float mi = m[i];
        const float c = beta1 * mi + one_minus_beta1 * gi;
        const float sign = (float)(c > 0.0f) - (float)(c < 0.0f);
        m[i] = beta2 * mi + one_minus_beta2 * gi;
        return pi * decay - lr * sign;
    }
};
MULTI_TENSOR_KERNEL(lion_multi, Lion)
