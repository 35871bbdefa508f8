// Learned attention sinks (gpt-oss) as a step after attention: head h's logit sinks[h] is one
// more column of every score row (probability mass, no value). Shapes: out, dout (N, H*D), N =
// B*T rows; lse (B, H, T); sinks (H) bf16 weights, dsinks (H). Launcher: src/cuda/attention_sink.rs. Reference
// and derivation: src/cpu/attention_sink.rs (the attention backward kernels, given the adjusted
// out and lse, need nothing more: their P = exp(s - lse') and delta = dout . out' are the sink
// softmax's).
//
// No atomics: the backward sums each head's rows in one block, in a fixed order.
//
// Simple first. What would make them faster: a warp per (row, head) for the forward's rescale
// and the backward's dot (coalesced reads of the D columns) instead of a thread walking them;
// several blocks per head with a second fixed-order pass over their partial sums.

#define SINK_THREADS 256

// A bf16 weight (the sinks live in the layer's weight slot) as float.
__device__ float sink_at(const unsigned short* sinks, int h) {
    return __uint_as_float((unsigned int)sinks[h] << 16);
}

// log(exp(a) + exp(b)) without overflow, as the CPU's logaddexp.
__device__ float logaddexp(float a, float b) { return fmaxf(a, b) + log1pf(expf(-fabsf(a - b))); }

// out (N, H*D), lse (B, H, T): in place, lse overwritten with lse' = logaddexp(lse, sinks[h])
// and out's head h columns scaled by exp(lse - lse'). One thread per (row, head); grid
// (ceil(N*H/256)), block 256.
extern "C" __global__ void attention_sink_forward(float* out, float* lse, const unsigned short* sinks,
                                                  int n, int t, int h, int d) {
    long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (w >= (long long)n * h) return;
    long long row = w / h;
    int hi = (int)(w % h);
    long long at = ((row / t) * h + hi) * t + row % t;
    float l = lse[at];
    float l2 = logaddexp(l, sink_at(sinks, hi));
    float f = expf(l - l2);
    float* o = out + row * h * d + hi * d;
    for (int k = 0; k < d; k++) o[k] *= f;
    lse[at] = l2;
}

// dsinks[h] += -sum_i exp(sinks[h] - lse'_i) (dout_i . out_i) over the N rows i: accumulates.
// One block of 256 threads per head (grid (H)): thread x sums rows x, x + 256, ... in order
// (each row's dot over k in order), then a fixed tree over the block's 256 partial sums.
extern "C" __global__ void attention_sink_backward(float* dsinks, const float* dout,
                                                   const float* out, const float* lse,
                                                   const unsigned short* sinks, int n, int t, int h,
                                                   int d) {
    __shared__ float part[SINK_THREADS];
    int hi = blockIdx.x;
    float s = sink_at(sinks, hi), acc = 0.0f;
    for (long long row = threadIdx.x; row < n; row += SINK_THREADS) {
        const float* dy = dout + row * h * d + hi * d;
        const float* y = out + row * h * d + hi * d;
        float dd = 0.0f;
        for (int k = 0; k < d; k++) dd += dy[k] * y[k];
        acc += expf(s - lse[((row / t) * h + hi) * t + row % t]) * dd;
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int half = SINK_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) dsinks[hi] -= part[0];
}
