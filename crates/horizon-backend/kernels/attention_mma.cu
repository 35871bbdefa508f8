// Causal grouped-query attention on tensor cores, FlashAttention-2 style: the function of
// attention.cu (same shapes, window, scale and lse; the derivation is there and in
// src/cpu/attention.rs) with the precision of attention_tc.cu (Q, K, V and dout rounded to bf16
// as they enter shared memory, P and dS as they leave the softmax; scores, statistics and every
// accumulator fp32).
//
// What differs from attention_tc.cu: the products are PTX mma.sync m16n8k16, whose fragment
// layouts the PTX ISA documents, so scores, probabilities and every accumulator stay in
// registers. A product's fp32 result fragment (16 x 8) is, two of them side by side and
// rounded to bf16, the A fragment (16 x 16) of the next product, so P and dS never touch shared
// memory, and the softmax runs on the score fragments (a row's four lanes meet by shuffles).
// Shared memory holds only bf16 tiles of Q, K, V and dout, read by ldmatrix (transposed where a
// product needs a tile's columns). With g = lane / 4 and q = lane % 4, a lane holds rows g and
// g + 8 of its warp's 16, columns 2q and 2q + 1 of each 8-column tile. Under the CUDA test
// double (__FAKECUDA__) mma.sync and ldmatrix are its emulation of those same layouts
// (crates/fakecuda/src/shim/fakecuda_kernel.h).
//
// Work split: 64 rows a block (query rows in the forward and dq kernels, key rows in dk/dv), 4
// warps of 16 rows each; tiles of 64 keys (forward, dq) or MMA_QT queries (dk/dv). Warps meet
// only to load a tile. No atomics: every output element has one fixed summation order.
//
// Requires D a multiple of 16 up to 128, sm_80 or later, and 16-byte aligned qkv, out, dout and
// dqkv (float4 loads). Launcher: src/cuda/attention.rs (shared memory: Set::launch there).

#define MMA_ROWS 64
#define MMA_THREADS 128
#define MMA_MAXD 128
// Queries a tile of the dk/dv kernel: its warps hold dk and dv (64 registers each at D = 128)
// beside a 16 x MMA_QT score tile and its dP tile, so the tile is narrower than the forward's.
#define MMA_QT 32
#define MMA_LOG2E 1.4426950408889634f
#define MMA_LN2 0.6931471805599453f

typedef unsigned short bf16;

// First key query i sees; one past the last query that sees key j (as in attention.cu).
__device__ int mma_window_lo(int i, int window) { return window > 0 ? max(0, i - window + 1) : 0; }

__device__ int mma_window_hi(int j, int window, int t) {
    return window > 0 ? min(t, j + window) : t;
}

// Round to nearest even; NaN stays NaN (quiet): convert.cu's rounding.
__device__ __forceinline__ unsigned mma_bf16(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}

// Two fp32 values as the two bf16 of one register, the first in the lower half.
__device__ __forceinline__ unsigned mma_pack(float lo, float hi) {
    return mma_bf16(lo) | (mma_bf16(hi) << 16);
}

// ---- mma.sync and ldmatrix ----------------------------------------------------------------
#if defined(__FAKECUDA__)
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1) {
    const unsigned b[2] = {b0, b1};
    ::fakecuda::mma_m16n8k16_bf16(c, a, b, __LINE__);
}
__device__ __forceinline__ void mma_ldsm(unsigned (&r)[4], const bf16* p) {
    ::fakecuda::ldmatrix_x4(r, p, false, __LINE__);
}
__device__ __forceinline__ void mma_ldsm_t(unsigned (&r)[4], const bf16* p) {
    ::fakecuda::ldmatrix_x4(r, p, true, __LINE__);
}
#elif __CUDA_ARCH__ >= 800
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#define MMA_LDSM(name, trans)                                                                  \
    __device__ __forceinline__ void name(unsigned (&r)[4], const bf16* p) {                    \
        asm volatile(                                                                          \
            "{\n .reg .u64 a64;\n .reg .u32 a32;\n cvta.to.shared.u64 a64, %4;\n"              \
            " cvt.u32.u64 a32, a64;\n"                                                         \
            " ldmatrix.sync.aligned.m8n8.x4" trans ".shared.b16 {%0, %1, %2, %3}, [a32];\n}"   \
            : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                                   \
            : "l"(p)                                                                           \
            : "memory");                                                                       \
    }
