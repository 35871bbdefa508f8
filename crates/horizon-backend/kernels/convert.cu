// fp32 -> bf16 (stored as its 16 bits; no CUDA headers needed): the inputs of products, which
// take bf16 with fp32 accumulation, and gradients on their way to the host as bf16.
// Launcher: src/cuda/convert.rs; the host rounds the same way (src/bf16.rs, Bf16::from_f32).

// Round to nearest even; NaN stays NaN (quiet).
__device__ unsigned short f32_to_bf16(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// out[i] = bf16(inp[i]).
extern "C" __global__ void convert_f32_to_bf16(unsigned short* out, const float* inp,
                                               long long len) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) out[i] = f32_to_bf16(inp[i]);
}
