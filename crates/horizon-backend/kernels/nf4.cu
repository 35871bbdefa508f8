// NF4 weights to bf16 (QLoRA's frozen base). The packed form is src/nf4.rs's device form:
// ceil(n/2) code bytes, little-endian four to a 32-bit word, padded to a whole word
// (`code_words`), then one word per block of 64 holding the block's absmax as f32 bits.
// A byte's first element is its high nibble. Launcher: src/cuda/nf4.rs. Reference:
// src/cpu/nf4.rs (fp32); this rounds the same fp32 value to bf16, nearest even.

__constant__ float NF4_CODE[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

// Round to nearest even; NaN stays NaN (quiet). As kernels/convert.cu.
__device__ unsigned short nf4_to_bf16(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// out[i] = bf16(CODE[q_i] * absmax[i / 64]); out (n) overwrites; packed (words(n)).
extern "C" __global__ void dequantize_nf4(unsigned short* out, const unsigned int* packed,
                                          long long n, long long code_words) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned int byte = (packed[i / 8] >> (8 * ((i / 2) % 4))) & 0xffu;
    unsigned int q = (i % 2 == 0) ? (byte >> 4) : (byte & 0x0fu);
    float absmax = __uint_as_float(packed[code_words + i / 64]);
    out[i] = nf4_to_bf16(__fmul_rn(NF4_CODE[q], absmax));
}

// MXFP4 weights to bf16 (gpt-oss's experts, packed as the frozen base). The packed form is
// src/mxfp4.rs's device form: n/2 code bytes (value i in byte i/2, low nibble for even i),
// little-endian four to a 32-bit word, then the n/32 scale bytes likewise, padded to a whole
// word. out[i] = FP4[code] * 2^(scale - 127), the power of two applied as two normal factors
// where one would leave float's normal exponents (scale 0 and 255), as src/mxfp4.rs's `scaled`;
// every value is exact in bf16 for scales up to 252. Reference: src/cpu/nf4.rs.
__constant__ float MXFP4_CODE[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

__device__ float mxfp4_pow2(int e) { return __uint_as_float((unsigned int)(e + 127) << 23); }

extern "C" __global__ void dequantize_mxfp4(unsigned short* out, const unsigned int* packed,
                                            long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned int code = (packed[i / 8] >> (8 * ((i / 2) % 4) + 4 * (i % 2))) & 15u;
    long long k = i / 32;
    int s = (int)((packed[n / 8 + k / 4] >> (8 * (k % 4))) & 0xffu);
    float v = MXFP4_CODE[code];
    float x;
    if (s == 0) {
        x = __fmul_rn(__fmul_rn(v, mxfp4_pow2(-126)), 0.5f);
    } else if (s == 255) {
        x = __fmul_rn(__fmul_rn(v, mxfp4_pow2(127)), 2.0f);
    } else {
        x = __fmul_rn(v, mxfp4_pow2(s - 127));
    }
    out[i] = nf4_to_bf16(x);
}
