// Causal grouped-query attention on tensor cores: the function of attention.cu (same shapes,
// window, scale and lse; the derivation is there and in src/cpu/attention.rs), with every
// product's operands in bf16 and fp32 accumulation, as the CUDA backend's matrix products
// (Precision::Bf16): Q, K, V and dout are rounded to bf16 as they enter shared memory, P and dS
// as they leave the softmax; scores, softmax statistics, lse, delta and every accumulator stay
// fp32.
//
// Products: wmma m16n16k16 (bf16 x bf16 -> fp32) through the PTX instructions, since NVRTC
// ships no mma.h. A fragment's layout across a warp is opaque, so fragments go to and from
// shared memory with wmma.load / wmma.store only, and the softmax works on scores in shared
// memory. Under the CUDA test double (__FAKECUDA__) the same operations are its emulation
// (crates/fakecuda/src/shim/fakecuda_kernel.h).
//
// Work split: 64 rows per block (query rows in the forward and dq kernels, key rows in the dk/dv
// kernel), 4 warps of 16 rows each. After a tile is loaded (by every thread), a warp's products,
// softmax and accumulation touch only its own rows, so warps meet only to load the next tile.
// A warp's own rows of Q and dout (forward, dq) stay in registers as fragments for the whole
// kernel, its keys' and values' (dk/dv) for a tile, and each P or dS tile's for its products.
// In the softmax, lanes 2r and 2r + 1 of a warp own its row r, 32 columns each. No atomics:
// every output element has one fixed summation order.
//
// Requires D a multiple of 16 up to 128, sm_80 or later, and 16-byte aligned qkv, out, dout and
// dqkv (float4 loads). Launcher: src/cuda/attention.rs, which runs attention.cu's kernels
// otherwise, or where these do not fit the device's shared memory. Shared memory (bytes): see
// Set::launch there.

#define TC_ROWS 64
#define TC_THREADS 128
#define TC_MAXD 128
// Leading dimensions: bf16 tiles of D columns are padded to D + 8, fp32 score tiles to 68, P and
// dS tiles to 72, fp32 accumulators to D + 4; each keeps the 32-byte fragment alignment and a
// row stride that is a multiple of 16 bytes, and spreads rows over shared memory's banks.
#define TC_LDS 68
#define TC_LDP 72

typedef unsigned short bf16;

// First key query i sees; one past the last query that sees key j (as in attention.cu).
__device__ int tc_window_lo(int i, int window) { return window > 0 ? max(0, i - window + 1) : 0; }

__device__ int tc_window_hi(int j, int window, int t) {
    return window > 0 ? min(t, j + window) : t;
}

// Round to nearest even; NaN stays NaN (quiet): convert.cu's rounding.
__device__ __forceinline__ unsigned tc_bf16(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}

// ---- wmma fragments -------------------------------------------------------------------------
struct FragA { unsigned x[4]; };   // 16 x 16 bf16, from a row-major tile
struct FragBc { unsigned x[4]; };  // 16 x 16 bf16 B, from a column-major tile (B = M^T, M row-major)
struct FragBr { unsigned x[4]; };  // 16 x 16 bf16 B, from a row-major tile
struct FragC { float x[8]; };      // 16 x 16 fp32 accumulator

__device__ __forceinline__ void tc_zero(FragC& c) {
#pragma unroll
    for (int e = 0; e < 8; e++) c.x[e] = 0.0f;
}

#if defined(__FAKECUDA__)
__device__ __forceinline__ void tc_load_a(FragA& f, const bf16* p, int ld) {
    ::fakecuda::wmma_load_bf16(f.x, p, ld, false, __LINE__);
}
__device__ __forceinline__ void tc_load_bc(FragBc& f, const bf16* p, int ld) {
    ::fakecuda::wmma_load_bf16(f.x, p, ld, true, __LINE__);
}
__device__ __forceinline__ void tc_load_br(FragBr& f, const bf16* p, int ld) {
    ::fakecuda::wmma_load_bf16(f.x, p, ld, false, __LINE__);
}
__device__ __forceinline__ void tc_load_c(FragC& f, const float* p, int ld) {
    ::fakecuda::wmma_load_f32(f.x, p, ld, __LINE__);
}
__device__ __forceinline__ void tc_store_c(float* p, const FragC& f, int ld) {
    ::fakecuda::wmma_store_f32(p, f.x, ld, __LINE__);
}
__device__ __forceinline__ void tc_mma(FragC& c, const FragA& a, const FragBc& b) {
    ::fakecuda::wmma_mma_bf16(c.x, a.x, b.x, __LINE__);
}
__device__ __forceinline__ void tc_mma(FragC& c, const FragA& a, const FragBr& b) {
    ::fakecuda::wmma_mma_bf16(c.x, a.x, b.x, __LINE__);
}
#elif __CUDA_ARCH__ >= 800
#define TC_LOAD_AB(name, frag, layout, mat)                                                    \
    __device__ __forceinline__ void name(frag& f, const bf16* p, int ld) {                     \
        asm volatile("wmma.load." mat ".sync.aligned." layout ".m16n16k16.bf16 "               \
                     "{%0, %1, %2, %3}, [%4], %5;"                                             \
                     : "=r"(f.x[0]), "=r"(f.x[1]), "=r"(f.x[2]), "=r"(f.x[3])                  \
                     : "l"(p), "r"(ld)                                                         \
                     : "memory");                                                              \
    }
