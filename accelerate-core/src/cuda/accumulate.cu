// Adding one backward pass's gradient into its f32 gradient buffer on the GPU in one kernel: the
// gradient of any float dtype (f32, bf16, f16) and any layout (a Linear weight's comes back
// transposed), scaled, written or added in place; a contiguous one is indexed linearly. Without it
// the runtime runs three kernels per parameter: a cast to f32 (which also makes the layout
// contiguous), a scaling, and a copy into the bucket.
//
// Compiled at run time by NVRTC with --fmad=false (see cuda_accumulate.rs), so the scaling and the
// addition round as the CPU's `dst (+)= x * scale` does. No header is included.

#define MAX_DIMS 6

// The gradient's layout: its dims and strides (in elements), outermost first; rank <= MAX_DIMS.
struct Layout {
    unsigned long long dims[MAX_DIMS];
    long long strides[MAX_DIMS];
    unsigned long long rank;
};

#define SRC_F32 0
#define SRC_BF16 1
#define SRC_F16 2

// The quiet bit of an f32 NaN: the widenings set it, as the half crate's (and x86's) do, so that
// the GPU and the CPU widen a signaling NaN alike.
#define F32_QUIET 0x00400000u

// bf16 -> f32: exact, the bf16 bits are the top half of the f32's (a NaN made quiet).
__device__ __forceinline__ float bf16_to_f32(const unsigned short h)
{
    unsigned int x = ((unsigned int)h) << 16;
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        x |= F32_QUIET;
    }
    return __uint_as_float(x);
}

// IEEE f16 -> f32: exact. Normal numbers rebias the exponent; subnormals are their mantissa times
// 2^-24 (exact in f32); infinities keep their sign, NaN its mantissa bits (made quiet).
__device__ __forceinline__ float f16_to_f32(const unsigned short h)
{
    const unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    const unsigned int exponent = ((unsigned int)h >> 10) & 0x1fu;
    const unsigned int mantissa = (unsigned int)h & 0x3ffu;
    if (exponent == 0x1fu) {
        const unsigned int quiet = mantissa != 0u ? F32_QUIET : 0u;
        return __uint_as_float(sign | 0x7f800000u | (mantissa << 13) | quiet);
    }
    if (exponent != 0u) {
        return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
    }
    return __uint_as_float(sign | __float_as_uint((float)mantissa * 5.9604644775390625e-8f));
}

// Element `offset` of src, of kind SRC_*, widened exactly to f32.
__device__ __forceinline__ float load_f32(const void* src, const unsigned int src_kind,
                                          const long long offset)
{
    if (src_kind == SRC_BF16) {
        return bf16_to_f32(((const unsigned short*)src)[offset]);
    }
    if (src_kind == SRC_F16) {
        return f16_to_f32(((const unsigned short*)src)[offset]);
    }
    return ((const float*)src)[offset];
}

// dst[i] = scale * src[i] (overwrite) or dst[i] += scale * src[i], for the n elements of the
// gradient in row-major order; src points at the gradient's first element (its layout's offset
// already applied), of kind SRC_*. The general path: one division per dimension per element.
extern "C" __global__ void add_scaled_into_f32(
    float* dst, const void* src, const unsigned int src_kind, const unsigned long long n,
    const Layout layout, const float scale, const int overwrite)
{
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        unsigned long long rest = i;
        long long offset = 0;
        for (int d = (int)layout.rank - 1; d >= 0; --d) {
            const unsigned long long coordinate = rest % layout.dims[d];
            rest /= layout.dims[d];
            offset += (long long)coordinate * layout.strides[d];
        }
        const float t = load_f32(src, src_kind, offset) * scale;
        dst[i] = overwrite ? t : dst[i] + t;
    }
}

// The same for a gradient whose n elements are consecutive (its layout merged to one dimension of
// stride 1 on the host, as every contiguous gradient's does): element i is src[i].
extern "C" __global__ void add_scaled_linear_into_f32(
    float* dst, const void* src, const unsigned int src_kind, const unsigned long long n,
    const float scale, const int overwrite)
{
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        const float t = load_f32(src, src_kind, (long long)i) * scale;
        dst[i] = overwrite ? t : dst[i] + t;
    }
}
