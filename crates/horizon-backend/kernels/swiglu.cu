// SwiGLU: out = silu(gate) * up. Shapes: gate_up, dgate_up (N, 2F), row = [gate | up];
// out, dout (N, F). Launcher: src/cuda/swiglu.rs. Reference and derivation: src/cpu/swiglu.rs.

__device__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// out overwrites. One thread per element.
extern "C" __global__ void swiglu_forward(float* out, const float* gate_up, int n, int f) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * f) return;
    long long r = i / f, j = i % f;
    float g = gate_up[r * 2 * f + j], u = gate_up[r * 2 * f + f + j];
    out[i] = g * sigmoid(g) * u;
}

// dgate = dout * u * s * (1 + g * (1 - s)), dup = dout * g * s, s = sigmoid(g). Overwrites.
extern "C" __global__ void swiglu_backward(float* dgate_up, const float* dout,
                                           const float* gate_up, int n, int f) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * f) return;
    long long r = i / f, j = i % f;
    float g = gate_up[r * 2 * f + j], u = gate_up[r * 2 * f + f + j];
    float s = sigmoid(g), dy = dout[i];
    dgate_up[r * 2 * f + j] = dy * u * s * (1.0f + g * (1.0f - s));
    dgate_up[r * 2 * f + f + j] = dy * g * s;
}

// gpt-oss's clamped SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit),
// out = (u + 1) * g * sigmoid(alpha * g); a clamped entry passes no gradient. Derivation:
// src/cpu/swiglu.rs. Products unfused (__fmul_rn) only where the CPU's order matters: none
// here is compared bitwise.
extern "C" __global__ void clamped_swiglu_forward(float* out, const float* gate_up, int n, int f,
                                                  float alpha, float limit) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * f) return;
    long long r = i / f, j = i % f;
    float g = fminf(gate_up[r * 2 * f + j], limit);
    float u = fminf(fmaxf(gate_up[r * 2 * f + f + j], -limit), limit);
    out[i] = (u + 1.0f) * (g * sigmoid(alpha * g));
}

extern "C" __global__ void clamped_swiglu_backward(float* dgate_up, const float* dout,
                                                   const float* gate_up, int n, int f,
                                                   float alpha, float limit) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * f) return;
    long long r = i / f, j = i % f;
    float g0 = gate_up[r * 2 * f + j], u0 = gate_up[r * 2 * f + f + j];
    float g = fminf(g0, limit), u = fminf(fmaxf(u0, -limit), limit);
    float s = sigmoid(alpha * g), dy = dout[i];
    float g_open = g0 <= limit ? 1.0f : 0.0f;
    float u_open = (u0 >= -limit && u0 <= limit) ? 1.0f : 0.0f;
    dgate_up[r * 2 * f + j] = g_open * (dy * (u + 1.0f) * (s * (1.0f + alpha * g * (1.0f - s))));
    dgate_up[r * 2 * f + f + j] = u_open * (dy * (g * s));
}
