// Conversions between fp32 and bf16 (stored as its 16 bits; no CUDA headers needed), and the
// bf16 -> fp32 expansion of weights after they crossed the link as bf16.
// Launcher: src/cuda/convert.rs; the host side of the rounding is `cuda::convert::f32_to_bf16`.

// Round to nearest even; NaN stays NaN (quiet).
__device__ unsigned short f32_to_bf16(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

__device__ float bf16_to_f32(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }

// out[i] = bf16(inp[i]).
extern "C" __global__ void convert_f32_to_bf16(unsigned short* out, const float* inp,
                                               long long len) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) out[i] = f32_to_bf16(inp[i]);
}

// out[i] = f32(inp[i]) (exact).
extern "C" __global__ void convert_bf16_to_f32(float* out, const unsigned short* inp,
                                               long long len) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) out[i] = bf16_to_f32(inp[i]);
}
