// Mixture-of-experts routing, dispatch and combine. Shapes: N rows, E experts, k chosen per row,
// M = N*k (row, choice) pairs, pair p = r*k + j; logits, probs, dlogits (N, E); sel, wts, dwts
// (N, k); stats (2E); mask (N); order, pos (M); x, out (N, C); xs, src (M, C); buf, a, b (M, W);
// dy (S, C), bias (C) bf16 (the device's weight format, as its 16 bits).
// Expert and pair indices travel as f32 holding exact small integers (read by truncation, as
// the CPU's `as usize`). Launcher: src/cuda/moe.rs. Reference, data flow and the routing
// backward's derivation: src/cpu/moe.rs.
//
// Every reduction runs in one thread (or one warp, `moe_row_dots`, `moe_bias_dots`) in a fixed
// order, with no atomics: results are deterministic, and the same as the CPU's where the CPU
// sums in the same order (gather, scatter_add and scale_rows bit for bit; routing up to expf's
// last bits, which can flip a top-k choice only between probabilities within an ulp or two of
// each other).
// `__fmul_rn` keeps a product rounded on its own (no contraction into an FMA), as the CPU
// computes it.
//
// Simple first. What would make them faster:
// - route forward / backward: a warp per row (coalesced reads of the E logits, a shuffle max
//   and sum, a k-round warp argmax) instead of a thread walking its row, and its top-k choices
//   kept in registers instead of re-read from `sel`;
// - aux stats: a block per expert (or per expert and chunk of rows) with a fixed-shape tree
//   reduction, instead of E threads walking all N rows;
// - gather / scatter_add / scale_rows: float4 accesses where C and W allow (rows 16-byte
//   aligned).

// One thread per row r: probs[r] = softmax(logits[r]) (max subtracted, summed over e in order,
// scaled by 1/sum); sel[r] its k largest, largest first, equal probabilities to the lower expert
// (strict `>` over e ascending, skipping the experts already chosen); wts[r] their
// probabilities, divided by their sum (in order) when `norm`. All overwrite.
extern "C" __global__ void moe_route_forward(float* probs, float* sel, float* wts,
                                             const float* logits, int n, int e, int k, int norm) {
    long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n) return;
    const float* l = logits + r * e;
    float* p = probs + r * e;
    float* s = sel + r * k;
    float* w = wts + r * k;
    float mx = -__int_as_float(0x7f800000);  // -inf
    for (int x = 0; x < e; x++) mx = fmaxf(mx, l[x]);
    float sum = 0.0f;
    for (int x = 0; x < e; x++) {
        p[x] = expf(l[x] - mx);
        sum += p[x];
    }
    float inv = 1.0f / sum;
    for (int x = 0; x < e; x++) p[x] = __fmul_rn(p[x], inv);
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int x = 0; x < e; x++) {
            bool chosen = false;
            for (int i = 0; i < j; i++) chosen = chosen || (int)s[i] == x;
            if (chosen) continue;
            if (best < 0 || p[x] > p[best]) best = x;
        }
        s[j] = (float)best;
        w[j] = p[best];
    }
    if (norm) {
        float total = 0.0f;
        for (int j = 0; j < k; j++) total += w[j];
        for (int j = 0; j < k; j++) w[j] = w[j] / total;
    }
}

// One thread per row r; dlogits overwrites (its row holds dprobs first):
//   dprobs[e] = has_aux ? mask[r] * g[e] : 0;
//   S = sum_j p[sel_j]; with norm, w_j = p[sel_j] / S and dprobs[sel_j] += (dw_j - sum_i w_i dw_i) / S,
//   without, dprobs[sel_j] += dw_j;
//   dlogits[e] = p[e] * (dprobs[e] - sum_e' p[e'] dprobs[e']) (the softmax backward).
// Without aux, `g` and `mask` are stand-ins (any live address) and are not read.
extern "C" __global__ void moe_route_backward(float* dlogits, const float* dwts,
                                              const float* probs, const float* sel,
                                              const float* g, const float* mask, int n, int e,
                                              int k, int norm, int has_aux) {
    long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n) return;
    const float* p = probs + r * e;
    const float* s = sel + r * k;
    const float* dw = dwts + r * k;
    float* dl = dlogits + r * e;
    if (has_aux) {
        float m = mask[r];
        for (int x = 0; x < e; x++) dl[x] = __fmul_rn(m, g[x]);
    } else {
        for (int x = 0; x < e; x++) dl[x] = 0.0f;
    }
    float total = 0.0f;
    for (int j = 0; j < k; j++) total += p[(int)s[j]];
    float wdw = 0.0f;
    for (int j = 0; j < k; j++) wdw += __fmul_rn(p[(int)s[j]] / total, dw[j]);
    for (int j = 0; j < k; j++) {
        float d = norm ? (dw[j] - wdw) / total : dw[j];
        dl[(int)s[j]] += d;
    }
    float dot = 0.0f;
    for (int x = 0; x < e; x++) dot += __fmul_rn(p[x], dl[x]);
    for (int x = 0; x < e; x++) dl[x] = __fmul_rn(p[x], dl[x] - dot);
}