TC_LOAD_AB(tc_load_a, FragA, "row", "a")
TC_LOAD_AB(tc_load_bc, FragBc, "col", "b")
TC_LOAD_AB(tc_load_br, FragBr, "row", "b")
#undef TC_LOAD_AB
__device__ __forceinline__ void tc_load_c(FragC& f, const float* p, int ld) {
    asm volatile(
        "wmma.load.c.sync.aligned.row.m16n16k16.f32 {%0, %1, %2, %3, %4, %5, %6, %7}, [%8], %9;"
        : "=f"(f.x[0]), "=f"(f.x[1]), "=f"(f.x[2]), "=f"(f.x[3]), "=f"(f.x[4]), "=f"(f.x[5]),
          "=f"(f.x[6]), "=f"(f.x[7])
        : "l"(p), "r"(ld)
        : "memory");
}
__device__ __forceinline__ void tc_store_c(float* p, const FragC& f, int ld) {
    asm volatile(
        "wmma.store.d.sync.aligned.row.m16n16k16.f32 [%0], {%1, %2, %3, %4, %5, %6, %7, %8}, %9;"
        :
        : "l"(p), "f"(f.x[0]), "f"(f.x[1]), "f"(f.x[2]), "f"(f.x[3]), "f"(f.x[4]), "f"(f.x[5]),
          "f"(f.x[6]), "f"(f.x[7]), "r"(ld)
        : "memory");
}
#define TC_MMA(frag, blayout)                                                                   \
    __device__ __forceinline__ void tc_mma(FragC& c, const FragA& a, const frag& b) {            \
        asm volatile("wmma.mma.sync.aligned.row." blayout ".m16n16k16.f32.bf16.bf16.f32 "       \
                     "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, "                   \
                     "{%12, %13, %14, %15}, {%0, %1, %2, %3, %4, %5, %6, %7};"                  \
                     : "+f"(c.x[0]), "+f"(c.x[1]), "+f"(c.x[2]), "+f"(c.x[3]), "+f"(c.x[4]),    \
                       "+f"(c.x[5]), "+f"(c.x[6]), "+f"(c.x[7])                                 \
                     : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[0]),         \
                       "r"(b.x[1]), "r"(b.x[2]), "r"(b.x[3]));                                  \
    }
TC_MMA(FragBc, "col")
TC_MMA(FragBr, "row")
#undef TC_MMA
#else
// Before sm_80 there are no bf16 tensor cores: the launcher never runs these kernels there.
__device__ void tc_load_a(FragA&, const bf16*, int) { __trap(); }
__device__ void tc_load_bc(FragBc&, const bf16*, int) { __trap(); }
__device__ void tc_load_br(FragBr&, const bf16*, int) { __trap(); }
__device__ void tc_load_c(FragC&, const float*, int) { __trap(); }
__device__ void tc_store_c(float*, const FragC&, int) { __trap(); }
__device__ void tc_mma(FragC&, const FragA&, const FragBc&) { __trap(); }
__device__ void tc_mma(FragC&, const FragA&, const FragBr&) { __trap(); }
#endif

