// Cross-entropy over the vocabulary, one block per row: the forward (evaluation), the fused
// forward + backward that turns one LM-head chunk of logits (N, V) into dlogits in place, and
// the same over vocabulary tiles (N, VT) for an LM head applied a tile at a time: running
// stats per row, then dlogits per tile, then the losses from the stats.
// targets (N), -100 = ignored; losses (N); stats (N, 3) = (m, s, t). Launcher:
// src/cuda/cross_entropy.rs. Reference and derivation: src/cpu/cross_entropy.rs (the row max is
// subtracted, exponentials are fp32, the sum of exponentials is accumulated in double, the loss
// m + log(s) - x[k] formed in double and rounded once). Every reduction is in a fixed order
// (per-thread strides, then a warp butterfly, then the warps in order): no atomics, so a
// launch's result depends on its inputs only.

#define BLOCK 256

__device__ float block_max(float v, float* shared) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float m = shared[0];
    for (int w = 1; w < BLOCK / 32; w++) m = fmaxf(m, shared[w]);
    return m;
}

__device__ double block_sum_d(double v, double* shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    double s = 0.0;
    for (int w = 0; w < BLOCK / 32; w++) s += shared[w];
    return s;
}

// Row max m and s = sum_j exp(x_j - m) (double).
__device__ void row_stats(const float* x, int v, float* m_out, double* s_out) {
    __shared__ float smax[BLOCK / 32];
    __shared__ double ssum[BLOCK / 32];
    float m = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < v; j += BLOCK) m = fmaxf(m, x[j]);
    m = block_max(m, smax);
    double s = 0.0;
    for (int j = threadIdx.x; j < v; j += BLOCK) s += (double)expf(x[j] - m);
    s = block_sum_d(s, ssum);
    *m_out = m;
    *s_out = s;
}

// losses[r] = -log softmax(logits[r])[targets[r]], 0 on ignored rows. Overwrites.
extern "C" __global__ void cross_entropy_forward(float* losses, const float* logits,
                                                 const int* targets, int n, int v) {
    long long row = blockIdx.x;
    int k = targets[row];
    if (k == -100) {
        if (threadIdx.x == 0) losses[row] = 0.0f;
        return;
    }
    const float* x = logits + row * v;
    float m;
    double s;
    row_stats(x, v, &m, &s);
    if (threadIdx.x == 0) losses[row] = (float)((double)m + log(s) - (double)x[k]);
}

// In place: logits[r, j] <- scale * (exp(x_j - m) / s - [j == k]); zero rows where ignored.
// losses overwrite as in the forward.
extern "C" __global__ void cross_entropy_fused(float* logits, float* losses, const int* targets,
                                               int n, int v, float scale) {
    long long row = blockIdx.x;
    int k = targets[row];
    float* x = logits + row * v;
    if (k == -100) {
        if (threadIdx.x == 0) losses[row] = 0.0f;
        for (int j = threadIdx.x; j < v; j += BLOCK) x[j] = 0.0f;
        return;
    }
    float m;
    double s;
    row_stats(x, v, &m, &s);
    float xk = x[k];
    __syncthreads();  // every thread has read x[k] before anyone overwrites it
    if (threadIdx.x == 0) losses[row] = (float)((double)m + log(s) - (double)xk);
    float inv = (float)(1.0 / s);
    for (int j = threadIdx.x; j < v; j += BLOCK) {
        float onehot = j == k ? 1.0f : 0.0f;
        x[j] = scale * (expf(x[j] - m) * inv - onehot);
    }
}

// Pass 1 over one vocabulary tile: logits (N, VT) are the logits of ids v0..v0 + VT. stats
// (N, 3) per row (m, s, t): the running max, the running sum of exp(l - m), the target logit.
// With `first` overwritten from this tile (t = 0 unless the target is in it), else updated:
//   m' = max(m, max_j l_j)
//   s' = s * exp(m - m') + sum_j exp(l_j - m')    (exp in fp32, the sum in double, rounded once)
//   t' = l[k - v0] if v0 <= k < v0 + VT, else t
// Rows whose target is -100 are updated like any other (their t stays as it was).
extern "C" __global__ void cross_entropy_tile_stats(float* stats, const float* logits,
                                                    const int* targets, int n, int vt, int v0,
                                                    int first) {
    __shared__ float smax[BLOCK / 32];
    __shared__ double ssum[BLOCK / 32];
    long long row = blockIdx.x;
    const float* x = logits + row * vt;
    float* st = stats + row * 3;
    float m = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < vt; j += BLOCK) m = fmaxf(m, x[j]);
    m = block_max(m, smax);
    // Every thread reads the old max before the barriers inside block_sum_d; thread 0 writes
    // the new stats only after them.
    float m_old = first ? m : st[0];
    float m_new = fmaxf(m_old, m);
    double s = 0.0;
    for (int j = threadIdx.x; j < vt; j += BLOCK) s += (double)expf(x[j] - m_new);
    s = block_sum_d(s, ssum);
    if (threadIdx.x == 0) {
        // Equal maxima rescale by exactly 1 (so -inf maxima give no NaN), as the CPU does.
        if (!first) s += (double)st[1] * (m_old == m_new ? 1.0 : (double)expf(m_old - m_new));
        int k = targets[row];
        float t = first ? 0.0f : st[2];
        if (k != -100 && k >= v0 && k - v0 < vt) t = x[k - v0];
        st[0] = m_new;
        st[1] = (float)s;
        st[2] = t;
    }
}

// Pass 2, in place on one tile, from the complete stats (m, s, t) of each row:
//   dlogits[r, j] = scale * (exp(l_j - m) * (1 / s) - [j == k - v0])
// which is scale * (exp(l_j - lse) - onehot) with lse = m + ln s, formed as the fused kernel
// forms it (l_j - m is exact near the max, where l_j - lse would round); zero on ignored rows.
extern "C" __global__ void cross_entropy_tile_grad(float* logits, const float* stats,
                                                   const int* targets, int n, int vt, int v0,
                                                   float scale) {
    long long row = blockIdx.x;
    int k = targets[row];
    float* x = logits + row * vt;
    if (k == -100) {
        for (int j = threadIdx.x; j < vt; j += BLOCK) x[j] = 0.0f;
        return;
    }
    float m = stats[row * 3];
    float inv = (float)(1.0 / (double)stats[row * 3 + 1]);
    int kt = k - v0;  // the target's column in this tile, if it is in it
    for (int j = threadIdx.x; j < vt; j += BLOCK) {
        float onehot = j == kt ? 1.0f : 0.0f;
        x[j] = scale * (expf(x[j] - m) * inv - onehot);
    }
}

// losses[r] = m + ln s - t from the complete stats (N, 3), in double, rounded once; 0 on
// ignored rows. One thread per row; overwrites.
extern "C" __global__ void cross_entropy_tile_loss(float* losses, const float* stats,
                                                   const int* targets, int n) {
    long long row = (long long)blockIdx.x * BLOCK + threadIdx.x;
    if (row >= n) return;
    if (targets[row] == -100) {
        losses[row] = 0.0f;
        return;
    }
    const float* st = stats + row * 3;
    losses[row] = (float)((double)st[0] + log((double)st[1]) - (double)st[2]);
}
