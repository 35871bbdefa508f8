// GeGLU (Gemma): out = gelu_tanh(gate) * up, with transformers' gelu_pytorch_tanh. Shapes:
// gate_up, dgate_up (N, 2F), row = [gate | up]; out, dout (N, F). Launcher: src/cuda/geglu.rs.
// Reference: src/cpu/geglu.rs. Derivation, with c = sqrt(2/pi), a = 0.044715:
//   gelu(x) = 0.5 x (1 + t),  t = tanh(u),  u = c (x + a x^3)
//   gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) du/dx,  du/dx = c (1 + 3 a x^2)
//   dgate = dout * up * gelu'(gate),  dup = dout * gelu(gate)

#define GELU_C 0.7978845608028654f
#define GELU_A 0.044715f

// out overwrites. One thread per element.
extern "C" __global__ void geglu_forward(float* out, const float* gate_up, int n, int f) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * f) return;
    long long r = i / f, j = i % f;
    float g = gate_up[r * 2 * f + j], u = gate_up[r * 2 * f + f + j];
    float t = tanhf(GELU_C * (g + GELU_A * g * g * g));
    out[i] = 0.5f * g * (1.0f + t) * u;
}

// dgate_up overwrites, as derived above. One thread per element of dout.
extern "C" __global__ void geglu_backward(float* dgate_up, const float* dout,
                                          const float* gate_up, int n, int f) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * f) return;
    long long r = i / f, j = i % f;
    float g = gate_up[r * 2 * f + j], u = gate_up[r * 2 * f + f + j];
    float t = tanhf(GELU_C * (g + GELU_A * g * g * g));
    float dt = GELU_C * (1.0f + 3.0f * GELU_A * g * g);
    float gelu = 0.5f * g * (1.0f + t);
    float dgelu = 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * dt;
    float dy = dout[i];
    dgate_up[r * 2 * f + j] = dy * u * dgelu;
    dgate_up[r * 2 * f + f + j] = dy * gelu;
}
