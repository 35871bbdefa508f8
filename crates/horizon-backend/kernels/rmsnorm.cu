// RMSNorm forward and backward. Shapes: inp, out, dout, dinp (N, C); weight, dweight (C);
// rstd (N). The weight is bf16 (the device's weight format, as its 16 bits); everything else,
// and all arithmetic, is fp32. The weight is applied as w' = w_offset + w (0 for Llama-style
// norms, 1 for Gemma's x * (1 + w)), added in fp32. Launcher: src/cuda/rmsnorm.rs. Reference
// and derivation: src/cpu/rmsnorm.rs; with out = inp * rstd * w', the offset enters dinp
// through w' only, and d out / d w = inp * rstd does not depend on it.

#define BLOCK 256

// The f32 of bf16 bits `h` (exact).
__device__ float bf16_to_f32(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }

// The weight as applied, w_offset + w in fp32; w itself for offset 0, so that a -0.0 weight
// keeps its sign (0 + -0 = +0) and the plain norm its bits (as the CPU's `applied`).
__device__ float applied(unsigned short w, float w_offset) {
    float x = bf16_to_f32(w);
    return w_offset == 0.0f ? x : w_offset + x;
}

// Sum of `v` over the block (BLOCK threads); every thread gets the result.
__device__ float block_sum(float v, float* shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float s = 0.0f;
    for (int w = 0; w < BLOCK / 32; w++) s += shared[w];
    return s;
}

// out = inp * rstd * (w_offset + weight), rstd = 1/sqrt(mean(inp^2) + eps). One block per
// row. out, rstd overwrite.
extern "C" __global__ void rmsnorm_forward(float* out, float* rstd, const float* inp,
                                           const unsigned short* weight, int n, int c, float eps,
                                           float w_offset) {
    __shared__ float shared[BLOCK / 32];
    long long row = blockIdx.x;
    const float* x = inp + row * c;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < c; j += BLOCK) ss += x[j] * x[j];
    ss = block_sum(ss, shared);
    float rs = 1.0f / sqrtf(ss / (float)c + eps);
    if (threadIdx.x == 0) rstd[row] = rs;
    float* o = out + row * c;
    for (int j = threadIdx.x; j < c; j += BLOCK) o[j] = x[j] * rs * applied(weight[j], w_offset);
}

// dinp[r] += rstd_r * (dout*w' - inp * rstd_r^2 * sum(dout*w'*inp) / C), w' = w_offset +
// weight. Accumulates. One block per row.
extern "C" __global__ void rmsnorm_backward_dinp(float* dinp, const float* dout, const float* inp,
                                                 const unsigned short* weight, const float* rstd,
                                                 int n, int c, float w_offset) {
    __shared__ float shared[BLOCK / 32];
    long long row = blockIdx.x;
    const float* dy = dout + row * c;
    const float* x = inp + row * c;
    float s = 0.0f;
    for (int j = threadIdx.x; j < c; j += BLOCK) s += dy[j] * applied(weight[j], w_offset) * x[j];
    s = block_sum(s, shared);
    float r = rstd[row];
    float k = r * r * s / (float)c;
    float* dx = dinp + row * c;
    for (int j = threadIdx.x; j < c; j += BLOCK)
        dx[j] += r * (dy[j] * applied(weight[j], w_offset) - x[j] * k);
}

// dweight[j] += sum_r dout[r, j] * inp[r, j] * rstd[r]. Accumulates. A block of 32 columns x 8
// row groups; each thread sums its rows in order, then the 8 partial sums are added in a fixed
// order (deterministic).
extern "C" __global__ void rmsnorm_backward_dweight(float* dweight, const float* dout,
                                                    const float* inp, const float* rstd, int n,
                                                    int c) {
    __shared__ float part[8][33];
    int j = blockIdx.x * 32 + threadIdx.x;
    int g = threadIdx.y;
    float acc = 0.0f;
    if (j < c) {
        for (int r = g; r < n; r += 8) {
            long long i = (long long)r * c + j;
            acc += dout[i] * inp[i] * rstd[r];
        }
    }
    part[g][threadIdx.x] = acc;
    __syncthreads();
    if (g == 0 && j < c) {
        float s = 0.0f;
        for (int k = 0; k < 8; k++) s += part[k][threadIdx.x];
        dweight[j] += s;
    }
}
