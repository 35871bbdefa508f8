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

// Max and sum over each group of `lanes` consecutive lanes (32: the warp; 16: a half-warp), by
// xor butterflies: every lane of a group gets the same bits.
__device__ float lanes_max(float v, int lanes) {
    for (int o = lanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ float lanes_sum(float v, int lanes) {
    for (int o = lanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ float warp_max(float v) { return lanes_max(v, 32); }

__device__ float warp_sum(float v) { return lanes_sum(v, 32); }

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

// ---- The tiled forward: D <= 128, D % 4 == 0, 16-byte aligned rows -------------------------
// The same function as attention_forward, computed as an SGEMM computes a product: 64 query
// rows of one head per block, 256 threads as 16 x 16. Thread (ty, tx) holds the scores of rows
// ty*4..ty*4+3 against keys tx*4..tx*4+3 of each 64-key tile in registers (a 4 x 4 tile: two
// 16-byte shared loads feed 16 FMAs, where the warp-per-row kernel needs two loads per FMA), and
// the output of its 4 rows at columns tx*4 + 64u (u = 0, 1). Q and K are kept transposed in
// shared memory (element (i, k) at [k][i]) so that those loads are 16 bytes; P goes through
// shared memory, transposed, to the P V product. A row's softmax statistics are reduced over
// the 16 threads of its half-warp. The latest query blocks, which see the most keys, start
// first. Shared: (3 * 64 * D + 64 * 64) floats. Launcher: attention_forward in
// src/cuda/attention.rs, which falls back to the kernel above for other shapes.

#define FQ 64
#define FK 64

struct __align__(16) f4 {
    float x, y, z, w;
};

// Element e of v (e a compile-time constant once the loops around it unroll: no local memory).
__device__ __forceinline__ float f4_at(const f4& v, int e) {
    return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}

// Rows r0..r0+rows of sequence b (at column `col` of rows of `width`), D = 4*d4 wide, into
// `dst_t` transposed (element (r, k) at dst_t[k * rows + r]) and, unless `dst_r` is null, into
// `dst_r` row-major (dst_r[r * D + k]), from one read; rows past T are 0.
__device__ void load_both(float* dst_t, float* dst_r, const float* base, long long b_row0, int r0,
                          int rows, int t, int width, int col, int d4) {
    for (int idx = threadIdx.x; idx < rows * d4; idx += blockDim.x) {
        int r = idx % rows, k4 = idx / rows;
        f4 v = {0.0f, 0.0f, 0.0f, 0.0f};
        if (r0 + r < t) v = *(const f4*)(base + (b_row0 + r0 + r) * width + col + 4 * k4);
        dst_t[(4 * k4 + 0) * rows + r] = v.x;
        dst_t[(4 * k4 + 1) * rows + r] = v.y;
        dst_t[(4 * k4 + 2) * rows + r] = v.z;
        dst_t[(4 * k4 + 3) * rows + r] = v.w;
        if (dst_r) *(f4*)(dst_r + r * 4 * d4 + 4 * k4) = v;
    }
}

// The same rows, transposed only.
__device__ void load_transposed(float* dst, const float* base, long long b_row0, int r0, int rows,
                                int t, int width, int col, int d4) {
    load_both(dst, nullptr, base, b_row0, r0, rows, t, width, col, d4);
}

// The same rows, row-major (dst[r * D + k]); rows past T are 0.
__device__ void load_rows(float* dst, const float* base, long long b_row0, int r0, int rows, int t,
                          int width, int col, int d4) {
    for (int idx = threadIdx.x; idx < rows * d4; idx += blockDim.x) {
        int r = idx / d4, k4 = idx % d4;
        f4 v = {0.0f, 0.0f, 0.0f, 0.0f};
        if (r0 + r < t) v = *(const f4*)(base + (b_row0 + r0 + r) * width + col + 4 * k4);
        *(f4*)(dst + r * 4 * d4 + 4 * k4) = v;
    }
}

// acc[a][b] += sum_k x[k][ra + a] * y[k][rb + b] over k < d: the 4 x 4 register tile of a
// product of two transposed shared tiles (x of xr rows, y of yr rows).
__device__ __forceinline__ void tile_product(float acc[4][4], const float* x, int xr, int ra,
                                             const float* y, int yr, int rb, int d) {
    for (int k = 0; k < d; k++) {
        f4 a = *(const f4*)(x + k * xr + ra);
        f4 b = *(const f4*)(y + k * yr + rb);
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[r][c] += f4_at(a, r) * f4_at(b, c);
    }
}

// acc[a][4u + e] += sum_{m < mn} w[m][ra + a] * rows[m][cb + 64u + e]: a thread's 4 rows x 8
// columns of (W^T R) for W (mn x 64, shared) and R (mn x D, row-major shared).
__device__ __forceinline__ void rows_product(float acc[4][8], const float* w, int ra,
                                             const float* rows, int cb, int mn, int d) {
    for (int m = 0; m < mn; m++) {
        f4 p = *(const f4*)(w + m * 64 + ra);
#pragma unroll
        for (int u = 0; u < 2; u++) {
            int col = cb + 64 * u;
            if (col < d) {
                f4 v = *(const f4*)(rows + m * d + col);
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    float pr = f4_at(p, r);
                    acc[r][4 * u + 0] += pr * v.x;
                    acc[r][4 * u + 1] += pr * v.y;
                    acc[r][4 * u + 2] += pr * v.z;
                    acc[r][4 * u + 3] += pr * v.w;
                }
            }
        }
    }
}

// Writes a thread's 4 rows x 8 columns (columns cb + 64u + e) of row-major (.., stride) at
// rows r0 + ra + a, times `mul`, for rows below t.
__device__ __forceinline__ void store_rows(float* dst, long long b_row0, int r0, int ra, int t,
                                           int stride, int col0, int cb, int d,
                                           const float acc[4][8], float mul) {
#pragma unroll
    for (int r = 0; r < 4; r++) {
        int i = r0 + ra + r;
        if (i >= t) continue;
#pragma unroll
        for (int u = 0; u < 2; u++) {
            int col = cb + 64 * u;
            if (col < d) {
                f4 v = {acc[r][4 * u] * mul, acc[r][4 * u + 1] * mul, acc[r][4 * u + 2] * mul,
                        acc[r][4 * u + 3] * mul};
                *(f4*)(dst + (b_row0 + i) * stride + col0 + col) = v;
            }
        }
    }
}

// lse and delta of rows i0..i0+64 of one (sequence, head), whose rows start at `at0` of the
// (B, H, T) buffers, into shared memory (0 past T).
__device__ __forceinline__ void load_row_stats(float* lse_t, float* delta_t, const float* lse,
                                               const float* delta, long long at0, int i0, int t) {
    if (threadIdx.x < 64) {
        int i = i0 + threadIdx.x;
        lse_t[threadIdx.x] = i < t ? lse[at0 + i] : 0.0f;
        delta_t[threadIdx.x] = i < t ? delta[at0 + i] : 0.0f;
    }
}

// out (N, H*D), lse (B, H, T): overwrite. grid (ceil(T/FQ), H, B), block 256 threads.
extern "C" __global__ void attention_forward_tiled(float* out, float* lse, const float* qkv,
                                                   int t, int h, int kvh, int d, int window,
                                                   float scale) {
    extern __shared__ __align__(16) float smem[];
    float* qt = smem;         // [D][FQ]
    float* kt = qt + d * FQ;  // [D][FK]
    float* vs = kt + d * FK;  // [FK][D]
    float* pt = vs + FK * d;  // [FK][FQ]
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    int hi = blockIdx.y, bi = blockIdx.z;
    int width = (h + 2 * kvh) * d, d4 = d / 4;
    int g = hi / (h / kvh);
    long long row0 = (long long)bi * t;
    int i0 = (gridDim.x - 1 - blockIdx.x) * FQ;
    int ilast = min(i0 + FQ, t) - 1;
    const float NEG_INF = -__int_as_float(0x7f800000);
    load_transposed(qt, qkv, row0, i0, FQ, t, width, hi * d, d4);
    float o[4][8], m[4], l[4];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        m[r] = NEG_INF;
        l[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < 8; c++) o[r][c] = 0.0f;
    }
    for (int j0 = window_lo(i0, window) / FK * FK; j0 <= ilast; j0 += FK) {
        __syncthreads();  // the last tile's kt, vs and pt are no longer read
        load_transposed(kt, qkv, row0, j0, FK, t, width, (h + g) * d, d4);
        load_rows(vs, qkv, row0, j0, FK, t, width, (h + kvh + g) * d, d4);
        __syncthreads();
        float s[4][4];
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int c = 0; c < 4; c++) s[r][c] = 0.0f;
        tile_product(s, qt, FQ, ty * 4, kt, FK, tx * 4, d);
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int i = i0 + ty * 4 + r, lo = window_lo(i, window);
            float tmax = NEG_INF;
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int j = j0 + tx * 4 + c;
                bool seen = i < t && j >= lo && j <= i;
                s[r][c] = seen ? s[r][c] * scale : NEG_INF;
                tmax = fmaxf(tmax, s[r][c]);
            }
            float m_new = fmaxf(m[r], lanes_max(tmax, 16));
            // A row that sees no key of this tile (yet) keeps its state.
            float corr = m_new == NEG_INF ? 1.0f : expf(m[r] - m_new);
            float psum = 0.0f;
#pragma unroll
            for (int c = 0; c < 4; c++) {
                float p = s[r][c] == NEG_INF ? 0.0f : expf(s[r][c] - m_new);
                pt[(tx * 4 + c) * FQ + ty * 4 + r] = p;
                psum += p;
            }
            l[r] = l[r] * corr + lanes_sum(psum, 16);
            m[r] = m_new;
#pragma unroll
            for (int c = 0; c < 8; c++) o[r][c] *= corr;
        }
        __syncthreads();
        rows_product(o, pt, ty * 4, vs, tx * 4, min(FK, ilast - j0 + 1), d);
    }
