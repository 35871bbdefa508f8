// Cross-entropy over the vocabulary, one block per row: the forward (evaluation) and the fused
// forward + backward that turns one LM-head chunk of logits (N, V) into dlogits in place.
// targets (N), -100 = ignored; losses (N). Launcher: src/cuda/cross_entropy.rs. Reference and
// derivation: src/cpu/cross_entropy.rs (the row max is subtracted, the sum of exponentials is
// accumulated in double, the loss m + log(s) - x[k] formed in double and rounded once).

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
