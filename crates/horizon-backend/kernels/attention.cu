// Causal grouped-query attention, forward and backward, flash style: key/value (or query) tiles
// of 32 rows pass through shared memory and the (T x T) scores never exist in global memory.
// Shapes: qkv, dqkv (N, QKV), row = [q (H*D) | k (KVH*D) | v (KVH*D)]; out, dout (N, H*D);
// lse (B, H, T). Query head h reads kv head h / (H/KVH); scores are scale q.k (scale is an
// argument: 1/sqrt(D), or Gemma's query_pre_attn_scalar^-1/2); D <= 256.
// Sliding window W (`window`, 0 = full causal; the launcher passes 0 for W >= T): query i sees
// keys j with lo(i) = max(0, i - W + 1) <= j <= i, so key j is seen by queries j <= i < j + W.
// The loops visit only the tiles that hold such pairs (keys before a block's first lo are never
// loaded), and mask the rest of a visited tile.
// Launcher: src/cuda/attention.rs. Reference and derivation: src/cpu/attention.rs; over the
// visible pairs (i, j) only:
//   P_ij = exp(scale q_i.k_j - lse_i), delta_i = dout_i.out_i, dS_ij = P_ij (dout_i.v_j - delta_i)
//   dq_i = scale sum_j dS_ij k_j,  dk_j = scale sum_i dS_ij q_i,  dv_j = sum_i P_ij dout_i.
//
// Work split: one warp per row (a query row in the forward and dq kernels, a key row in the
// dk/dv kernel), ROWS warps per block sharing the tiles. Lane l scores tile row l; lane l owns
// the output dims l, l + 32, ... (at most 8). No atomics: dk and dv of a kv head sum over the
// query heads of its group inside one warp, so every result has one fixed summation order.

#define ROWS 8
#define TILE 32
#define MAXU 8

// First key query i sees.
__device__ int window_lo(int i, int window) { return window > 0 ? max(0, i - window + 1) : 0; }

// One past the last query that sees key j.
__device__ int window_hi(int j, int window, int t) {
    return window > 0 ? min(t, j + window) : t;
}