// ---- Shared tiles ---------------------------------------------------------------------------
// Rows r0..r0+64 of sequence b (row0: its first row), D wide at column `col` of rows of `width`
// floats, rounded to bf16 into dst (row-major, leading dimension D + 8); rows past T are 0.
__device__ void tc_load_rows(bf16* dst, const float* src, long long row0, int r0, int t,
                             int width, int col, int d) {
    int d4 = d / 4, ld = d + 8;
    for (int idx = threadIdx.x; idx < TC_ROWS * d4; idx += TC_THREADS) {
        int r = idx / d4, k = (idx % d4) * 4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r0 + r < t) v = *(const float4*)(src + (row0 + r0 + r) * width + col + k);
        *(uint2*)(dst + r * ld + k) =
            make_uint2(tc_bf16(v.x) | (tc_bf16(v.y) << 16), tc_bf16(v.z) | (tc_bf16(v.w) << 16));
    }
}

// A warp's 16 rows of D columns of a row-major bf16 tile (leading dimension D + 8) as D / 16
// fragments, held in registers for every product they take part in (a warp's queries, keys,
// values or dout, the same for each tile the kernel walks): loaded once instead of once per
// product.
struct RowFrags { FragA f[TC_MAXD / 16]; };

__device__ __forceinline__ void tc_load_row_frags(RowFrags& r, const bf16* rows, int d) {
#pragma unroll
    for (int k = 0; k < TC_MAXD / 16; k++)
        if (k * 16 < d) tc_load_a(r.f[k], rows + k * 16, d + 8);
}

// out (16 x 64, fp32, leading dimension TC_LDS) = a (a warp's 16 rows) times the transpose of b
// (64 x D rows of a row-major bf16 tile): a warp's scores against a tile of keys.
__device__ __forceinline__ void tc_scores(float* out, const RowFrags& a, const bf16* b, int d) {
    int ld = d + 8;
    for (int n = 0; n < 4; n++) {
        FragC s;
        tc_zero(s);
#pragma unroll
        for (int k = 0; k < TC_MAXD / 16; k++) {
            if (k * 16 >= d) break;
            FragBc fb;
            tc_load_bc(fb, b + n * 16 * ld + k * 16, ld);
            tc_mma(s, a.f[k], fb);
        }
        tc_store_c(out + n * 16, s, TC_LDS);
    }
}

// acc (16 x D, fp32 in shared memory, leading dimension D + 4) += w (16 x 64 bf16, leading
// dimension TC_LDP) times rows (64 x D, a row-major bf16 tile); w's 4 fragments are loaded once.
__device__ __forceinline__ void tc_accumulate(float* acc, const bf16* w, const bf16* rows, int d) {
    int ld = d + 8, ldo = d + 4;
    FragA wf[4];
#pragma unroll
    for (int k = 0; k < 4; k++) tc_load_a(wf[k], w + k * 16, TC_LDP);
    for (int n = 0; n < d; n += 16) {
        FragC c;
        tc_load_c(c, acc + n, ldo);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            FragBr fb;
            tc_load_br(fb, rows + k * 16 * ld + n, ld);
            tc_mma(c, wf[k], fb);
        }
        tc_store_c(acc + n, c, ldo);
    }
}

// The key and value tile of kv head g from key j0 into ks and vs, between two barriers: the
// last tile's are no longer read before, the new ones are complete after.
__device__ __forceinline__ void tc_next_keys(bf16* ks, bf16* vs, const float* qkv, long long row0,
                                             int j0, int t, int h, int kvh, int g, int d) {
    int width = (h + 2 * kvh) * d;
    __syncthreads();
    tc_load_rows(ks, qkv, row0, j0, t, width, (h + g) * d, d);
    tc_load_rows(vs, qkv, row0, j0, t, width, (h + kvh + g) * d, d);
    __syncthreads();
}

// Rows r0..r0+16 (below T) of a block's fp32 results (leading dimension D + 4), times `mul`,
// into row-major dst (rows of `width`, at column `col`), coalesced over the warp's lanes.
__device__ void tc_store_rows(float* dst, const float* src, long long row0, int r0, int t,
                              int width, int col, int d, float mul) {
    int lane = threadIdx.x % 32;
    for (int r = 0; r < 16 && r0 + r < t; r++)
        for (int c = lane; c < d; c += 32)
            dst[(row0 + r0 + r) * width + col + c] = src[r * (d + 4) + c] * mul;
}

