// The parts of the linear layer cuBLAS does not do: the bias. Shapes: out, dout (N, OC);
// bias (OC), bf16 (the device's weight format, as its 16 bits); dbias (OC), fp32. Launcher:
// src/cuda/matmul.rs (the products themselves are cuBLAS GEMMs).

// The f32 of bf16 bits `h` (exact).
__device__ float bf16_to_f32(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }

// out[r, o] += bias[o]. One thread per element.
extern "C" __global__ void matmul_bias_forward(float* out, const unsigned short* bias, int n,
                                               int oc) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * oc) return;
    out[i] += bf16_to_f32(bias[i % oc]);
}

// dbias[o] += sum_r dout[r, o]. Accumulates. 32 columns x 8 row groups per block, fixed order.
extern "C" __global__ void matmul_bias_backward(float* dbias, const float* dout, int n, int oc) {
    __shared__ float part[8][33];
    int o = blockIdx.x * 32 + threadIdx.x;
    int g = threadIdx.y;
    float acc = 0.0f;
    if (o < oc) {
        for (int r = g; r < n; r += 8) acc += dout[(long long)r * oc + o];
    }
    part[g][threadIdx.x] = acc;
    __syncthreads();
    if (g == 0 && o < oc) {
        float s = 0.0f;
        for (int k = 0; k < 8; k++) s += part[k][threadIdx.x];
        dbias[o] += s;
    }
}