__device__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Copy TILE rows of D floats (rows start..start+TILE of sequence b, at column `col` of qkv-like
// rows of `width`) into a padded shared tile; rows past T read as 0.
__device__ void load_tile(float* tile, const float* base, long long b_row0, int start, int t,
                          int width, int col, int d) {
    int stride = d + 1;
    for (int idx = threadIdx.x; idx < TILE * d; idx += blockDim.x) {
        int r = idx / d, k = idx % d;
        int pos = start + r;
        tile[r * stride + k] = pos < t ? base[(b_row0 + pos) * width + col + k] : 0.0f;
    }
}

// out (N, H*D), lse (B, H, T): overwrite. grid (ceil(T/ROWS), H, B), block 32*ROWS threads,
// dynamic shared memory (2*TILE*(D+1) + ROWS*D) floats.
extern "C" __global__ void attention_forward(float* out, float* lse, const float* qkv, int t,
                                             int h, int kvh, int d, int window, float scale) {
    extern __shared__ float smem[];
    float* ks = smem;
    float* vs = ks + TILE * (d + 1);
    float* qs = vs + TILE * (d + 1);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int hi = blockIdx.y, bi = blockIdx.z;
    int width = (h + 2 * kvh) * d;
    int g = hi / (h / kvh);
    long long row0 = (long long)bi * t;
    int i0 = blockIdx.x * ROWS;
    int i = i0 + warp;
    int imax = min(i0 + ROWS, t) - 1;
    int lo = window_lo(i, window);
    float* q = qs + warp * d;
    if (i < t) {
        for (int k = lane; k < d; k += 32) q[k] = qkv[(row0 + i) * width + hi * d + k];
    }
    float m = -__int_as_float(0x7f800000), l = 0.0f, o[MAXU];
    for (int u = 0; u < MAXU; u++) o[u] = 0.0f;
    // From the tile holding the block's first visible key (that of its first row, i0).
    for (int j0 = window_lo(i0, window) / TILE * TILE; j0 <= imax; j0 += TILE) {
        __syncthreads();
        load_tile(ks, qkv, row0, j0, t, width, (h + g) * d, d);
        load_tile(vs, qkv, row0, j0, t, width, (h + kvh + g) * d, d);
        __syncthreads();
        if (i >= t || j0 > i || j0 + TILE <= lo) continue;
        int j = j0 + lane;
        bool seen = j >= lo && j <= i;
        float s = -__int_as_float(0x7f800000);
        if (seen) {
            const float* kr = ks + lane * (d + 1);
            float acc = 0.0f;
            for (int k = 0; k < d; k++) acc += q[k] * kr[k];
            s = acc * scale;
        }
        float m_new = fmaxf(m, warp_max(s));
        float corr = expf(m - m_new);
        float p = seen ? expf(s - m_new) : 0.0f;
        l = l * corr + warp_sum(p);
        for (int u = 0; u < MAXU; u++) o[u] *= corr;
        int first = max(0, lo - j0), last = min(TILE, i - j0 + 1);
        for (int jj = first; jj < last; jj++) {
            float pj = __shfl_sync(0xffffffffu, p, jj);
            const float* vr = vs + jj * (d + 1);
            for (int u = 0; u < MAXU; u++) {
                int k = lane + 32 * u;
                if (k < d) o[u] += pj * vr[k];
            }
        }
        m = m_new;
    }
    if (i < t) {
        float inv = 1.0f / l;
        for (int u = 0; u < MAXU; u++) {
            int k = lane + 32 * u;
            if (k < d) out[(row0 + i) * h * d + hi * d + k] = o[u] * inv;
        }
        if (lane == 0) lse[((long long)bi * h + hi) * t + i] = m + logf(l);
    }
}

// dq part of dqkv: overwrites. grid (ceil(T/ROWS), H, B), block 32*ROWS, dynamic shared
// (2*TILE*(D+1) + 2*ROWS*D) floats.
extern "C" __global__ void attention_backward_dq(float* dqkv, const float* dout, const float* qkv,
                                                 const float* out, const float* lse, int t, int h,
                                                 int kvh, int d, int window, float scale) {
    extern __shared__ float smem[];
    float* ks = smem;
    float* vs = ks + TILE * (d + 1);
    float* qs = vs + TILE * (d + 1);
    float* dos = qs + ROWS * d;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int hi = blockIdx.y, bi = blockIdx.z;
    int width = (h + 2 * kvh) * d;
    int g = hi / (h / kvh);
    long long row0 = (long long)bi * t;
    int i0 = blockIdx.x * ROWS;
    int i = i0 + warp;
    int imax = min(i0 + ROWS, t) - 1;
    int lo = window_lo(i, window);
    float* q = qs + warp * d;
    float* dy = dos + warp * d;
    float delta = 0.0f, lse_i = 0.0f;
    if (i < t) {
        float part = 0.0f;
        for (int k = lane; k < d; k += 32) {
            q[k] = qkv[(row0 + i) * width + hi * d + k];
            float dyk = dout[(row0 + i) * h * d + hi * d + k];
            dy[k] = dyk;
            part += dyk * out[(row0 + i) * h * d + hi * d + k];
        }
        delta = warp_sum(part);
        lse_i = lse[((long long)bi * h + hi) * t + i];
    }
    float dq[MAXU];
    for (int u = 0; u < MAXU; u++) dq[u] = 0.0f;
    for (int j0 = window_lo(i0, window) / TILE * TILE; j0 <= imax; j0 += TILE) {
        __syncthreads();
        load_tile(ks, qkv, row0, j0, t, width, (h + g) * d, d);
        load_tile(vs, qkv, row0, j0, t, width, (h + kvh + g) * d, d);
        __syncthreads();
        if (i >= t || j0 > i || j0 + TILE <= lo) continue;
        int j = j0 + lane;
        float ds = 0.0f;
        if (j >= lo && j <= i) {
            const float* kr = ks + lane * (d + 1);
            const float* vr = vs + lane * (d + 1);
            float s = 0.0f, dp = 0.0f;
            for (int k = 0; k < d; k++) {
                s += q[k] * kr[k];
                dp += dy[k] * vr[k];
            }
            float p = expf(s * scale - lse_i);
            ds = p * (dp - delta);
        }
        int first = max(0, lo - j0), last = min(TILE, i - j0 + 1);
        for (int jj = first; jj < last; jj++) {
            float c = scale * __shfl_sync(0xffffffffu, ds, jj);
            const float* kr = ks + jj * (d + 1);
            for (int u = 0; u < MAXU; u++) {
                int k = lane + 32 * u;
                if (k < d) dq[u] += c * kr[k];
            }
        }
    }
    if (i < t) {
        for (int u = 0; u < MAXU; u++) {
            int k = lane + 32 * u;
            if (k < d) dqkv[(row0 + i) * width + hi * d + k] = dq[u];
        }
    }
}

// dk and dv parts of dqkv: overwrite. grid (ceil(T/ROWS), KVH, B), block 32*ROWS, dynamic
// shared (2*TILE*(D+1) + 2*ROWS*D + 2*TILE) floats. Warp w owns key row j = blockIdx.x*ROWS + w
// and walks the query tiles from the block's first key to one past the last query that sees the
// block's last key (T without a window), for every query head of the group.
extern "C" __global__ void attention_backward_dkv(float* dqkv, const float* dout,
                                                  const float* qkv, const float* out,
                                                  const float* lse, int t, int h, int kvh,
                                                  int d, int window, float scale) {
    extern __shared__ float smem[];
    float* qt = smem;
    float* dot_ = qt + TILE * (d + 1);
    float* kw = dot_ + TILE * (d + 1);
    float* vw = kw + ROWS * d;
    float* lse_t = vw + ROWS * d;
    float* delta_t = lse_t + TILE;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int g = blockIdx.y, bi = blockIdx.z;
    int width = (h + 2 * kvh) * d;
    int group = h / kvh;
    long long row0 = (long long)bi * t;
    int j_lo = blockIdx.x * ROWS;
    int j = j_lo + warp;
    int i_end = window_hi(min(j_lo + ROWS, t) - 1, window, t);
    int hi_j = window_hi(j, window, t);
    float* kj = kw + warp * d;
    float* vj = vw + warp * d;
    if (j < t) {
        for (int k = lane; k < d; k += 32) {
            kj[k] = qkv[(row0 + j) * width + (h + g) * d + k];
            vj[k] = qkv[(row0 + j) * width + (h + kvh + g) * d + k];
        }
    }
    float dk[MAXU], dv[MAXU];
    for (int u = 0; u < MAXU; u++) {
        dk[u] = 0.0f;
        dv[u] = 0.0f;
    }
    for (int hq = g * group; hq < (g + 1) * group; hq++) {
        for (int i0 = j_lo; i0 < i_end; i0 += TILE) {
            __syncthreads();
            load_tile(qt, qkv, row0, i0, t, width, hq * d, d);
            load_tile(dot_, dout, row0, i0, t, h * d, hq * d, d);
            __syncthreads();
            if (threadIdx.x < TILE) {
                int i = i0 + threadIdx.x;
                float dl = 0.0f, ls = 0.0f;
                if (i < t) {
                    const float* dr = dot_ + threadIdx.x * (d + 1);
                    for (int k = 0; k < d; k++) dl += dr[k] * out[(row0 + i) * h * d + hq * d + k];
                    ls = lse[((long long)bi * h + hq) * t + i];
                }
                delta_t[threadIdx.x] = dl;
                lse_t[threadIdx.x] = ls;
            }
            __syncthreads();
            if (j >= t || i0 >= hi_j) continue;
            int i = i0 + lane;
            float p = 0.0f, ds = 0.0f;
            if (i < hi_j && i >= j) {
                const float* qr = qt + lane * (d + 1);
                const float* dr = dot_ + lane * (d + 1);
                float s = 0.0f, dp = 0.0f;
                for (int k = 0; k < d; k++) {
                    s += qr[k] * kj[k];
                    dp += dr[k] * vj[k];
                }
                p = expf(s * scale - lse_t[lane]);
                ds = p * (dp - delta_t[lane]);
            }
            int first = max(0, j - i0), last = min(TILE, hi_j - i0);
            for (int ii = first; ii < last; ii++) {
                float pi = __shfl_sync(0xffffffffu, p, ii);
                float ci = scale * __shfl_sync(0xffffffffu, ds, ii);
                const float* qr = qt + ii * (d + 1);
                const float* dr = dot_ + ii * (d + 1);
                for (int u = 0; u < MAXU; u++) {
                    int k = lane + 32 * u;
                    if (k < d) {
                        dv[u] += pi * dr[k];
                        dk[u] += ci * qr[k];
                    }
                }
            }
        }
    }
    if (j < t) {
        for (int u = 0; u < MAXU; u++) {
            int k = lane + 32 * u;
            if (k < d) {
                dqkv[(row0 + j) * width + (h + g) * d + k] = dk[u];
                dqkv[(row0 + j) * width + (h + kvh + g) * d + k] = dv[u];
            }
        }
    }
}