// ---- Forward ----------------------------------------------------------------------------------
// out (N, H*D), lse (B, H, T): overwrite. grid (ceil(T/64), H, B), block 128; the latest query
// blocks, which see the most keys, start first.
extern "C" __global__ void __launch_bounds__(TC_THREADS)
    attention_forward_tc(float* out, float* lse, const float* qkv, int t, int h, int kvh, int d,
                         int window, float scale) {
    extern __shared__ __align__(128) unsigned char tc_smem[];
    int ldh = d + 8, ldo = d + 4;
    bf16* ks = (bf16*)tc_smem;           // [64][ldh] keys; first, the block's queries
    bf16* vs = ks + TC_ROWS * ldh;       // [64][ldh] values
    float* ss = (float*)(vs + TC_ROWS * ldh);  // [64][TC_LDS] scores
    float* os = ss + TC_ROWS * TC_LDS;   // [64][ldo] unnormalised output
    bf16* ps = (bf16*)(os + TC_ROWS * ldo);  // [64][TC_LDP] probabilities
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wr = warp * 16;
    int hi = blockIdx.y, bi = blockIdx.z;
    int width = (h + 2 * kvh) * d, g = hi / (h / kvh);
    long long row0 = (long long)bi * t;
    int i0 = (gridDim.x - 1 - blockIdx.x) * TC_ROWS, ilast = min(i0 + TC_ROWS, t) - 1;
    const float NEG_INF = -__int_as_float(0x7f800000);
    // The queries pass through the keys' tile into registers (the loop's first barrier keeps
    // the first keys from overwriting them before every warp has its fragments).
    tc_load_rows(ks, qkv, row0, i0, t, width, hi * d, d);
    for (int e = lane; e < 16 * d; e += 32) os[(wr + e / d) * ldo + e % d] = 0.0f;
    __syncthreads();
    RowFrags qf;
    tc_load_row_frags(qf, ks + wr * ldh, d);
    // This lane's softmax row and half of the tile's columns; m and l live in both lanes.
    int r = wr + lane / 2, half = lane % 2, i = i0 + r, lo = tc_window_lo(i, window);
    float m = NEG_INF, l = 0.0f;
    for (int j0 = tc_window_lo(i0, window) / TC_ROWS * TC_ROWS; j0 <= ilast; j0 += TC_ROWS) {
        tc_next_keys(ks, vs, qkv, row0, j0, t, h, kvh, g, d);
        tc_scores(ss + wr * TC_LDS, qf, ks, d);
        __syncwarp();
        // This lane's 32 scores, read once into registers.
        const float* srow = ss + r * TC_LDS + half * 32;
        float sv[32], tmax = NEG_INF;
#pragma unroll
        for (int c = 0; c < 32; c++) {
            int j = j0 + half * 32 + c;
            sv[c] = i < t && j >= lo && j <= i ? srow[c] * scale : NEG_INF;
            tmax = fmaxf(tmax, sv[c]);
        }
        float m_new = fmaxf(m, fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1)));
        // A row that sees no key of this tile (yet) keeps its state.
        float corr = m_new == NEG_INF ? 1.0f : expf(m - m_new), psum = 0.0f;
        bf16* prow = ps + r * TC_LDP + half * 32;
#pragma unroll
        for (int c = 0; c < 32; c++) {
            float p = sv[c] == NEG_INF ? 0.0f : expf(sv[c] - m_new);
            prow[c] = (bf16)tc_bf16(p);
            psum += p;
        }
        l = l * corr + psum + __shfl_xor_sync(0xffffffffu, psum, 1);
        m = m_new;
        float* orow = os + r * ldo + half * (d / 2);
        for (int c = 0; c < d / 2; c++) orow[c] *= corr;
        __syncwarp();
        tc_accumulate(os + wr * ldo, ps + wr * TC_LDP, vs, d);
    }
    __syncwarp();
    float inv = i < t ? 1.0f / l : 0.0f;
    float* orow = os + r * ldo + half * (d / 2);
    for (int c = 0; c < d / 2; c++) orow[c] *= inv;
    if (half == 0 && i < t) lse[((long long)bi * h + hi) * t + i] = m + logf(l);
    __syncwarp();
    tc_store_rows(out, os + wr * ldo, row0, i0 + wr, t, h * d, hi * d, d, 1.0f);
}

// ---- Backward -------------------------------------------------------------------------------
// delta (B, H, T) = dout . out per row and head comes from attention.cu's attention_delta.