MMA_LDSM(mma_ldsm, "")
MMA_LDSM(mma_ldsm_t, ".trans")
#undef MMA_LDSM
#else
// Before sm_80 there are no bf16 tensor cores: the launcher never runs these kernels there.
__device__ void mma_16816(float (&)[4], const unsigned (&)[4], unsigned, unsigned) { __trap(); }
__device__ void mma_ldsm(unsigned (&)[4], const bf16*) { __trap(); }
__device__ void mma_ldsm_t(unsigned (&)[4], const bf16*) { __trap(); }
#endif

// ldmatrix.x4 of the 16 x 16 block at p of a row-major bf16 tile (leading dimension ld): lane
// 8j + i gives row i of 8 x 8 matrix j, which is rows (j % 2) * 8.., columns (j / 2) * 8.. of
// the block: as an A fragment (rows x k) it is mma's a[0..3] in order; transposed, it is the B
// fragments (k = rows, n = columns) of the block's two 8-column halves, {r0, r1} and {r2, r3}.
__device__ __forceinline__ const bf16* mma_lane_row(const bf16* p, int ld) {
    int lane = threadIdx.x % 32, j = lane / 8;
    return p + ((j % 2) * 8 + lane % 8) * ld + (j / 2) * 8;
}

__device__ __forceinline__ void mma_frag_a(unsigned (&a)[4], const bf16* p, int ld) {
    mma_ldsm(a, mma_lane_row(p, ld));
}

// B fragments of two 8-column tiles of B = M^T, for the 16 x 16 block at p of a row-major M
// whose rows are B's columns (n) and columns B's k: {r0, r1} for M's rows 0..7, {r2, r3} for
// rows 8..15. Matrix j here is M's rows (j / 2) * 8.., columns (j % 2) * 8...
__device__ __forceinline__ void mma_frag_bt(unsigned (&r)[4], const bf16* p, int ld) {
    int lane = threadIdx.x % 32, j = lane / 8;
    mma_ldsm(r, p + ((j / 2) * 8 + lane % 8) * ld + (j % 2) * 8);
}

// B fragments of two 8-column tiles of B = M (k = M's rows), M row-major at p.
__device__ __forceinline__ void mma_frag_b(unsigned (&r)[4], const bf16* p, int ld) {
    mma_ldsm_t(r, mma_lane_row(p, ld));
}

// The A fragment of 16 columns (k) of a 16 x 8n fp32 result held as fragments: its 8-column
// tiles 2k and 2k + 1, rounded to bf16.
__device__ __forceinline__ void mma_c_to_a(unsigned (&a)[4], const float (&c0)[4],
                                           const float (&c1)[4]) {
    a[0] = mma_pack(c0[0], c0[1]);
    a[1] = mma_pack(c0[2], c0[3]);
    a[2] = mma_pack(c1[0], c1[1]);
    a[3] = mma_pack(c1[2], c1[3]);
}

// acc (a warp's 16 x N scores, N / 8 tiles) += a (16 x D, rows of a row-major tile at `a`)
// times the transpose of b (N x D, rows of a row-major tile at `b`); both leading dimension ld.
template <int N>
__device__ __forceinline__ void mma_scores(float (&acc)[N / 8][4], const bf16* a, const bf16* b,
                                           int d, int ld) {
#pragma unroll
    for (int kc = 0; kc < MMA_MAXD / 16; kc++) {
        if (kc * 16 >= d) break;
        unsigned fa[4];
        mma_frag_a(fa, a + kc * 16, ld);
#pragma unroll
        for (int np = 0; np < N / 16; np++) {
            unsigned fb[4];
            mma_frag_bt(fb, b + np * 16 * ld + kc * 16, ld);
            mma_16816(acc[2 * np], fa, fb[0], fb[1]);
            mma_16816(acc[2 * np + 1], fa, fb[2], fb[3]);
        }
    }
}

