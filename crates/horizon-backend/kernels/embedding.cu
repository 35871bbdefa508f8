// Embedding gather and row scatter-add. Shapes: out, dout (N, C); ids (N); table, dtable (V, C).
// Launcher: src/cuda/embedding.rs. Reference: src/cpu/embedding.rs.

// out[r, j] = table[ids[r], j]. One thread per element.
extern "C" __global__ void embedding_forward(float* out, const int* ids, const float* table,
                                             int n, int c) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * c) return;
    long long r = i / c, j = i % c;
    out[i] = table[(long long)ids[r] * c + j];
}

// dtable[ids[r], j] += dout[r, j], accumulates. One thread per column j walks the rows in order,
// so a token repeated in the batch adds its rows in the CPU's order (no atomics, deterministic).
extern "C" __global__ void embedding_backward(float* dtable, const int* ids, const float* dout,
                                              int n, int c) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= c) return;
    for (int r = 0; r < n; r++) {
        dtable[(long long)ids[r] * c + j] += dout[(long long)r * c + j];
    }
}