#pragma unroll
    for (int r = 0; r < 4; r++) {
        int i = i0 + ty * 4 + r;
        if (i >= t) continue;  // (l is 0 there; store_rows skips the row too)
        float inv = 1.0f / l[r];
#pragma unroll
        for (int c = 0; c < 8; c++) o[r][c] *= inv;
        if (tx == 0) lse[((long long)bi * h + hi) * t + i] = m[r] + logf(l[r]);
    }
    store_rows(out, row0, i0, ty * 4, t, h * d, hi * d, tx * 4, d, o, 1.0f);
}

// ---- The tiled backward: the shapes of the tiled forward -----------------------------------
// dq, then dk and dv, as attention_backward_dq and _dkv compute them, with the tiled forward's
// 4 x 4 register tiles: dq per 64-query block over 64-key tiles (S and dP as products of
// transposed tiles, dS through shared memory to dQ += dS K); dk and dv per 64-key block over
// the 64-query tiles of every query head of its group (S^T and dP^T likewise, P^T and dS^T
// through shared memory to dV += P^T dO and dK += dS^T Q). delta (B, H, T) comes from
// attention_delta. No atomics: every output element is summed by one thread in a fixed order.

// dq part of dqkv: overwrites. grid (ceil(T/64), H, B), block 256, dynamic shared
// (5 * 64 * D + 64 * 64 + 128) floats.
extern "C" __global__ void attention_backward_dq_tiled(float* dqkv, const float* dout,
                                                       const float* qkv, const float* delta,
                                                       const float* lse, int t, int h, int kvh,
                                                       int d, int window, float scale) {
    extern __shared__ __align__(16) float smem[];
    float* qt = smem;          // [D][64] queries, transposed
    float* dot_ = qt + 64 * d;  // [D][64] dout, transposed
    float* kt = dot_ + 64 * d;  // [D][64] keys, transposed
    float* vt = kt + 64 * d;   // [D][64] values, transposed
    float* ks = vt + 64 * d;   // [64][D] keys, row-major
    float* dst = ks + 64 * d;  // [64 keys][64 queries] dS, transposed
    float* lse_t = dst + 64 * 64;
    float* delta_t = lse_t + 64;
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    int hi = blockIdx.y, bi = blockIdx.z;
    int width = (h + 2 * kvh) * d, d4 = d / 4;
    int g = hi / (h / kvh);
    long long row0 = (long long)bi * t;
    int i0 = (gridDim.x - 1 - blockIdx.x) * 64;
    int ilast = min(i0 + 64, t) - 1;
    load_transposed(qt, qkv, row0, i0, 64, t, width, hi * d, d4);
    load_transposed(dot_, dout, row0, i0, 64, t, h * d, hi * d, d4);
    load_row_stats(lse_t, delta_t, lse, delta, ((long long)bi * h + hi) * t, i0, t);
    float dq[4][8];
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
        for (int c = 0; c < 8; c++) dq[r][c] = 0.0f;
    for (int j0 = window_lo(i0, window) / 64 * 64; j0 <= ilast; j0 += 64) {
        __syncthreads();  // the last tile's kt, vt, ks and dst are no longer read
        load_both(kt, ks, qkv, row0, j0, 64, t, width, (h + g) * d, d4);
        load_transposed(vt, qkv, row0, j0, 64, t, width, (h + kvh + g) * d, d4);
        __syncthreads();
        float sc[4][4], dp[4][4];
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int c = 0; c < 4; c++) sc[r][c] = dp[r][c] = 0.0f;
        tile_product(sc, qt, 64, ty * 4, kt, 64, tx * 4, d);
        tile_product(dp, dot_, 64, ty * 4, vt, 64, tx * 4, d);
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int il = ty * 4 + r, i = i0 + il, lo = window_lo(i, window);
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int j = j0 + tx * 4 + c;
                float ds = 0.0f;
                if (i < t && j >= lo && j <= i) {
                    float p = expf(sc[r][c] * scale - lse_t[il]);
                    ds = p * (dp[r][c] - delta_t[il]);
                }
                dst[(tx * 4 + c) * 64 + il] = ds;
            }
        }
        __syncthreads();
        rows_product(dq, dst, ty * 4, ks, tx * 4, min(64, ilast - j0 + 1), d);
    }
    store_rows(dqkv, row0, i0, ty * 4, t, width, hi * d, tx * 4, d, dq, scale);
}

