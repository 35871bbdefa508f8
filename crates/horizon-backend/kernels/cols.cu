// Column slices of row-major matrices (LoRA's per-target update of a fused q|k|v or gate|up
// output, and the gradient slice a target sees). One thread per element of the (N, w) slice.
// Launcher: src/cuda/cols.rs. Reference: src/cpu/cols.rs. `__fmul_rn` keeps the product
// rounded on its own (no contraction into an FMA), as the CPU computes it.

// out[r*out_w + col + j] += scale * src[r*w + j]; out (N, out_w) accumulates, src (N, w).
extern "C" __global__ void add_cols(float* out, const float* src, long long n, long long out_w,
                                    long long col, long long w, float scale) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * w) return;
    long long r = i / w, j = i % w;
    out[r * out_w + col + j] += __fmul_rn(scale, src[i]);
}

// out[r*w + j] = scale * src[r*src_w + col + j]; out (N, w) overwrites, src (N, src_w).
extern "C" __global__ void scaled_cols(float* out, const float* src, long long n,
                                       long long src_w, long long col, long long w, float scale) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * w) return;
    long long r = i / w, j = i % w;
    out[i] = __fmul_rn(scale, src[r * src_w + col + j]);
}
