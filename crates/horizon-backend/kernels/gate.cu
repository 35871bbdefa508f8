// The sigmoid row gate (Qwen2-MoE's shared expert): out[r] = sigmoid(gate[r]) * inp[r]. Shapes:
// gate, dgate (N); inp, out, dout, dinp (N, C). Launcher: src/cuda/gate.rs. Reference and
// derivation: src/cpu/gate.rs.
//
// The backward's row sum runs in one block in a fixed shape (each thread's columns in order,
// then a xor tree over each warp, then the warps' sums in order), with no atomics: results are
// deterministic; against the CPU (one sum in column order) they differ in the last bits only.
// `__fmul_rn` keeps a product rounded on its own (no contraction into an FMA), as the CPU
// computes it.

#define BLOCK 256

__device__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// out[r, j] = sigmoid(gate[r]) * inp[r, j]; out overwrites. One thread per element.
extern "C" __global__ void sigmoid_gate_forward(float* out, const float* gate, const float* inp,
                                                long long n, long long c) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * c) return;
    out[i] = __fmul_rn(sigmoid(gate[i / c]), inp[i]);
}

// One block of BLOCK threads per row r (the grid is N blocks), s = sigmoid(gate[r]); both
// overwrite:
//   dinp[r, j] = s * dout[r, j];
//   dgate[r] = (s * (1 - s)) * sum_j dout[r, j] * inp[r, j] (thread t sums j = t, t + BLOCK, ...
//   in order; a xor tree over its warp; thread 0 adds the warps' sums in order).
extern "C" __global__ void sigmoid_gate_backward(float* dinp, float* dgate, const float* dout,
                                                 const float* gate, const float* inp,
                                                 long long c) {
    __shared__ float warp_sums[BLOCK / 32];
    long long r = blockIdx.x;
    float s = sigmoid(gate[r]);
    const float* dy = dout + r * c;
    const float* x = inp + r * c;
    float* dx = dinp + r * c;
    float dot = 0.0f;
    for (long long j = threadIdx.x; j < c; j += BLOCK) {
        dx[j] = __fmul_rn(s, dy[j]);
        dot += __fmul_rn(dy[j], x[j]);
    }
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = dot;
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int w = 0; w < BLOCK / 32; w++) sum += warp_sums[w];
        dgate[r] = __fmul_rn(__fmul_rn(s, 1.0f - s), sum);
    }
}