// dk and dv parts of dqkv: overwrite. grid (ceil(T/64), KVH, B), block 256, dynamic shared
// (6 * 64 * D + 64 * 64 + 128) floats.
extern "C" __global__ void attention_backward_dkv_tiled(float* dqkv, const float* dout,
                                                        const float* qkv, const float* delta,
                                                        const float* lse, int t, int h, int kvh,
                                                        int d, int window, float scale) {
    extern __shared__ __align__(16) float smem[];
    float* kt = smem;          // [D][64] keys, transposed
    float* vt = kt + 64 * d;   // [D][64] values, transposed
    float* qt = vt + 64 * d;   // [D][64] queries, transposed
    float* dot_ = qt + 64 * d;  // [D][64] dout, transposed
    float* qs = dot_ + 64 * d;  // [64][D] queries, row-major
    float* dos = qs + 64 * d;  // [64][D] dout, row-major
    float* pt = dos + 64 * d;  // [64 queries][64 keys]: P^T, then dS^T
    float* lse_t = pt + 64 * 64;
    float* delta_t = lse_t + 64;
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    int g = blockIdx.y, bi = blockIdx.z;
    int width = (h + 2 * kvh) * d, d4 = d / 4;
    int group = h / kvh;
    long long row0 = (long long)bi * t;
    int j0 = blockIdx.x * 64;
    int i_end = window_hi(min(j0 + 64, t) - 1, window, t);
    load_transposed(kt, qkv, row0, j0, 64, t, width, (h + g) * d, d4);
    load_transposed(vt, qkv, row0, j0, 64, t, width, (h + kvh + g) * d, d4);
    float dk[4][8], dv[4][8];
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
        for (int c = 0; c < 8; c++) dk[r][c] = dv[r][c] = 0.0f;
    for (int hq = g * group; hq < (g + 1) * group; hq++) {
        for (int i0 = j0; i0 < i_end; i0 += 64) {
            __syncthreads();  // the last tile's qt, dot_, qs, dos and pt are no longer read
            load_both(qt, qs, qkv, row0, i0, 64, t, width, hq * d, d4);
            load_both(dot_, dos, dout, row0, i0, 64, t, h * d, hq * d, d4);
            load_row_stats(lse_t, delta_t, lse, delta, ((long long)bi * h + hq) * t, i0, t);
            __syncthreads();
            float sc[4][4], dp[4][4];
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int c = 0; c < 4; c++) sc[r][c] = dp[r][c] = 0.0f;
            // Rows: keys ty*4 + r; columns: queries tx*4 + c.
            tile_product(sc, kt, 64, ty * 4, qt, 64, tx * 4, d);
            tile_product(dp, vt, 64, ty * 4, dot_, 64, tx * 4, d);
            float p[4][4];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                int j = j0 + ty * 4 + r;
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    int il = tx * 4 + c, i = i0 + il;
                    p[r][c] = 0.0f;
                    if (i < t && j < t && j >= window_lo(i, window) && j <= i)
                        p[r][c] = expf(sc[r][c] * scale - lse_t[il]);
                    pt[il * 64 + ty * 4 + r] = p[r][c];
                }
            }
            __syncthreads();
            int mn = min(64, i_end - i0);
            rows_product(dv, pt, ty * 4, dos, tx * 4, mn, d);
            __syncthreads();  // P^T is read: dS^T takes its place
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    int il = tx * 4 + c;
                    pt[il * 64 + ty * 4 + r] = p[r][c] * (dp[r][c] - delta_t[il]);
                }
            __syncthreads();
            rows_product(dk, pt, ty * 4, qs, tx * 4, mn, d);
        }
    }
    store_rows(dqkv, row0, j0, ty * 4, t, width, (h + g) * d, tx * 4, d, dk, scale);
    store_rows(dqkv, row0, j0, ty * 4, t, width, (h + kvh + g) * d, tx * 4, d, dv, 1.0f);
}

