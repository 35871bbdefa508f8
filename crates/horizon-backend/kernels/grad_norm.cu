// Gradient-norm reduction: partial sums of squares in double, one per block, in a fixed order
// (deterministic). The launcher (src/cuda/grad_norm.rs) adds the `blocks` partials on the host.
// Reference: `sum_squares` of the host optimizer (f64 accumulation).

#define BLOCK 256

// partial[b] = sum of x[i]^2 over the elements block b strides over. Overwrites.
extern "C" __global__ void grad_norm_partial(double* partial, const float* x, long long len) {
    __shared__ double shared[BLOCK / 32];
    double s = 0.0;
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < len;
         i += (long long)gridDim.x * BLOCK) {
        double v = x[i];
        s += v * v;
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) shared[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int w = 0; w < BLOCK / 32; w++) t += shared[w];
        partial[blockIdx.x] = t;
    }
}
