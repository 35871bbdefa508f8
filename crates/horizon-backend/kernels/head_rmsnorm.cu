// Per-head RMSNorm of the q and k parts of fused qkv rows (Qwen3's and Gemma 3's q_norm and
// k_norm, before rope), forward and backward. Shapes: inp, out, dout, dinp (N, QKV), row =
// [q (H*D) | k (KVH*D) | v (KVH*D)]; weight (2D) bf16 = [q_norm (D) | k_norm (D)] (as its 16
// bits), dweight (2D) fp32; rstd (N, H + KVH): row r's q heads, then its k heads. All
// arithmetic is fp32; a weight is applied as w' = w_offset + w. The v part is copied.
// Launcher: src/cuda/head_rmsnorm.rs. Reference: src/cpu/head_rmsnorm.rs; each head is one
// RMSNorm row of D (kernels/rmsnorm.cu), so its derivation carries over. For one head x (D),
// r = 1/sqrt(mean(x^2) + eps), out_k = x_k r w'_k:
//   d out_k / d x_m = r w'_k [k == m] - x_k w'_k r^3 x_m / D
//   dx_m = sum_k dy_k d out_k / d x_m = r (dy_m w'_m - x_m r^2 sum_k(dy_k w'_k x_k) / D)
//   dw_k = sum over the rows and heads that use w_k of dy_k x_k r   (w_offset drops out)
//
// Work split of the forward and dinp: one warp per head (or per v head, which is copied),
// ROWS warps per block, grid (N, ceil((H + 2 KVH) / ROWS)); the warp's sum is a shuffle tree,
// so each result has one fixed order. No D limit: lanes stride over the head.

#define ROWS 8
#define GROUPS 32

// The f32 of bf16 bits `h` (exact).
__device__ float bf16_to_f32(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }

// The weight as applied, w_offset + w in fp32; w itself for offset 0 (as kernels/rmsnorm.cu).
__device__ float applied(unsigned short w, float w_offset) {
    float x = bf16_to_f32(w);
    return w_offset == 0.0f ? x : w_offset + x;
}

__device__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// out, rstd: overwrite.
extern "C" __global__ void head_rmsnorm_forward(float* out, float* rstd, const float* inp,
                                                const unsigned short* weight, int h, int kvh,
                                                int d, float eps, float w_offset) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int head = blockIdx.y * ROWS + warp;
    if (head >= h + 2 * kvh) return;
    long long row = blockIdx.x;
    long long at = row * (h + 2 * kvh) * d + (long long)head * d;
    const float* x = inp + at;
    float* o = out + at;
    if (head >= h + kvh) {
        for (int k = lane; k < d; k += 32) o[k] = x[k];
        return;
    }
    const unsigned short* w = weight + (head < h ? 0 : d);
    float ss = 0.0f;
    for (int k = lane; k < d; k += 32) ss += x[k] * x[k];
    ss = warp_sum(ss);
    float rs = 1.0f / sqrtf(ss / (float)d + eps);
    if (lane == 0) rstd[row * (h + kvh) + head] = rs;
    for (int k = lane; k < d; k += 32) o[k] = x[k] * rs * applied(w[k], w_offset);
}

// dinp: overwrites; q and k heads as derived above, the v part = dout.
extern "C" __global__ void head_rmsnorm_backward_dinp(float* dinp, const float* dout,
                                                      const float* inp,
                                                      const unsigned short* weight,
                                                      const float* rstd, int h, int kvh, int d,
                                                      float w_offset) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int head = blockIdx.y * ROWS + warp;
    if (head >= h + 2 * kvh) return;
    long long row = blockIdx.x;
    long long at = row * (h + 2 * kvh) * d + (long long)head * d;
    const float* dy = dout + at;
    const float* x = inp + at;
    float* dx = dinp + at;
    if (head >= h + kvh) {
        for (int k = lane; k < d; k += 32) dx[k] = dy[k];
        return;
    }
    const unsigned short* w = weight + (head < h ? 0 : d);
    float s = 0.0f;
    for (int k = lane; k < d; k += 32) s += dy[k] * applied(w[k], w_offset) * x[k];
    s = warp_sum(s);
    float r = rstd[row * (h + kvh) + head];
    float c = r * r * s / (float)d;
    for (int k = lane; k < d; k += 32)
        dx[k] = r * (dy[k] * applied(w[k], w_offset) - x[k] * c);
}

// dweight[j] += sum over (row r, head hh) of dout * inp * rstd[r, hh] at column k of head hh,
// for j = k (the q heads) and j = D + k (the k heads). Accumulates. As rmsnorm's dweight: a
// block of 32 columns x GROUPS groups of (row, head) pairs; each thread sums its pairs in order
// (pair p = r * heads + head, p = g, g + GROUPS, ...), then the GROUPS partial sums are added
// in a fixed order, so the result does not depend on the block order (deterministic).
extern "C" __global__ void head_rmsnorm_backward_dweight(float* dweight, const float* dout,
                                                         const float* inp, const float* rstd,
                                                         int n, int h, int kvh, int d) {
    __shared__ float part[GROUPS][33];
    int j = blockIdx.x * 32 + threadIdx.x;
    int g = threadIdx.y;
    float acc = 0.0f;
    if (j < 2 * d) {
        int is_k = j >= d, k = j % d;
        int heads = is_k ? kvh : h, head0 = is_k ? h : 0;
        long long width = (long long)(h + 2 * kvh) * d;
        long long pairs = (long long)n * heads;
        for (long long p = g; p < pairs; p += GROUPS) {
            long long r = p / heads;
            int head = head0 + (int)(p % heads);
            long long i = r * width + (long long)head * d + k;
            acc += dout[i] * inp[i] * rstd[r * (h + kvh) + head];
        }
    }
    part[g][threadIdx.x] = acc;
    __syncthreads();
    if (g == 0 && j < 2 * d) {
        float s = 0.0f;
        for (int q = 0; q < GROUPS; q++) s += part[q][threadIdx.x];
        dweight[j] += s;
    }
}
