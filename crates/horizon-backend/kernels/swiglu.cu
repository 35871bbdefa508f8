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