// dq part of dqkv: overwrites. grid (ceil(T/64), H, B), block 128.
extern "C" __global__ void __launch_bounds__(TC_THREADS)
    attention_backward_dq_tc(float* dqkv, const float* dout, const float* qkv,
                             const float* delta, const float* lse, int t, int h, int kvh, int d,
                             int window, float scale) {
    extern __shared__ __align__(128) unsigned char tc_smem[];
    int ldh = d + 8, ldo = d + 4;
    bf16* ks = (bf16*)tc_smem;            // [64][ldh] keys; first, the block's queries
    bf16* vs = ks + TC_ROWS * ldh;        // [64][ldh] values; first, the block's dout
    float* ss = (float*)(vs + TC_ROWS * ldh);  // [64][TC_LDS] scores
    float* dps = ss + TC_ROWS * TC_LDS;   // [64][TC_LDS] dP = dout V^T
    bf16* dss = (bf16*)(dps + TC_ROWS * TC_LDS);  // [64][TC_LDP] dS
    float* dqs = ss;  // [64][ldo] dq, after the last tile (fits in ss and dps)
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wr = warp * 16;
    int hi = blockIdx.y, bi = blockIdx.z;
    int width = (h + 2 * kvh) * d, g = hi / (h / kvh);
    long long row0 = (long long)bi * t, at = ((long long)bi * h + hi) * t;
    int i0 = (gridDim.x - 1 - blockIdx.x) * TC_ROWS, ilast = min(i0 + TC_ROWS, t) - 1;
    // Queries and dout pass through the key and value tiles into registers (the loop's first
    // barrier keeps the first keys and values from overwriting them too early).
    tc_load_rows(ks, qkv, row0, i0, t, width, hi * d, d);
    tc_load_rows(vs, dout, row0, i0, t, h * d, hi * d, d);
    __syncthreads();
    RowFrags qf, dof;
    tc_load_row_frags(qf, ks + wr * ldh, d);
    tc_load_row_frags(dof, vs + wr * ldh, d);
    int r = wr + lane / 2, half = lane % 2, i = i0 + r, lo = tc_window_lo(i, window);
    float lse_i = i < t ? lse[at + i] : 0.0f, delta_i = i < t ? delta[at + i] : 0.0f;
    FragC dq[TC_MAXD / 16];
#pragma unroll
    for (int n = 0; n < TC_MAXD / 16; n++) tc_zero(dq[n]);
    for (int j0 = tc_window_lo(i0, window) / TC_ROWS * TC_ROWS; j0 <= ilast; j0 += TC_ROWS) {
        tc_next_keys(ks, vs, qkv, row0, j0, t, h, kvh, g, d);
        tc_scores(ss + wr * TC_LDS, qf, ks, d);
        tc_scores(dps + wr * TC_LDS, dof, vs, d);
        __syncwarp();
        for (int c = 0; c < 32; c++) {
            int jl = half * 32 + c, j = j0 + jl;
            float ds = 0.0f;
            if (i < t && j >= lo && j <= i) {
                float p = expf(ss[r * TC_LDS + jl] * scale - lse_i);
                ds = p * (dps[r * TC_LDS + jl] - delta_i);
            }
            dss[r * TC_LDP + jl] = (bf16)tc_bf16(ds);
        }
        __syncwarp();
        FragA sf[4];
#pragma unroll
        for (int k = 0; k < 4; k++) tc_load_a(sf[k], dss + wr * TC_LDP + k * 16, TC_LDP);
#pragma unroll
        for (int n = 0; n < TC_MAXD / 16; n++) {
            if (n * 16 >= d) break;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                FragBr fb;
                tc_load_br(fb, ks + k * 16 * ldh + n * 16, ldh);
                tc_mma(dq[n], sf[k], fb);
            }
        }
    }
    __syncthreads();  // every warp is done with ss and dps, where dq goes
#pragma unroll
    for (int n = 0; n < TC_MAXD / 16; n++)
        if (n * 16 < d) tc_store_c(dqs + wr * ldo + n * 16, dq[n], ldo);
    __syncwarp();
    tc_store_rows(dqkv, dqs + wr * ldo, row0, i0 + wr, t, width, hi * d, d, scale);
}

