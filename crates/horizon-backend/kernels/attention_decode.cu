// Attention of a KV cache's new positions, forward only (a decode step of generation): the last
// T_new query rows of each sequence of T cached positions against the keys before and at them,
// flash style as attention_forward in attention.cu (key/value tiles of 32 rows through shared
// memory), without the lse. Shapes: qkv (B*T, QKV), row = [q (H*D) | k (KVH*D) | v (KVH*D)],
// after rope; out (B*T_new, H*D), row bi*T_new + r = query position T - T_new + r. Query head h
// reads kv head h / (H/KVH); scores are scale q.k; D <= 256. Sliding window W (`window`, 0 =
// full causal; the launcher passes 0 for W >= T): query i sees keys max(0, i - W + 1)..=i.
// sinks (H) where has_sinks: head h's sink logit, one more softmax column of each row that adds no value
// (gpt-oss; as attention_sink_forward after the full forward): folded into the running max and
// sum after the last key tile.
// Launcher: src/cuda/attention_decode.rs. Reference: src/cpu/attention_decode.rs.
//
// Work split: one warp per new query row, ROWS warps per block sharing the tiles. Lane l
// scores tile row l; lane l owns the output dims l, l + 32, ... (at most 8).

#define ROWS 8
#define TILE 32
#define MAXU 8

__device__ int window_lo(int i, int window) { return window > 0 ? max(0, i - window + 1) : 0; }

__device__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Copy TILE rows of D floats (positions start..start+TILE of sequence b, at column `col` of
// rows of `width`) into a padded shared tile; positions past T read as 0.
__device__ void load_tile(float* tile, const float* base, long long b_row0, int start, int t,
                          int width, int col, int d) {
    int stride = d + 1;
    for (int idx = threadIdx.x; idx < TILE * d; idx += blockDim.x) {
        int r = idx / d, k = idx % d;
        int pos = start + r;
        tile[r * stride + k] = pos < t ? base[(b_row0 + pos) * width + col + k] : 0.0f;
    }
}

// out (B*T_new, H*D): overwrites. grid (ceil(T_new/ROWS), H, B), block 32*ROWS threads, dynamic
// shared memory (2*TILE*(D+1) + ROWS*D) floats.
extern "C" __global__ void attention_decode(float* out, const float* qkv, const unsigned short* sinks,
                                            int has_sinks, int t, int t_new, int h, int kvh,
                                            int d, int window, float scale) {
    extern __shared__ float smem[];
    float* ks = smem;
    float* vs = ks + TILE * (d + 1);
    float* qs = vs + TILE * (d + 1);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int hi = blockIdx.y, bi = blockIdx.z;
    int width = (h + 2 * kvh) * d;
    int g = hi / (h / kvh);
    long long row0 = (long long)bi * t;
    int r = blockIdx.x * ROWS + warp;
    int i0 = t - t_new + blockIdx.x * ROWS;
    int i = i0 + warp;
    bool live = r < t_new;
    int imax = min(i0 + ROWS, t) - 1;
    int lo = window_lo(i, window);
    float* q = qs + warp * d;
    if (live) {
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
        if (!live || j0 > i || j0 + TILE <= lo) continue;
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
    if (live && has_sinks) {
        float s = __uint_as_float((unsigned int)sinks[hi] << 16);  // a bf16 weight
        float m_new = fmaxf(m, s);
        float corr = expf(m - m_new);
        l = l * corr + expf(s - m_new);
        for (int u = 0; u < MAXU; u++) o[u] *= corr;
    }
    if (live) {
        float inv = 1.0f / l;
        for (int u = 0; u < MAXU; u++) {
            int k = lane + 32 * u;
            if (k < d) out[((long long)bi * t_new + r) * h * d + hi * d + k] = o[u] * inv;
        }
    }
}