// acc (16 x D, D / 8 tiles) += w (16 x N held as fragments) times rows (N x D, a row-major
// tile at `rows`, leading dimension ld).
template <int N>
__device__ __forceinline__ void mma_accumulate(float (&acc)[MMA_MAXD / 8][4],
                                               const float (&w)[N / 8][4], const bf16* rows,
                                               int d, int ld) {
#pragma unroll
    for (int kc = 0; kc < N / 16; kc++) {
        unsigned fa[4];
        mma_c_to_a(fa, w[2 * kc], w[2 * kc + 1]);
#pragma unroll
        for (int dp = 0; dp < MMA_MAXD / 16; dp++) {
            if (dp * 16 >= d) break;
            unsigned fb[4];
            mma_frag_b(fb, rows + kc * 16 * ld + dp * 16, ld);
            mma_16816(acc[2 * dp], fa, fb[0], fb[1]);
            mma_16816(acc[2 * dp + 1], fa, fb[2], fb[3]);
        }
    }
}

template <int N>
__device__ __forceinline__ void mma_zero(float (&acc)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[n][e] = 0.0f;
}

// ---- Tiles in shared memory and results out of registers ------------------------------------
// `rows` rows from r0 of sequence b (row0: its first row), D wide at column `col` of rows of
// `width` floats, rounded to bf16 into dst (row-major, leading dimension D + 8); rows past T 0.
__device__ void mma_load_rows(bf16* dst, const float* src, long long row0, int r0, int rows,
                              int t, int width, int col, int d) {
    int d4 = d / 4, ld = d + 8;
    for (int idx = threadIdx.x; idx < rows * d4; idx += MMA_THREADS) {
        int r = idx / d4, k = (idx % d4) * 4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r0 + r < t) v = *(const float4*)(src + (row0 + r0 + r) * width + col + k);
        *(uint2*)(dst + r * ld + k) = make_uint2(mma_pack(v.x, v.y), mma_pack(v.z, v.w));
    }
}

// The key and value tile of kv head g from key j0 into ks and vs, between two barriers: the
// last tile's are no longer read before, the new ones are complete after.
__device__ __forceinline__ void mma_next_keys(bf16* ks, bf16* vs, const float* qkv,
                                              long long row0, int j0, int t, int h, int kvh,
                                              int g, int d) {
    int width = (h + 2 * kvh) * d;
    __syncthreads();
    mma_load_rows(ks, qkv, row0, j0, MMA_ROWS, t, width, (h + g) * d, d);
    mma_load_rows(vs, qkv, row0, j0, MMA_ROWS, t, width, (h + kvh + g) * d, d);
    __syncthreads();
}

// A warp's 16 x D result held as fragments, times `mul`, into rows r0 (this warp's first) of
// row-major dst (rows of `width` floats from row0, at column `col`); rows at or past T skipped.
__device__ __forceinline__ void mma_store(float* dst, const float (&acc)[MMA_MAXD / 8][4],
                                          long long row0, int r0, int t, int width, int col,
                                          int d, float mul0, float mul1) {
    int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int r = r0 + g + 8 * half;
        if (r >= t) continue;
        float mul = half ? mul1 : mul0;
        float* row = dst + (row0 + r) * width + col + 2 * q;
#pragma unroll
        for (int dt = 0; dt < MMA_MAXD / 8; dt++) {
            if (dt * 8 >= d) break;
            *(float2*)(row + dt * 8) =
                make_float2(acc[dt][2 * half] * mul, acc[dt][2 * half + 1] * mul);
        }
    }
}