// dk and dv parts of dqkv: overwrite. grid (ceil(T/64), KVH, B), block 128. A block's 64 keys
// walk the query tiles that see them, for every query head of their group.
extern "C" __global__ void __launch_bounds__(TC_THREADS)
    attention_backward_dkv_tc(float* dqkv, const float* dout, const float* qkv,
                              const float* delta, const float* lse, int t, int h, int kvh, int d,
                              int window, float scale) {
    extern __shared__ __align__(128) unsigned char tc_smem[];
    int ldh = d + 8, ldo = d + 4;
    bf16* ks = (bf16*)tc_smem;            // [64][ldh] keys
    bf16* vs = ks + TC_ROWS * ldh;        // [64][ldh] values
    bf16* qs = vs + TC_ROWS * ldh;        // [64][ldh] queries
    bf16* dos = qs + TC_ROWS * ldh;       // [64][ldh] dout
    float* st = (float*)(dos + TC_ROWS * ldh);  // [64 keys][TC_LDS] S^T, then dP^T
    float* dks = st + TC_ROWS * TC_LDS;   // [64][ldo] dk
    float* dvs = dks + TC_ROWS * ldo;     // [64][ldo] dv
    float* lse_t = dvs + TC_ROWS * ldo;   // [64] of the query tile
    float* delta_t = lse_t + TC_ROWS;     // [64]
    bf16* pt = (bf16*)(delta_t + TC_ROWS);  // [64 keys][TC_LDP] P^T, then dS^T
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wr = warp * 16;
    int g = blockIdx.y, bi = blockIdx.z;
    int width = (h + 2 * kvh) * d, group = h / kvh;
    long long row0 = (long long)bi * t;
    int j0 = blockIdx.x * TC_ROWS, i_end = tc_window_hi(min(j0 + TC_ROWS, t) - 1, window, t);
    tc_load_rows(ks, qkv, row0, j0, t, width, (h + g) * d, d);
    tc_load_rows(vs, qkv, row0, j0, t, width, (h + kvh + g) * d, d);
    for (int e = lane; e < 16 * d; e += 32) {
        dks[(wr + e / d) * ldo + e % d] = 0.0f;
        dvs[(wr + e / d) * ldo + e % d] = 0.0f;
    }
    int r = wr + lane / 2, half = lane % 2, j = j0 + r;
    for (int hq = g * group; hq < (g + 1) * group; hq++) {
        long long at = ((long long)bi * h + hq) * t;
        for (int i0 = j0; i0 < i_end; i0 += TC_ROWS) {
            __syncthreads();  // the last tile's queries, dout and statistics are no longer read
            tc_load_rows(qs, qkv, row0, i0, t, width, hq * d, d);
            tc_load_rows(dos, dout, row0, i0, t, h * d, hq * d, d);
            if (threadIdx.x < TC_ROWS) {
                int iq = i0 + threadIdx.x;
                lse_t[threadIdx.x] = iq < t ? lse[at + iq] : 0.0f;
                delta_t[threadIdx.x] = iq < t ? delta[at + iq] : 0.0f;
            }
            __syncthreads();
            // Rows: the warp's keys; columns: the tile's queries. One score tile and one
            // probability tile serve twice: S^T, then dP^T; P^T, then dS^T (so that the kernel
            // fits an A100's 163 KiB at D = 128); this lane's P values wait in registers.
            // The warp's key (then value) fragments, once a tile: held across the whole walk
            // with the rest, they would not fit in registers.
            RowFrags kv;
            tc_load_row_frags(kv, ks + wr * ldh, d);
            tc_scores(st + wr * TC_LDS, kv, qs, d);
            __syncwarp();
            float p[32];
#pragma unroll
            for (int c = 0; c < 32; c++) {
                int il = half * 32 + c, iq = i0 + il;
                bool seen = iq < t && j < t && j >= tc_window_lo(iq, window) && j <= iq;
                p[c] = seen ? expf(st[r * TC_LDS + il] * scale - lse_t[il]) : 0.0f;
                pt[r * TC_LDP + il] = (bf16)tc_bf16(p[c]);
            }
            __syncwarp();
            tc_accumulate(dvs + wr * ldo, pt + wr * TC_LDP, dos, d);
            tc_load_row_frags(kv, vs + wr * ldh, d);
            tc_scores(st + wr * TC_LDS, kv, dos, d);
            __syncwarp();
#pragma unroll
            for (int c = 0; c < 32; c++) {
                int il = half * 32 + c;
                float ds = p[c] * (st[r * TC_LDS + il] - delta_t[il]);
                pt[r * TC_LDP + il] = (bf16)tc_bf16(ds);
            }
            __syncwarp();
            tc_accumulate(dks + wr * ldo, pt + wr * TC_LDP, qs, d);
        }
    }
    __syncwarp();
    tc_store_rows(dqkv, dks + wr * ldo, row0, j0 + wr, t, width, (h + g) * d, d, scale);
    tc_store_rows(dqkv, dvs + wr * ldo, row0, j0 + wr, t, width, (h + kvh + g) * d, d, 1.0f);
}