// One thread per expert x, rows in order; stats accumulates:
// stats[x] += sum_r mask[r] [x in sel[r]], stats[E + x] += sum_r mask[r] probs[r, x].
extern "C" __global__ void moe_aux_stats(float* stats, const float* probs, const float* sel,
                                         const float* mask, int n, int e, int k) {
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    if (x >= e) return;
    float cnt = 0.0f, sum = 0.0f;
    for (long long r = 0; r < n; r++) {
        bool hit = false;
        for (int j = 0; j < k; j++) hit = hit || (int)sel[r * k + j] == x;
        if (hit) cnt += mask[r];
        sum += __fmul_rn(mask[r], probs[r * e + x]);
    }
    stats[x] += cnt;
    stats[e + x] += sum;
}

// xs[i, c] = x[order[i] / k, c]; xs (M, C) overwrites. One thread per element of xs.
extern "C" __global__ void moe_gather(float* xs, const float* x, const float* order,
                                      long long m, long long k, long long c) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m * c) return;
    long long p = i / c, col = i % c;
    long long r = (long long)order[p] / k;
    xs[i] = x[r * c + col];
}

// out[order[i] / k, c] += w_i * src[i, c], w_i = wts[order[i]] (1 when !has_wts; `wts` is then
// a stand-in and is not read), for the S pairs of one expert: they name distinct rows (a row
// chooses an expert at most once), so no two threads add to one element. One thread per
// element of src (S, C).
extern "C" __global__ void moe_scatter_add(float* out, const float* src, const float* order,
                                           const float* wts, long long s, long long k,
                                           long long c, int has_wts) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= s * c) return;
    long long row = i / c, col = i % c;
    long long p = (long long)order[row];
    float w = has_wts ? wts[p] : 1.0f;
    long long at = (p / k) * c + col;
    out[at] = out[at] + __fmul_rn(w, src[i]);
}

// buf[i, c] *= wts[order[i]], in place. buf (M, W). One thread per element.
extern "C" __global__ void moe_scale_rows(float* buf, const float* wts, const float* order,
                                          long long m, long long w) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m * w) return;
    buf[i] = __fmul_rn(buf[i], wts[(long long)order[i / w]]);
}

// out[order[i]] = a[i] . b[i] for the S pairs of one expert; out (M) in pair order, the entries
// `order` names overwritten. One warp per pair (the block's warps take consecutive pairs, whole
// warps leave together): lane l sums elements l, l + 32, ... in order, then a fixed xor tree
// over the 32 lanes (every lane ends with the same sum; lane 0 writes).
extern "C" __global__ void moe_row_dots(float* out, const float* a, const float* b,
                                        const float* order, long long s, long long w) {
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (i >= s) return;
    long long at = i * w;
    float sum = 0.0f;
    for (long long x = lane; x < w; x += 32) sum += __fmul_rn(a[at + x], b[at + x]);
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) out[(long long)order[i]] = sum;
}

// The f32 of bf16 bits `h` (exact).
__device__ float bf16_to_f32(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }

// out[order[i]] += dy[i] . bias for the S pairs of one expert (the down-projection bias's share
// of the routing weights' gradient); out (M) in pair order, the entries `order` names
// accumulate. One warp per pair, as moe_row_dots: lane l sums elements l, l + 32, ... in order,
// then a fixed xor tree over the 32 lanes; lane 0 adds.
extern "C" __global__ void moe_bias_dots(float* out, const float* dy, const unsigned short* bias,
                                         const float* order, long long s, long long c) {
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (i >= s) return;
    long long at = i * c;
    float sum = 0.0f;
    for (long long x = lane; x < c; x += 32) sum += __fmul_rn(dy[at + x], bf16_to_f32(bias[x]));
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) out[(long long)order[i]] += sum;
}
