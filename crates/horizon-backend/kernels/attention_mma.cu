// Causal grouped-query attention on tensor cores, FlashAttention-2 style: the function of
// attention.cu (same shapes, window, scale and lse; the derivation is there and in
// src/cpu/attention.rs) with the precision of attention_tc.cu (Q, K, V and dout in bf16, P and
// dS rounded to bf16 as they leave the softmax; scores, statistics and every accumulator fp32).
// Unlike attention_tc.cu's, these kernels take qkv and dout already in bf16: the launcher
// rounds them once into the workspace, so the tiles every block reloads are half the bytes and
// move as they are, 16 bytes a load.
//
// What differs from attention_tc.cu: the products are PTX mma.sync m16n8k16, whose fragment
// layouts the PTX ISA documents, so scores, probabilities and every accumulator stay in
// registers. A product's fp32 result fragment (16 x 8) is, two of them side by side and
// rounded to bf16, the A fragment (16 x 16) of the next product, so P and dS never touch shared
// memory, and the softmax runs on the score fragments (a row's four lanes meet by shuffles).
// Shared memory holds only bf16 tiles of Q, K, V and dout, read by ldmatrix (transposed where a
// product needs a tile's columns). With g = lane / 4 and q = lane % 4, a lane holds rows g and
// g + 8 of its warp's 16, columns 2q and 2q + 1 of each 8-column tile. Under the CUDA test
// double (__FAKECUDA__) mma.sync, ldmatrix and cp.async are its emulation (the same layouts)
// (crates/fakecuda/src/shim/fakecuda_kernel.h).
//
// Work split: 64 rows a block (query rows in the forward and dq kernels, key rows in dk/dv), 4
// warps of 16 rows each; tiles of 64 keys (forward), MMA_DQ_KT keys (dq) or MMA_QT queries
// (dk/dv), copied by cp.async into two buffers in turn, so that the next tile's copy overlaps
// the products on this one. Warps meet only at a tile's two barriers. No atomics: every output
// element has one fixed summation order.
//
// Requires D a multiple of 16 up to 128, sm_80 or later, 16-byte aligned bf16 qkv and dout, and
// 8-byte aligned out and dqkv. Launcher: src/cuda/attention.rs (shared memory: Set::launch
// there).

#define MMA_ROWS 64
#define MMA_THREADS 128
#define MMA_MAXD 128
// Queries a tile of the dk/dv kernel: its warps hold dk and dv (64 registers each at D = 128)
// beside a 16 x MMA_QT score tile and its dP tile, so the tile is narrower than the forward's.
#define MMA_QT 32
// Keys a tile of the dq kernel: its block keeps its queries and dout in shared memory beside
// two buffers of keys and values, 68 KiB at D = 128 (an sm_86/89 GPU allows 99).
#define MMA_DQ_KT 32
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

