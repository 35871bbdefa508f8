// Rotary embedding (rotate-half), in place on the q and k heads of qkv (N, QKV); cos, sin
// (T, D/2). The RoPE variant (default, linear, llama3) is in the tables, built on the host.
// Launcher: src/cuda/rope.rs. Reference and derivation: src/cpu/rope.rs.

// One thread per (row, rotated head, pair j). sign = +1: forward; -1: backward (the inverse
// rotation, in place on dq and dk; dv untouched).
extern "C" __global__ void rope_rotate(float* qkv, const float* cos_t, const float* sin_t, int n,
                                       int t, int heads, int d, int width, float sign) {
    int half = d / 2;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * heads * half) return;
    int j = i % half;
    long long rh = i / half;
    int head = rh % heads;
    long long r = rh / heads;
    int pos = r % t;
    float c = cos_t[pos * half + j];
    float sn = sign * sin_t[pos * half + j];
    float* x = qkv + r * width + (long long)head * d;
    float a = x[j], b = x[j + half];
    x[j] = a * c - b * sn;
    x[j + half] = b * c + a * sn;
}