// The sum and the maximum of a value over a row's four lanes (lanes 4g..4g+3).
__device__ __forceinline__ float mma_row_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ float mma_row_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// ---- Forward --------------------------------------------------------------------------------
// One tile of the online softmax for row half `half` of this lane (row i): s, scores of the
// tile's 64 keys from j0 (times scale * log2 e, in place), become unnormalised probabilities
// against the new running maximum m (log2 units); l (this lane's part of the row sum) and the
// row's output are rescaled to it.
__device__ __forceinline__ void mma_softmax_tile(float (&s)[8][4], float (&o)[MMA_MAXD / 8][4],
                                                 float& m, float& l, int half, int i, int j0,
                                                 int t, int window, float sl2) {
    const float NEG_INF = -__int_as_float(0x7f800000);
    int q = threadIdx.x % 4, lo = mma_window_lo(i, window);
    float tmax = NEG_INF;
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            int j = j0 + nt * 8 + 2 * q + e;
            float v = i < t && j >= lo && j <= i ? s[nt][2 * half + e] * sl2 : NEG_INF;
            s[nt][2 * half + e] = v;
            tmax = fmaxf(tmax, v);
        }
    float m_new = fmaxf(m, mma_row_max(tmax));
    // A row that sees no key of this tile (yet) keeps its state.
    float corr = m_new == NEG_INF ? 1.0f : exp2f(m - m_new), psum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            float v = s[nt][2 * half + e];
            float p = v == NEG_INF ? 0.0f : exp2f(v - m_new);
            s[nt][2 * half + e] = p;
            psum += p;
        }
    l = l * corr + psum;
    m = m_new;
#pragma unroll
    for (int dt = 0; dt < MMA_MAXD / 8; dt++) {
        o[dt][2 * half] *= corr;
        o[dt][2 * half + 1] *= corr;
    }
}

// out (N, H*D), lse (B, H, T): overwrite. grid (ceil(T/64), H, B), block 128; the latest query
// blocks, which see the most keys, start first.
extern "C" __global__ void __launch_bounds__(MMA_THREADS)
    attention_forward_mma(float* out, float* lse, const float* qkv, int t, int h, int kvh, int d,
                          int window, float scale) {
    extern __shared__ __align__(128) unsigned char mma_smem[];
    int ld = d + 8;
    bf16* ks = (bf16*)mma_smem;      // [64][ld] keys; first, the block's queries
    bf16* vs = ks + MMA_ROWS * ld;   // [64][ld] values
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wr = warp * 16;
    int hi = blockIdx.y, bi = blockIdx.z;
    int width = (h + 2 * kvh) * d, g = hi / (h / kvh);
    long long row0 = (long long)bi * t;
    int i0 = (gridDim.x - 1 - blockIdx.x) * MMA_ROWS, ilast = min(i0 + MMA_ROWS, t) - 1;
    const float NEG_INF = -__int_as_float(0x7f800000), sl2 = scale * MMA_LOG2E;
    // The queries pass through the keys' tile into registers (the loop's first barrier keeps
    // the first keys from overwriting them before every warp has its fragments).
    mma_load_rows(ks, qkv, row0, i0, MMA_ROWS, t, width, hi * d, d);
    __syncthreads();
    unsigned qf[MMA_MAXD / 16][4];
#pragma unroll
    for (int kc = 0; kc < MMA_MAXD / 16; kc++)
        if (kc * 16 < d) mma_frag_a(qf[kc], ks + wr * ld + kc * 16, ld);
    // This lane's rows i0 + wr + lane / 4 and 8 below it: running maximum (log2 units) and
    // this lane's part of the row sum.
    int ia = i0 + wr + lane / 4;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f}, o[MMA_MAXD / 8][4];
    mma_zero(o);
    for (int j0 = mma_window_lo(i0, window) / MMA_ROWS * MMA_ROWS; j0 <= ilast; j0 += MMA_ROWS) {
        mma_next_keys(ks, vs, qkv, row0, j0, t, h, kvh, g, d);
        float s[8][4];
        mma_zero(s);
#pragma unroll
        for (int kc = 0; kc < MMA_MAXD / 16; kc++) {
            if (kc * 16 >= d) break;
#pragma unroll
            for (int np = 0; np < 4; np++) {
                unsigned fb[4];
                mma_frag_bt(fb, ks + np * 16 * ld + kc * 16, ld);
                mma_16816(s[2 * np], qf[kc], fb[0], fb[1]);
                mma_16816(s[2 * np + 1], qf[kc], fb[2], fb[3]);
            }
        }
        mma_softmax_tile(s, o, m[0], l[0], 0, ia, j0, t, window, sl2);
        mma_softmax_tile(s, o, m[1], l[1], 1, ia + 8, j0, t, window, sl2);
        mma_accumulate<64>(o, s, vs, d, ld);
    }
    float inv[2];
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int i = ia + 8 * half;
        float sum = mma_row_sum(l[half]);
        inv[half] = i < t ? 1.0f / sum : 0.0f;
        if (lane % 4 == 0 && i < t)
            lse[((long long)bi * h + hi) * t + i] = m[half] * MMA_LN2 + logf(sum);
    }
    mma_store(out, o, row0, i0 + wr, t, h * d, hi * d, d, inv[0], inv[1]);
}

