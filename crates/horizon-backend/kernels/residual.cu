// Residual add and in-place accumulation over flat buffers of `len` elements.
// Launcher: src/cuda/residual.rs. Reference: src/cpu/residual.rs.

// out = a + b, overwrites.
extern "C" __global__ void residual_forward(float* out, const float* a, const float* b,
                                            long long len) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) out[i] = a[i] + b[i];
}

// acc += x (the residual backward, and gradient accumulation).
extern "C" __global__ void add_inplace(float* acc, const float* x, long long len) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) acc[i] += x[i];
}