// ---- mma.sync, ldmatrix and cp.async ------------------------------------------------------
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
__device__ __forceinline__ void mma_cp16(bf16* dst, const bf16* src, bool valid) {
    ::fakecuda::cp_async_16(dst, src, valid ? 16 : 0, __LINE__);
}
__device__ __forceinline__ void mma_commit() { ::fakecuda::cp_async_commit(__LINE__); }
template <int N>
__device__ __forceinline__ void mma_wait() {
    ::fakecuda::cp_async_wait(N, __LINE__);
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
// 16 bytes from global src to shared dst without passing through registers; zeros where not
// `valid` (src-size 0: nothing is read).
__device__ __forceinline__ void mma_cp16(bf16* dst, const bf16* src, bool valid) {
    asm volatile(
        "{\n .reg .u64 a64;\n .reg .u32 a32;\n cvta.to.shared.u64 a64, %0;\n"
        " cvt.u32.u64 a32, a64;\n cp.async.cg.shared.global [a32], [%1], 16, %2;\n}"
        :
        : "l"(dst), "l"(src), "r"(valid ? 16 : 0)
        : "memory");
}
__device__ __forceinline__ void mma_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void mma_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#else
// Before sm_80 there are no bf16 tensor cores: the launcher never runs these kernels there.
__device__ void mma_16816(float (&)[4], const unsigned (&)[4], unsigned, unsigned) { __trap(); }
__device__ void mma_ldsm(unsigned (&)[4], const bf16*) { __trap(); }
__device__ void mma_ldsm_t(unsigned (&)[4], const bf16*) { __trap(); }
__device__ void mma_cp16(bf16*, const bf16*, bool) { __trap(); }
__device__ void mma_commit() { __trap(); }
template <int N>
__device__ void mma_wait() {
    __trap();
}
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
// Tiles move by cp.async, double-buffered: a block issues the next tile's copies, then computes
// on the current one while they fly, and waits for them only before the next tile (its
// barriers make every thread's copies visible to all). Every kernel walks its tiles as:
//   issue tile 0; commit
//   per tile i: [issue tile i + 1 into the other buffer; commit; wait_group 1] or wait_group 0;
//               __syncthreads; compute on tile i; __syncthreads (its buffer is refilled next)

// Issues the copies of `rows` rows from r0 of sequence b (row0: its first row), D wide at
// column `col` of bf16 rows of `width`, into dst (row-major, leading dimension D + 8), 16 bytes
// a copy; rows past T are zeros (read from nowhere).
__device__ void mma_copy_rows(bf16* dst, const bf16* src, long long row0, int r0, int rows,
                              int t, int width, int col, int d) {
    int d8 = d / 8, ld = d + 8;
    for (int idx = threadIdx.x; idx < rows * d8; idx += MMA_THREADS) {
        int r = idx / d8, k = (idx % d8) * 8;
        bool in = r0 + r < t;
        mma_cp16(dst + r * ld + k, src + (row0 + (in ? r0 + r : 0)) * width + col + k, in);
    }
}

// Issues the copies of the key and value tile of kv head g (`rows` keys from j0) into ks, vs.
__device__ __forceinline__ void mma_copy_keys(bf16* ks, bf16* vs, const bf16* qkv, long long row0,
                                              int j0, int rows, int t, int h, int kvh, int g,
                                              int d) {
    int width = (h + 2 * kvh) * d;
    mma_copy_rows(ks, qkv, row0, j0, rows, t, width, (h + g) * d, d);
    mma_copy_rows(vs, qkv, row0, j0, rows, t, width, (h + kvh + g) * d, d);
}

// The pipeline's step before computing on a tile: the next tile's copies issued (by `issue`,
// if there is one) and committed, then this tile's awaited, then the barrier that shows every
// thread's copies to all.
template <class F>
__device__ __forceinline__ void mma_next_tile(bool more, F issue) {
    if (more) {
        issue();
        mma_commit();
        mma_wait<1>();
    } else {
        mma_wait<0>();
    }
    __syncthreads();
}

// A warp's 16 x D result held as fragments, times `mul0` (this lane's row g) or `mul1` (row
// g + 8), into rows r0 (the warp's first) of row-major dst (rows of `width` floats from row0, at
// column `col`); rows at or past T skipped.
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
    attention_forward_mma(float* out, float* lse, const bf16* qkv, int t, int h, int kvh, int d,
                          int window, float scale) {
    extern __shared__ __align__(128) unsigned char mma_smem[];
    int ld = d + 8, tile = MMA_ROWS * ld;
    // Two buffers of a key tile and its value tile, [2][2][64][ld]; the block's queries pass
    // through the second buffer's keys into registers first.
    bf16* bufs = (bf16*)mma_smem;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wr = warp * 16;
    int hi = blockIdx.y, bi = blockIdx.z;
    int width = (h + 2 * kvh) * d, g = hi / (h / kvh);
    long long row0 = (long long)bi * t;
    int i0 = (gridDim.x - 1 - blockIdx.x) * MMA_ROWS, ilast = min(i0 + MMA_ROWS, t) - 1;
    int j_first = mma_window_lo(i0, window) / MMA_ROWS * MMA_ROWS;
    const float NEG_INF = -__int_as_float(0x7f800000), sl2 = scale * MMA_LOG2E;
    mma_copy_rows(bufs + 2 * tile, qkv, row0, i0, MMA_ROWS, t, width, hi * d, d);
    mma_commit();
    mma_copy_keys(bufs, bufs + tile, qkv, row0, j_first, MMA_ROWS, t, h, kvh, g, d);
    mma_commit();
    mma_wait<1>();
    __syncthreads();
    unsigned qf[MMA_MAXD / 16][4];
#pragma unroll
    for (int kc = 0; kc < MMA_MAXD / 16; kc++)
        if (kc * 16 < d) mma_frag_a(qf[kc], bufs + 2 * tile + wr * ld + kc * 16, ld);
    __syncthreads();  // every warp has its queries before the second buffer is refilled
    // This lane's rows i0 + wr + lane / 4 and 8 below it: running maximum (log2 units) and
    // this lane's part of the row sum.
    int ia = i0 + wr + lane / 4;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f}, o[MMA_MAXD / 8][4];
    mma_zero(o);
    for (int j0 = j_first, i = 0; j0 <= ilast; j0 += MMA_ROWS, i++) {
        bf16 *ks = bufs + (i % 2) * 2 * tile, *vs = ks + tile;
        bf16* next = bufs + ((i + 1) % 2) * 2 * tile;
        mma_next_tile(j0 + MMA_ROWS <= ilast, [&] {
            mma_copy_keys(next, next + tile, qkv, row0, j0 + MMA_ROWS, MMA_ROWS, t, h, kvh, g, d);
        });
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
        __syncthreads();  // this buffer is refilled next
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

// dq part of dqkv: overwrites. grid (ceil(T/64), H, B), block 128. Key tiles of MMA_DQ_KT.
extern "C" __global__ void __launch_bounds__(MMA_THREADS)
    attention_backward_dq_mma(float* dqkv, const bf16* dout, const bf16* qkv,
                              const float* delta, const float* lse, int t, int h, int kvh, int d,
                              int window, float scale) {
    extern __shared__ __align__(128) unsigned char mma_smem[];
    int ld = d + 8, ktile = MMA_DQ_KT * ld;
    bf16* qs = (bf16*)mma_smem;      // [64][ld] the block's queries
    bf16* dos = qs + MMA_ROWS * ld;  // [64][ld] the block's dout
    bf16* bufs = dos + MMA_ROWS * ld;  // [2][keys, values][MMA_DQ_KT][ld]
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wr = warp * 16, q = lane % 4;
    int hi = blockIdx.y, bi = blockIdx.z;
    int width = (h + 2 * kvh) * d, g = hi / (h / kvh);
    long long row0 = (long long)bi * t, at = ((long long)bi * h + hi) * t;
    int i0 = (gridDim.x - 1 - blockIdx.x) * MMA_ROWS, ilast = min(i0 + MMA_ROWS, t) - 1;
    int j_first = mma_window_lo(i0, window) / MMA_DQ_KT * MMA_DQ_KT;
    mma_copy_rows(qs, qkv, row0, i0, MMA_ROWS, t, width, hi * d, d);
    mma_copy_rows(dos, dout, row0, i0, MMA_ROWS, t, h * d, hi * d, d);
    mma_copy_keys(bufs, bufs + ktile, qkv, row0, j_first, MMA_DQ_KT, t, h, kvh, g, d);
    mma_commit();
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
    for (int j0 = j_first, i = 0; j0 <= ilast; j0 += MMA_DQ_KT, i++) {
        bf16 *ks = bufs + (i % 2) * 2 * ktile, *vs = ks + ktile;
        bf16* next = bufs + ((i + 1) % 2) * 2 * ktile;
        mma_next_tile(j0 + MMA_DQ_KT <= ilast, [&] {
            mma_copy_keys(next, next + ktile, qkv, row0, j0 + MMA_DQ_KT, MMA_DQ_KT, t, h, kvh, g,
                          d);
        });
        float s[MMA_DQ_KT / 8][4], dp[MMA_DQ_KT / 8][4];
        mma_zero(s);
        mma_zero(dp);
        mma_scores<MMA_DQ_KT>(s, qs + wr * ld, ks, d, ld);
        mma_scores<MMA_DQ_KT>(dp, dos + wr * ld, vs, d, ld);
        // dS = P (dP - delta), P = exp(S scale - lse), in place of S.
#pragma unroll
        for (int nt = 0; nt < MMA_DQ_KT / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int i = ia + 8 * (e / 2), j = j0 + nt * 8 + 2 * q + e % 2;
                bool seen = i < t && j >= mma_window_lo(i, window) && j <= i;
                s[nt][e] = seen ? exp2f(s[nt][e] * sl2 - lse2[e / 2]) * (dp[nt][e] - dl[e / 2])
                                : 0.0f;
            }
        mma_accumulate<MMA_DQ_KT>(dq, s, ks, d, ld);
        __syncthreads();  // this buffer is refilled next
    }
    mma_store(dqkv, dq, row0, i0 + wr, t, width, hi * d, d, scale, scale);
}

// dk and dv parts of dqkv: overwrite. grid (ceil(T/64), KVH, B), block 128. A block's 64 keys
// walk the query tiles (MMA_QT queries) that see them, for every query head of their group.
// A warp's 16 keys are the rows of its products: S^T = K Q^T, dV += P^T dout, dP^T = V dout^T,
// dK += dS^T Q.
extern "C" __global__ void __launch_bounds__(MMA_THREADS)
    attention_backward_dkv_mma(float* dqkv, const bf16* dout, const bf16* qkv,
                               const float* delta, const float* lse, int t, int h, int kvh,
                               int d, int window, float scale) {
    extern __shared__ __align__(128) unsigned char mma_smem[];
    int ld = d + 8, qtile = MMA_QT * ld;
    bf16* ks = (bf16*)mma_smem;        // [64][ld] the block's keys
    bf16* vs = ks + MMA_ROWS * ld;     // [64][ld] the block's values
    bf16* bufs = vs + MMA_ROWS * ld;   // [2][queries, dout][MMA_QT][ld]
    float* stats = (float*)(bufs + 4 * qtile);  // [2][lse (log2 units), delta][MMA_QT]
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wr = warp * 16, q = lane % 4;
    int g = blockIdx.y, bi = blockIdx.z;
    int width = (h + 2 * kvh) * d, group = h / kvh;
    long long row0 = (long long)bi * t;
    int j0 = blockIdx.x * MMA_ROWS, i_end = mma_window_hi(min(j0 + MMA_ROWS, t) - 1, window, t);
    // The walk: tile k is query head g * group + k / nq, queries from j0 + (k % nq) * MMA_QT.
    int nq = (i_end - j0 + MMA_QT - 1) / MMA_QT, tiles = group * nq;
    auto issue = [&](int k) {
        int hq = g * group + k / nq, i0 = j0 + (k % nq) * MMA_QT;
        bf16* qb = bufs + (k % 2) * 2 * qtile;
        float* st = stats + (k % 2) * 2 * MMA_QT;
        mma_copy_rows(qb, qkv, row0, i0, MMA_QT, t, width, hq * d, d);
        mma_copy_rows(qb + qtile, dout, row0, i0, MMA_QT, t, h * d, hq * d, d);
        if (threadIdx.x < MMA_QT) {
            long long at = ((long long)bi * h + hq) * t;
            int iq = i0 + threadIdx.x;
            st[threadIdx.x] = iq < t ? lse[at + iq] * MMA_LOG2E : 0.0f;
            st[MMA_QT + threadIdx.x] = iq < t ? delta[at + iq] : 0.0f;
        }
    };
    mma_copy_keys(ks, vs, qkv, row0, j0, MMA_ROWS, t, h, kvh, g, d);
    issue(0);
    mma_commit();
    const float sl2 = scale * MMA_LOG2E;
    int ja = j0 + wr + lane / 4;  // this lane's keys ja and ja + 8
    float dk[MMA_MAXD / 8][4], dv[MMA_MAXD / 8][4];
    mma_zero(dk);
    mma_zero(dv);
    for (int k = 0; k < tiles; k++) {
        bf16 *qs = bufs + (k % 2) * 2 * qtile, *dos = qs + qtile;
        const float *lse_t = stats + (k % 2) * 2 * MMA_QT, *delta_t = lse_t + MMA_QT;
        int i0 = j0 + (k % nq) * MMA_QT;
        mma_next_tile(k + 1 < tiles, [&] { issue(k + 1); });
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
        __syncthreads();  // this buffer is refilled next
    }
    mma_store(dqkv, dk, row0, j0 + wr, t, width, (h + g) * d, d, scale, scale);
    mma_store(dqkv, dv, row0, j0 + wr, t, width, (h + kvh + g) * d, d, 1.0f, 1.0f);
}