// ---- Backward -------------------------------------------------------------------------------
// delta (B, H, T) = dout . out per row and head comes from attention.cu's attention_delta.

// dq part of dqkv: overwrites. grid (ceil(T/64), H, B), block 128.
extern "C" __global__ void __launch_bounds__(MMA_THREADS)
    attention_backward_dq_mma(float* dqkv, const float* dout, const float* qkv,
                              const float* delta, const float* lse, int t, int h, int kvh, int d,
                              int window, float scale) {
    extern __shared__ __align__(128) unsigned char mma_smem[];
    int ld = d + 8;
    bf16* qs = (bf16*)mma_smem;      // [64][ld] the block's queries
    bf16* dos = qs + MMA_ROWS * ld;  // [64][ld] the block's dout
    bf16* ks = dos + MMA_ROWS * ld;  // [64][ld] keys
    bf16* vs = ks + MMA_ROWS * ld;   // [64][ld] values
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wr = warp * 16, q = lane % 4;
    int hi = blockIdx.y, bi = blockIdx.z;
    int width = (h + 2 * kvh) * d, g = hi / (h / kvh);
    long long row0 = (long long)bi * t, at = ((long long)bi * h + hi) * t;
    int i0 = (gridDim.x - 1 - blockIdx.x) * MMA_ROWS, ilast = min(i0 + MMA_ROWS, t) - 1;
    mma_load_rows(qs, qkv, row0, i0, MMA_ROWS, t, width, hi * d, d);
    mma_load_rows(dos, dout, row0, i0, MMA_ROWS, t, h * d, hi * d, d);
    // This lane's rows ia and ia + 8: lse in log2 units, delta.
    int ia = i0 + wr + lane / 4;
    float lse2[2], dl[2];
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int i = ia + 8 * half;
        lse2[half] = i < t ? lse[at + i] * MMA_LOG2E : 0.0f;
        dl[half] = i < t ? delta[at + i] : 0.0f;
    }
    const float sl2 = scale * MMA_LOG2E;
    float dq[MMA_MAXD / 8][4];
    mma_zero(dq);
    for (int j0 = mma_window_lo(i0, window) / MMA_ROWS * MMA_ROWS; j0 <= ilast; j0 += MMA_ROWS) {
        mma_next_keys(ks, vs, qkv, row0, j0, t, h, kvh, g, d);
        float s[8][4], dp[8][4];
        mma_zero(s);
        mma_zero(dp);
        mma_scores<64>(s, qs + wr * ld, ks, d, ld);
        mma_scores<64>(dp, dos + wr * ld, vs, d, ld);
        // dS = P (dP - delta), P = exp(S scale - lse), in place of S.
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int i = ia + 8 * (e / 2), j = j0 + nt * 8 + 2 * q + e % 2;
                bool seen = i < t && j >= mma_window_lo(i, window) && j <= i;
                s[nt][e] = seen ? exp2f(s[nt][e] * sl2 - lse2[e / 2]) * (dp[nt][e] - dl[e / 2])
                                : 0.0f;
            }
        mma_accumulate<64>(dq, s, ks, d, ld);
    }
    mma_store(dqkv, dq, row0, i0 + wr, t, width, hi * d, d, scale, scale);
}