// delta (B, H, T) = rowwise dout . out per head, for the backward kernels: overwrites. One warp
// per (row, head), lanes over the head's dims, then a warp sum (the order attention_backward_dq
// used for its own delta). grid (ceil(N*H/ROWS)), block 32*ROWS.
extern "C" __global__ void attention_delta(float* delta, const float* dout, const float* out,
                                           int n, int t, int h, int d) {
    long long w = (long long)blockIdx.x * ROWS + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (w >= (long long)n * h) return;
    long long row = w / h;
    int hq = (int)(w % h);
    const float* dy = dout + row * h * d + hq * d;
    const float* y = out + row * h * d + hq * d;
    float part = 0.0f;
    for (int k = lane; k < d; k += 32) part += dy[k] * y[k];
    part = warp_sum(part);
    if (lane == 0) delta[((row / t) * h + hq) * t + row % t] = part;
}

// dq part of dqkv: overwrites. grid (ceil(T/ROWS), H, B), block 32*ROWS, dynamic shared
// (2*TILE*(D+1) + 2*ROWS*D) floats.
extern "C" __global__ void attention_backward_dq(float* dqkv, const float* dout, const float* qkv,
                                                 const float* delta_buf, const float* lse, int t,
                                                 int h, int kvh, int d, int window, float scale) {
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
        for (int k = lane; k < d; k += 32) {
            q[k] = qkv[(row0 + i) * width + hi * d + k];
            dy[k] = dout[(row0 + i) * h * d + hi * d + k];
        }
        delta = delta_buf[((long long)bi * h + hi) * t + i];
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
                                                  const float* qkv, const float* delta,
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
                    dl = delta[((long long)bi * h + hq) * t + i];
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