// dk and dv parts of dqkv: overwrite. grid (ceil(T/64), KVH, B), block 128. A block's 64 keys
// walk the query tiles (MMA_QT queries) that see them, for every query head of their group.
// A warp's 16 keys are the rows of its products: S^T = K Q^T, dV += P^T dout, dP^T = V dout^T,
// dK += dS^T Q.
extern "C" __global__ void __launch_bounds__(MMA_THREADS)
    attention_backward_dkv_mma(float* dqkv, const float* dout, const float* qkv,
                               const float* delta, const float* lse, int t, int h, int kvh,
                               int d, int window, float scale) {
    extern __shared__ __align__(128) unsigned char mma_smem[];
    int ld = d + 8;
    bf16* ks = (bf16*)mma_smem;        // [64][ld] the block's keys
    bf16* vs = ks + MMA_ROWS * ld;     // [64][ld] the block's values
    bf16* qs = vs + MMA_ROWS * ld;     // [MMA_QT][ld] queries
    bf16* dos = qs + MMA_QT * ld;      // [MMA_QT][ld] dout
    float* lse_t = (float*)(dos + MMA_QT * ld);  // [MMA_QT] the tile's lse, log2 units
    float* delta_t = lse_t + MMA_QT;   // [MMA_QT]
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wr = warp * 16, q = lane % 4;
    int g = blockIdx.y, bi = blockIdx.z;
    int width = (h + 2 * kvh) * d, group = h / kvh;
    long long row0 = (long long)bi * t;
    int j0 = blockIdx.x * MMA_ROWS, i_end = mma_window_hi(min(j0 + MMA_ROWS, t) - 1, window, t);
    mma_load_rows(ks, qkv, row0, j0, MMA_ROWS, t, width, (h + g) * d, d);
    mma_load_rows(vs, qkv, row0, j0, MMA_ROWS, t, width, (h + kvh + g) * d, d);
    const float sl2 = scale * MMA_LOG2E;
    int ja = j0 + wr + lane / 4;  // this lane's keys ja and ja + 8
    float dk[MMA_MAXD / 8][4], dv[MMA_MAXD / 8][4];
    mma_zero(dk);
    mma_zero(dv);
    for (int hq = g * group; hq < (g + 1) * group; hq++) {
        long long at = ((long long)bi * h + hq) * t;
        for (int i0 = j0; i0 < i_end; i0 += MMA_QT) {
            __syncthreads();  // the last tile's queries, dout and statistics are no longer read
            mma_load_rows(qs, qkv, row0, i0, MMA_QT, t, width, hq * d, d);
            mma_load_rows(dos, dout, row0, i0, MMA_QT, t, h * d, hq * d, d);
            if (threadIdx.x < MMA_QT) {
                int iq = i0 + threadIdx.x;
                lse_t[threadIdx.x] = iq < t ? lse[at + iq] * MMA_LOG2E : 0.0f;
                delta_t[threadIdx.x] = iq < t ? delta[at + iq] : 0.0f;
            }
            __syncthreads();
            float p[MMA_QT / 8][4], dp[MMA_QT / 8][4];
            mma_zero(p);
            mma_zero(dp);
            mma_scores<MMA_QT>(p, ks + wr * ld, qs, d, ld);
#pragma unroll
            for (int nt = 0; nt < MMA_QT / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int j = ja + 8 * (e / 2), il = nt * 8 + 2 * q + e % 2, iq = i0 + il;
                    bool seen = iq < t && j < t && j >= mma_window_lo(iq, window) && j <= iq;
                    p[nt][e] = seen ? exp2f(p[nt][e] * sl2 - lse_t[il]) : 0.0f;
                }
            mma_accumulate<MMA_QT>(dv, p, dos, d, ld);
            mma_scores<MMA_QT>(dp, vs + wr * ld, dos, d, ld);
            // dS^T = P^T (dP^T - delta), in place of dP^T.
#pragma unroll
            for (int nt = 0; nt < MMA_QT / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    dp[nt][e] = p[nt][e] * (dp[nt][e] - delta_t[nt * 8 + 2 * q + e % 2]);
            mma_accumulate<MMA_QT>(dk, dp, qs, d, ld);
        }
    }
    mma_store(dqkv, dk, row0, j0 + wr, t, width, (h + g) * d, d, scale, scale);
    mma_store(dqkv, dv, row0, j0 + wr, t, width, (h + kvh + g) * d, d, 1.0f, 1.0f);
}
