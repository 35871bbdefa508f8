// Tests of the fake NVRTC (libnvrtc.so, used through its C API with dlopen, as cudarc does) and
// the kernel executor (src/exec.cpp, linked in): kernels are compiled, loaded with load_module
// and run with run_grid. Checks results under several seeds, every failure the executor must
// report, compile errors and options, that all of the project's kernel files compile (and that
// a few of them compute what their CPU references do), and prints a fiber-switch benchmark.
//   test_exec <libnvrtc.so> <folder of the project's .cu files>
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "exec.h"

using fakecuda::Dim3;
using fakecuda::KernelInfo;
using fakecuda::Module;
using fakecuda::RunResult;

// ---- A tiny harness --------------------------------------------------------------------------

static int g_failures = 0;
static std::string g_test;
static bool g_test_ok = true;

static void check(bool ok, const std::string& what) {
    if (ok) return;
    printf("  FAIL [%s] %s\n", g_test.c_str(), what.c_str());
    g_failures++;
    g_test_ok = false;
}

static bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

static void run_test(const char* name, const std::function<void()>& body) {
    g_test = name;
    g_test_ok = true;
    auto t0 = std::chrono::steady_clock::now();
    body();
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    printf("%s %s (%.0f ms)\n", g_test_ok ? "ok  " : "FAIL", name, ms);
    fflush(stdout);
}

// ---- NVRTC through its C ABI -----------------------------------------------------------------

struct Nvrtc {
    int (*create)(void**, const char*, const char*, int, const char* const*, const char* const*);
    int (*compile)(void*, int, const char* const*);
    int (*log_size)(void*, size_t*);
    int (*log)(void*, char*);
    int (*cubin_size)(void*, size_t*);
    int (*cubin)(void*, char*);
    int (*destroy)(void**);
    int (*version)(int*, int*);
};
static Nvrtc nv;

template <class F>
static void sym(void* h, const char* name, F* f) {
    *f = reinterpret_cast<F>(dlsym(h, name));
    if (!*f) {
        fprintf(stderr, "libnvrtc.so lacks %s\n", name);
        exit(2);
    }
}

static void open_nvrtc(const char* path) {
    void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "cannot open %s: %s\n", path, dlerror());
        exit(2);
    }
    sym(h, "nvrtcCreateProgram", &nv.create);
    sym(h, "nvrtcCompileProgram", &nv.compile);
    sym(h, "nvrtcGetProgramLogSize", &nv.log_size);
    sym(h, "nvrtcGetProgramLog", &nv.log);
    sym(h, "nvrtcGetCUBINSize", &nv.cubin_size);
    sym(h, "nvrtcGetCUBIN", &nv.cubin);
    sym(h, "nvrtcDestroyProgram", &nv.destroy);
    sym(h, "nvrtcVersion", &nv.version);
}

struct Compiled {
    int rc = -1;
    std::string log;
    std::vector<char> image;
};

static Compiled compile(const std::string& src, const char* name,
                        std::vector<const char*> opts = {"--gpu-architecture=sm_90", "--std=c++17"}) {
    Compiled c;
    void* prog = nullptr;
    if (nv.create(&prog, src.c_str(), name, 0, nullptr, nullptr) != 0) return c;
    c.rc = nv.compile(prog, (int)opts.size(), opts.data());
    size_t n = 0;
    nv.log_size(prog, &n);
    std::vector<char> log(n);
    nv.log(prog, log.data());
    c.log = log.data();
    if (c.rc == 0) {
        nv.cubin_size(prog, &n);
        c.image.resize(n);
        nv.cubin(prog, c.image.data());
    }
    nv.destroy(&prog);
    return c;
}

static Module* compile_and_load(const std::string& src, const char* name) {
    Compiled c = compile(src, name);
    check(c.rc == 0, std::string("compiling ") + name + ": rc " + std::to_string(c.rc) + "\n" + c.log);
    if (c.rc != 0) return nullptr;
    std::string err;
    Module* m = fakecuda::load_module(c.image.data(), err);
    check(m != nullptr, std::string("loading ") + name + ": " + err);
    return m;
}

static const KernelInfo* kernel(Module* m, const char* name) {
    const KernelInfo* k = m ? fakecuda::find_kernel(m, name) : nullptr;
    check(k != nullptr, std::string("no kernel ") + name);
    return k;
}

// Launch arguments: keeps each value and hands out the pointer array run_grid wants.
struct Args {
    std::vector<std::vector<char>> vals;
    std::vector<void*> ptrs;
    template <class T>
    Args& add(T v) {
        vals.emplace_back(sizeof(T));
        memcpy(vals.back().data(), &v, sizeof(T));
        return *this;
    }
    void* const* get() {
        ptrs.clear();
        for (auto& v : vals) ptrs.push_back(v.data());
        return ptrs.data();
    }
};

static RunResult launch(const KernelInfo* k, Dim3 grid, Dim3 block, size_t smem, Args& a, uint64_t seed = 1) {
    if (!k) return RunResult{-1, "no kernel"};
    return fakecuda::run_grid(k, grid, block, smem, a.get(), seed);
}

// The 1-based line of the first line of `src` containing `marker`.
static int line_of(const std::string& src, const char* marker) {
    size_t p = src.find(marker);
    return p == std::string::npos ? -1 : 1 + (int)std::count(src.begin(), src.begin() + p, '\n');
}

static std::string read_text(const std::string& path) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

// ---- Test kernels ----------------------------------------------------------------------------

static const std::string kSyncSrc = R"CU(
// Kernels for the executor's tests (this module uses barriers, so its threads are fibers).
__device__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// out[b] = sum of in[b * blockDim.x + t]: shuffles within warps, static shared memory across.
extern "C" __global__ void block_sum(float* out, const float* in) {
    __shared__ float part[32];
    int t = threadIdx.x + threadIdx.y * blockDim.x, lane = t % 32, warp = t / 32;
    int n = blockDim.x * blockDim.y;
    float v = warp_sum(in[blockIdx.x * n + t]);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < n / 32 ? part[lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0) out[blockIdx.x] = v;
    }
}

// The same with a tree in dynamic shared memory (blockDim.x a power of 2).
extern "C" __global__ void tree_sum(double* out, const double* in) {
    extern __shared__ double s[];
    unsigned t = threadIdx.x;
    s[t] = in[blockIdx.x * blockDim.x + t];
    __syncthreads();
    for (unsigned h = blockDim.x / 2; h > 0; h >>= 1) {
        if (t < h) s[t] += s[t + h];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = s[0];
}

// Every warp operation flavour; 8 results per thread.
extern "C" __global__ void warp_ops(int* out) {
    int lane = threadIdx.x % 32;
    int* o = out + 8 * threadIdx.x;
    o[0] = __shfl_up_sync(0xffffffffu, lane, 1);
    o[1] = __shfl_down_sync(0xffffffffu, lane, 2);
    o[2] = __shfl_sync(0xffffffffu, lane * 10, 5);
    o[3] = __shfl_xor_sync(0xffffffffu, lane, 17, 16);
    o[4] = (int)__ballot_sync(0xffffffffu, lane & 1);
    o[5] = __all_sync(0xffffffffu, lane < 32) + 2 * __any_sync(0xffffffffu, lane == 7);
    o[6] = __syncthreads_count(threadIdx.x < 10);
    __syncwarp();
    o[7] = __shfl_sync(0xffffffffu, 2.5, 3) == 2.5;  // a double travels whole
}

// Block order: out[b] = the rank at which block b ran.
extern "C" __global__ void block_rank(int* counter, int* out) {
    if (threadIdx.x == 0) out[blockIdx.x + gridDim.x * blockIdx.y] = atomicAdd(counter, 1);
    __syncthreads();
}

extern "C" __global__ void two_barriers(int* p) {
    if (threadIdx.x < 40) {
        __syncthreads();  // BARRIER_A
    } else {
        __syncthreads();  // BARRIER_B
    }
    p[threadIdx.x] = 1;
}

extern "C" __global__ void early_return(int* p) {
    if (threadIdx.x == 3) return;
    __syncthreads();  // BARRIER_C
    p[threadIdx.x] = 1;
}

extern "C" __global__ void shuffle_exited(int* p) {
    if (threadIdx.x == 37) return;
    p[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);  // SHUFFLE_D
}

extern "C" __global__ void shuffle_outside(int* p) {
    if (threadIdx.x < 16) p[threadIdx.x] = __shfl_sync(0x0000ffffu, (int)threadIdx.x, 20);  // SHUFFLE_E
}

extern "C" __global__ void shuffle_beyond(int* p) {
    p[threadIdx.x] = __shfl_down_sync(0xffffffffu, (int)threadIdx.x, 8, 16);
}

extern "C" __global__ void deadlock(int* p) {
    int v = threadIdx.x;
    if ((threadIdx.x & 31) < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);  // SHUFFLE_F
    __syncthreads();  // BARRIER_F
    p[threadIdx.x] = v;
}

extern "C" __global__ void smem_overflow(int n) {
    extern __shared__ float buf[];
    if (threadIdx.x < n) buf[threadIdx.x] = 1.0f;
    __syncthreads();
}

extern "C" __global__ void smem_nan(int* out) {
    extern __shared__ float buf[];
    out[threadIdx.x] = buf[threadIdx.x] != buf[threadIdx.x];  // NaN before anyone writes
    __syncthreads();
}

extern "C" __global__ void wild_write(float* p) {
    __syncthreads();
    if (threadIdx.x == 7 && blockIdx.x == 1) p[threadIdx.x] = 1.0f;
}

__device__ int deep(int n) {
    volatile char buf[512];
    buf[0] = (char)n;
    return n == 0 ? buf[0] : deep(n - 1) + buf[0];
}

extern "C" __global__ void overflow(int* p) {
    __syncthreads();
    if (threadIdx.x == 2) p[0] = deep(1 << 30);
}

extern "C" __global__ void asserts(int* p) {
    assert(threadIdx.x != 9);  // ASSERT_G
    __syncthreads();
}

// Writes 1 at its (thread, block) slot of a 3-D launch, after a barrier.
extern "C" __global__ void coords_sync(int* seen) {
    __syncthreads();
    unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    atomicAdd(&seen[b * blockDim.x * blockDim.y * blockDim.z + t], 1);
}

// Benchmark: `iters` barriers per thread.
extern "C" __global__ void barrier_loop(int iters, int* out) {
    int acc = 0;
    for (int i = 0; i < iters; i++) {
        acc += i;
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

// The tensor cores' wmma (shim: fakecuda::wmma_*), one warp: d = a b + c, 16 x 16 each; a
// row-major, b row-major or (b_col) column-major, c and d fp32 row-major.
extern "C" __global__ void wmma_product(float* d, const unsigned short* a, const unsigned short* b,
                                        const float* c, int b_col) {
    unsigned fa[4], fb[4];
    float fc[8];
    ::fakecuda::wmma_load_bf16(fa, a, 16, false, __LINE__);
    ::fakecuda::wmma_load_bf16(fb, b, 16, b_col != 0, __LINE__);
    ::fakecuda::wmma_load_f32(fc, c, 16, __LINE__);
    ::fakecuda::wmma_mma_bf16(fc, fa, fb, __LINE__);
    ::fakecuda::wmma_store_f32(d, fc, 16, __LINE__);
}
extern "C" __global__ void wmma_misaligned(const unsigned short* a) {
    unsigned f[4];
    ::fakecuda::wmma_load_bf16(f, a + 8, 16, false, __LINE__);  // 16 bytes past an aligned base
}
extern "C" __global__ void wmma_lane_missing(float* d, const unsigned short* a) {
    if (threadIdx.x == 3) return;
    unsigned f[4];
    float c[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    ::fakecuda::wmma_load_bf16(f, a, 16, false, __LINE__);
    ::fakecuda::wmma_mma_bf16(c, f, f, __LINE__);
    ::fakecuda::wmma_store_f32(d, c, 16, __LINE__);
}
// mma.sync m16n8k16 (shim: fakecuda::mma_m16n8k16_bf16), one warp, with its fragments gathered
// from row-major a (16 x 16), b (16 x 8) and c (16 x 8) by the layouts the PTX ISA documents.
extern "C" __global__ void mma_product(float* d, const unsigned short* a, const unsigned short* b,
                                       const float* c) {
    unsigned lane = threadIdx.x, g = lane / 4, q = lane % 4;
    auto pair = [](unsigned short lo, unsigned short hi) { return (unsigned)lo | ((unsigned)hi << 16); };
    unsigned fa[4], fb[2];
    float fc[4];
    for (unsigned r = 0; r < 4; r++) {
        unsigned m = g + 8 * (r % 2), k = 2 * q + 8 * (r / 2);
        fa[r] = pair(a[m * 16 + k], a[m * 16 + k + 1]);
    }
    for (unsigned r = 0; r < 2; r++) fb[r] = pair(b[(2 * q + 8 * r) * 8 + g], b[(2 * q + 8 * r + 1) * 8 + g]);
    for (unsigned e = 0; e < 4; e++) fc[e] = c[(g + 8 * (e / 2)) * 8 + 2 * q + e % 2];
    ::fakecuda::mma_m16n8k16_bf16(fc, fa, fb, __LINE__);
    for (unsigned e = 0; e < 4; e++) d[(g + 8 * (e / 2)) * 8 + 2 * q + e % 2] = fc[e];
}
// ldmatrix.x4 of the four 8 x 8 quarters of row-major m (16 x 16, rows of `ld` elements):
// lane L's register j to out[(trans * 32 + L) * 4 + j].
extern "C" __global__ void ldmatrix_quarters(unsigned* out, const unsigned short* m, int ld, int trans) {
    unsigned lane = threadIdx.x, j = lane / 8, i = lane % 8;
    unsigned r[4];
    ::fakecuda::ldmatrix_x4(r, m + (8 * (j % 2) + i) * ld + 8 * (j / 2), trans != 0, __LINE__);
    for (unsigned k = 0; k < 4; k++) out[(trans * 32 + lane) * 4 + k] = r[k];
}
// cp.async (shim: fakecuda::cp_async_*): each thread's 8 shared words before any wait, after
// wait_group 1 and after wait_group 0, to out[(phase * 32 + thread) * 8 + k]; the first copy is
// 16 bytes, the second src_bytes = 4 (thread % 4) with zero fill.
extern "C" __global__ void cp_async_probe(unsigned* out, const unsigned* src, int misalign) {
    extern __shared__ __align__(16) unsigned sm[];
    unsigned t = threadIdx.x;
    for (unsigned k = 0; k < 8; k++) sm[t * 8 + k] = 0xaaaaaaaau;
    ::fakecuda::cp_async_16(&sm[t * 8 + misalign], src + t * 4, 16, __LINE__);
    ::fakecuda::cp_async_commit(__LINE__);
    ::fakecuda::cp_async_16(&sm[t * 8 + 4], src + t * 4, 4 * (t % 4), __LINE__);
    ::fakecuda::cp_async_commit(__LINE__);
    for (unsigned phase = 0; phase < 3; phase++) {
        if (phase > 0) ::fakecuda::cp_async_wait(2 - phase, __LINE__);
        for (unsigned k = 0; k < 8; k++) out[(phase * 32 + t) * 8 + k] = sm[t * 8 + k];
    }
}
)CU";

static const std::string kPlainSrc = R"CU(
// No barriers: the executor runs these threads as plain calls.
extern "C" __global__ void scale_add(float* out, const float* a, float s, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = fmaxf(a[i] * s, -1.0f) + min(i, 3LL);
}
extern "C" __global__ void plain_wild(float* p) {
    if (threadIdx.x == 5) p[0] = 2.0f;
}
extern "C" __global__ void plain_smem(int n) {
    extern __shared__ unsigned char bytes[];
    for (int i = 0; i < n; i++) bytes[i] = 0;
}
extern "C" __global__ void coords_plain(int* seen) {
    unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    atomicAdd(&seen[b * blockDim.x * blockDim.y * blockDim.z + t], 1);
}
extern "C" __global__ void plain_atomics(float* f, double* d, int* i, unsigned* u) {
    atomicAdd(f, 0.5f);
    atomicAdd(d, 0.25);
    atomicAdd(i, 1);
    atomicMax(u, threadIdx.x);
}
)CU";

// ---- Tests -----------------------------------------------------------------------------------

static Module* g_sync = nullptr;
static Module* g_plain = nullptr;

static void check_failure(const RunResult& r, int code, const std::vector<std::string>& parts) {
    check(r.code == code, "code " + std::to_string(r.code) + ", expected " + std::to_string(code) + ": " + r.message);
    for (const std::string& p : parts) check(contains(r.message, p), "message lacks \"" + p + "\": " + r.message);
}

// After a failed launch the fibers must work again.
static void check_recovers() {
    const KernelInfo* k = kernel(g_sync, "block_sum");
    std::vector<float> in(256, 1.0f), out(1, 0.0f);
    Args a;
    a.add(out.data()).add((const float*)in.data());
    RunResult r = launch(k, {1, 1, 1}, {256, 1, 1}, 0, a, 99);
    check(r.code == 0 && out[0] == 256.0f, "a launch after a failure: " + r.message);
}

static void test_reductions() {
    const KernelInfo* k = kernel(g_sync, "block_sum");
    const int blocks = 5, n = 256;
    std::vector<float> in(blocks * n), out(blocks);
    for (int i = 0; i < blocks * n; i++) in[i] = (float)((i * 7) % 13);
    for (uint64_t seed : {1ull, 2ull, 3ull, 12345ull, 0xdeadbeefull}) {
        std::fill(out.begin(), out.end(), -1.0f);
        Args a;
        a.add(out.data()).add((const float*)in.data());
        RunResult r = launch(k, {blocks, 1, 1}, {n, 1, 1}, 0, a, seed);
        check(r.code == 0, r.message);
        for (int b = 0; b < blocks; b++) {
            float want = 0;
            for (int t = 0; t < n; t++) want += in[b * n + t];
            check(out[b] == want, "block_sum seed " + std::to_string(seed) + " block " + std::to_string(b) +
                                      ": " + std::to_string(out[b]) + " != " + std::to_string(want));
        }
    }
    // A 2-D block (64 x 4): threads are linearised x-fastest, warps cut across rows.
    std::fill(out.begin(), out.end(), -1.0f);
    Args a2;
    a2.add(out.data()).add((const float*)in.data());
    RunResult r2 = launch(k, {blocks, 1, 1}, {64, 4, 1}, 0, a2, 7);
    check(r2.code == 0, r2.message);
    for (int b = 0; b < blocks; b++) {
        float want = 0;
        for (int t = 0; t < n; t++) want += in[b * n + t];
        check(out[b] == want, "block_sum 2-D block " + std::to_string(b));
    }

    const KernelInfo* kt = kernel(g_sync, "tree_sum");
    std::vector<double> din(3 * 128), dout(3);
    for (size_t i = 0; i < din.size(); i++) din[i] = 0.5 * (double)i;
    for (uint64_t seed : {5ull, 6ull, 7ull}) {
        Args a;
        a.add(dout.data()).add((const double*)din.data());
        RunResult r = launch(kt, {3, 1, 1}, {128, 1, 1}, 128 * sizeof(double), a, seed);
        check(r.code == 0, r.message);
        for (int b = 0; b < 3; b++) {
            double want = 0;
            for (int t = 0; t < 128; t++) want += din[b * 128 + t];
            check(dout[b] == want, "tree_sum block " + std::to_string(b));
        }
    }
}

static void test_warp_ops() {
    const KernelInfo* k = kernel(g_sync, "warp_ops");
    const int n = 64;
    std::vector<int> out(8 * n, -99);
    Args a;
    a.add(out.data());
    RunResult r = launch(k, {1, 1, 1}, {n, 1, 1}, 0, a, 3);
    check(r.code == 0, r.message);
    for (int t = 0; t < n; t++) {
        int lane = t % 32, seg = lane & ~15;
        const int* o = &out[8 * t];
        int x = lane ^ 17;
        int want_xor = x < seg + 16 ? x : lane;
        check(o[0] == (lane >= 1 ? lane - 1 : lane), "shfl_up lane " + std::to_string(lane) + ": " + std::to_string(o[0]));
        check(o[1] == (lane + 2 < 32 ? lane + 2 : lane), "shfl_down lane " + std::to_string(lane));
        check(o[2] == 50, "shfl idx");
        check(o[3] == want_xor, "shfl_xor width 16 lane " + std::to_string(lane) + ": " + std::to_string(o[3]));
        check((unsigned)o[4] == 0xaaaaaaaau, "ballot");
        check(o[5] == 3, "all/any");
        check(o[6] == 10, "syncthreads_count: " + std::to_string(o[6]));
        check(o[7] == 1, "double shuffle");
    }
}

static void test_seeds() {
    const KernelInfo* k = kernel(g_sync, "block_rank");
    auto order = [&](uint64_t seed) {
        int counter = 0;
        std::vector<int> out(32, -1);
        Args a;
        a.add(&counter).add(out.data());
        RunResult r = launch(k, {8, 4, 1}, {64, 1, 1}, 0, a, seed);
        check(r.code == 0, r.message);
        return out;
    };
    std::vector<int> a = order(1), b = order(1), c = order(2);
    std::vector<int> sorted = a;
    std::sort(sorted.begin(), sorted.end());
    bool perm = true;
    for (int i = 0; i < 32; i++) perm &= sorted[i] == i;
    check(perm, "every block ran once");
    check(a == b, "the same seed gives the same block order");
    check(a != c, "another seed gives another block order");
}

static void test_coords() {
    const Dim3 grid{3, 2, 2}, block{5, 3, 2};
    const size_t n = 12 * 30;
    for (Module* m : {g_sync, g_plain}) {
        std::vector<int> seen(n, 0);
        Args a;
        a.add(seen.data());
        RunResult r = launch(kernel(m, m == g_sync ? "coords_sync" : "coords_plain"), grid, block, 0, a, 4);
        check(r.code == 0, r.message);
        check(std::count(seen.begin(), seen.end(), 1) == (long)n, "every (block, thread) of a 3-D launch ran once");
    }
}

static void test_barrier_failures() {
    RunResult r;
    std::vector<int> p(256);
    Args a;
    a.add(p.data());
    r = launch(kernel(g_sync, "two_barriers"), {1, 1, 1}, {64, 1, 1}, 0, a);
    check_failure(r, 719, {"kernel two_barriers", "threads wait at different barriers",
                           "line " + std::to_string(line_of(kSyncSrc, "BARRIER_A")) + " (threads 0-39)",
                           "line " + std::to_string(line_of(kSyncSrc, "BARRIER_B")) + " (threads 40-63)"});
    check_recovers();
    for (uint64_t seed : {1ull, 2ull, 3ull}) {
        r = launch(kernel(g_sync, "early_return"), {2, 1, 1}, {64, 1, 1}, 0, a, seed);
        check_failure(r, 719, {"kernel early_return", "barrier at line " + std::to_string(line_of(kSyncSrc, "BARRIER_C")) +
                                                          " not reached by thread (3,0,0) of block (", "which exited"});
    }
    check_recovers();
    r = launch(kernel(g_sync, "deadlock"), {1, 1, 1}, {32, 1, 1}, 0, a);
    check_failure(r, 719, {"kernel deadlock", "deadlock",
                           "line " + std::to_string(line_of(kSyncSrc, "BARRIER_F")) + " (threads 16-31)",
                           "line " + std::to_string(line_of(kSyncSrc, "SHUFFLE_F")) + " (threads 0-15)"});
    check_recovers();
}

static void test_shuffle_failures() {
    std::vector<int> p(256);
    Args a;
    a.add(p.data());
    for (uint64_t seed : {1ull, 2ull, 3ull, 4ull}) {
        RunResult r = launch(kernel(g_sync, "shuffle_exited"), {1, 1, 1}, {64, 1, 1}, 0, a, seed);
        check_failure(r, 719, {"kernel shuffle_exited",
                               "shuffle at line " + std::to_string(line_of(kSyncSrc, "SHUFFLE_D")) +
                                   " names lane 5, which exited"});
    }
    RunResult r = launch(kernel(g_sync, "shuffle_outside"), {1, 1, 1}, {32, 1, 1}, 0, a);
    check_failure(r, 719, {"kernel shuffle_outside", "line " + std::to_string(line_of(kSyncSrc, "SHUFFLE_E")),
                           "reads lane 20, which is not in the mask 0xffff"});
    // 40 threads: lanes 0-7 of warp 1 exist; lane 0 (width 16, delta 8) reads lane 8, which does not.
    r = launch(kernel(g_sync, "shuffle_beyond"), {1, 1, 1}, {40, 1, 1}, 0, a);
    check_failure(r, 719, {"kernel shuffle_beyond", "reads lane 8, which is beyond the block (40 threads)"});
    check_recovers();
}

// wmma: a 16 x 16 x 16 bf16 product with fp32 accumulation against a double reference, with b
// in either layout; a misaligned operand and a lane missing from the product fail the launch.
static void test_wmma() {
    alignas(32) static unsigned short a[256], b[256];
    alignas(32) static float c[256], d[256];
    auto bf = [](float x) {  // x is exact in bf16 below: its top 16 bits
        unsigned u;
        memcpy(&u, &x, 4);
        return (unsigned short)(u >> 16);
    };
    auto val = [](int i) { return (float)((i * 37) % 17 - 8) * 0.25f; };
    for (int b_col : {0, 1}) {
        for (int i = 0; i < 256; i++) {
            a[i] = bf(val(i));
            b[i] = bf(val(i + 5));
            c[i] = (float)(i % 7) - 3.0f;
            d[i] = -1.0f;
        }
        Args args;
        args.add(&d[0]).add((const unsigned short*)a).add((const unsigned short*)b).add((const float*)c).add(b_col);
        RunResult r = launch(kernel(g_sync, "wmma_product"), {1, 1, 1}, {32, 1, 1}, 0, args, 5);
        check(r.code == 0, r.message);
        for (int m = 0; m < 16; m++)
            for (int n = 0; n < 16; n++) {
                double want = c[m * 16 + n];
                for (int k = 0; k < 16; k++)
                    want += (double)val(m * 16 + k) * val(b_col ? n * 16 + k + 5 : k * 16 + n + 5);
                check(std::fabs(d[m * 16 + n] - want) < 1e-4, "wmma d[" + std::to_string(m) + "][" +
                      std::to_string(n) + "] = " + std::to_string(d[m * 16 + n]) + ", want " + std::to_string(want));
            }
    }
    Args mis;
    mis.add((const unsigned short*)a);
    RunResult r = launch(kernel(g_sync, "wmma_misaligned"), {1, 1, 1}, {32, 1, 1}, 0, mis);
    check_failure(r, 716, {"kernel wmma_misaligned", "not 32-byte aligned"});
    Args lane;
    lane.add(&d[0]).add((const unsigned short*)a);
    r = launch(kernel(g_sync, "wmma_lane_missing"), {1, 1, 1}, {32, 1, 1}, 0, lane);
    check(r.code == 719, "a product without lane 3 ran: " + std::to_string(r.code) + " " + r.message);
    check_recovers();
}

// mma.sync m16n8k16 against a double reference, its fragments in the documented layouts; ldmatrix
// (plain and transposed) gives each lane the elements the PTX ISA says, and a misaligned row fails.
static void test_mma() {
    alignas(32) static unsigned short a[256], b[128], m[16 * 24];
    alignas(32) static float c[128], d[128];
    alignas(32) static unsigned got[2 * 32 * 4];
    auto bf = [](float x) {  // exact in bf16 below: its top 16 bits
        unsigned u;
        memcpy(&u, &x, 4);
        return (unsigned short)(u >> 16);
    };
    auto val = [](int i) { return (float)((i * 37) % 17 - 8) * 0.25f; };
    for (int i = 0; i < 256; i++) a[i] = bf(val(i));
    for (int i = 0; i < 128; i++) {
        b[i] = bf(val(i + 5));
        c[i] = (float)(i % 7) - 3.0f;
        d[i] = -1.0f;
    }
    Args args;
    args.add(&d[0]).add((const unsigned short*)a).add((const unsigned short*)b).add((const float*)c);
    RunResult r = launch(kernel(g_sync, "mma_product"), {1, 1, 1}, {32, 1, 1}, 0, args, 3);
    check(r.code == 0, r.message);
    for (int i = 0; i < 16; i++)
        for (int n = 0; n < 8; n++) {
            double want = c[i * 8 + n];
            for (int k = 0; k < 16; k++) want += (double)val(i * 16 + k) * val(k * 8 + n + 5);
            check(std::fabs(d[i * 8 + n] - want) < 1e-4, "mma d[" + std::to_string(i) + "][" +
                  std::to_string(n) + "] = " + std::to_string(d[i * 8 + n]) + ", want " + std::to_string(want));
        }
    for (int i = 0; i < 16 * 24; i++) m[i] = (unsigned short)i;
    for (int trans : {0, 1}) {
        Args la;
        la.add(&got[0]).add((const unsigned short*)m).add(24).add(trans);
        r = launch(kernel(g_sync, "ldmatrix_quarters"), {1, 1, 1}, {32, 1, 1}, 0, la);
        check(r.code == 0, r.message);
        for (unsigned lane = 0; lane < 32; lane++)
            for (unsigned j = 0; j < 4; j++)
                for (unsigned h = 0; h < 2; h++) {
                    unsigned row = lane / 4, col = 2 * (lane % 4) + h;
                    if (trans) std::swap(row, col);
                    unsigned want = m[(8 * (j % 2) + row) * 24 + 8 * (j / 2) + col];
                    unsigned have = (got[(trans * 32 + lane) * 4 + j] >> (16 * h)) & 0xffffu;
                    check(have == want, "ldmatrix trans=" + std::to_string(trans) + " lane " +
                          std::to_string(lane) + " reg " + std::to_string(j) + ": " + std::to_string(have) +
                          ", want " + std::to_string(want));
                }
    }
    Args mis;
    mis.add(&got[0]).add((const unsigned short*)m).add(20).add(0);  // rows 40 bytes apart
    r = launch(kernel(g_sync, "ldmatrix_quarters"), {1, 1, 1}, {32, 1, 1}, 0, mis);
    check_failure(r, 716, {"kernel ldmatrix_quarters", "not 16-byte aligned"});
    check_recovers();
}

// cp.async: a pending copy's destination is all ones, the copy lands when a wait_group lets its
// group complete, src_bytes below 16 fills with zeros, and a misaligned address fails the launch.
static void test_cp_async() {
    alignas(16) static unsigned src[128], out[3 * 32 * 8];
    for (unsigned i = 0; i < 128; i++) src[i] = 1000 + i;
    Args args;
    args.add(&out[0]).add((const unsigned*)src).add(0);
    RunResult r = launch(kernel(g_sync, "cp_async_probe"), {1, 1, 1}, {32, 1, 1}, 32 * 8 * 4, args);
    check(r.code == 0, r.message);
    for (unsigned t = 0; t < 32; t++)
        for (unsigned k = 0; k < 8; k++) {
            // Pending, a copy's destination is all ones.
            unsigned first = k < 4 ? src[t * 4 + k] : 0xffffffffu;
            unsigned second = k < 4 ? src[t * 4 + k] : (k - 4 < t % 4 ? src[t * 4 + k - 4] : 0u);
            unsigned want[3] = {0xffffffffu, first, second};
            for (unsigned phase = 0; phase < 3; phase++)
                check(out[(phase * 32 + t) * 8 + k] == want[phase],
                      "cp.async phase " + std::to_string(phase) + " thread " + std::to_string(t) + " word " +
                          std::to_string(k) + ": " + std::to_string(out[(phase * 32 + t) * 8 + k]) + ", want " +
                          std::to_string(want[phase]));
        }
    Args mis;
    mis.add(&out[0]).add((const unsigned*)src).add(1);
    r = launch(kernel(g_sync, "cp_async_probe"), {1, 1, 1}, {32, 1, 1}, 32 * 8 * 4, mis);
    check_failure(r, 716, {"kernel cp_async_probe", "not 16-byte aligned"});
    check_recovers();
}

static void test_smem_failures() {
    RunResult r;
#ifndef FAKECUDA_ASAN  // under ASan the overflow is ASan's to report (and it ends the process)
    Args a;
    a.add(40);
    r = launch(kernel(g_sync, "smem_overflow"), {2, 1, 1}, {64, 1, 1}, 32 * sizeof(float), a);
    check_failure(r, 719, {"kernel smem_overflow", "wrote past the 128 bytes of dynamic shared memory"});
    Args ok;
    ok.add(32);
    r = launch(kernel(g_sync, "smem_overflow"), {2, 1, 1}, {64, 1, 1}, 32 * sizeof(float), ok);
    check(r.code == 0, "writing exactly the buffer is fine: " + r.message);
    Args plain;
    plain.add(65);
    r = launch(kernel(g_plain, "plain_smem"), {1, 1, 1}, {1, 1, 1}, 64, plain);
    check_failure(r, 719, {"kernel plain_smem", "wrote past the 64 bytes"});
#endif
    std::vector<int> nan(64, 0);
    Args b;
    b.add(nan.data());
    r = launch(kernel(g_sync, "smem_nan"), {1, 1, 1}, {64, 1, 1}, 64 * sizeof(float), b);
    check(r.code == 0 && std::count(nan.begin(), nan.end(), 1) == 64, "dynamic shared memory starts as NaN");
    check_recovers();
}

static void test_faults() {
    float* bogus = reinterpret_cast<float*>(0x10);
    Args a;
    a.add(bogus);
    RunResult r = launch(kernel(g_sync, "wild_write"), {2, 1, 1}, {32, 1, 1}, 0, a);
    check_failure(r, 700, {"kernel wild_write", "illegal address 0x2c", "thread (7,0,0) of block (1,0,0)"});
    check_recovers();
    r = launch(kernel(g_plain, "plain_wild"), {1, 1, 1}, {32, 1, 1}, 0, a);
    check_failure(r, 700, {"kernel plain_wild", "illegal address 0x10", "thread (5,0,0)"});
    std::vector<int> p(4);
    Args b;
    b.add(p.data());
    r = launch(kernel(g_sync, "overflow"), {1, 1, 1}, {32, 1, 1}, 0, b);
    check_failure(r, 700, {"kernel overflow", "stack overflow", "thread (2,0,0)"});
    check_recovers();
    r = launch(kernel(g_sync, "asserts"), {1, 1, 1}, {32, 1, 1}, 0, b);
    check_failure(r, 710, {"kernel asserts", "assertion failed: threadIdx.x != 9",
                           "line " + std::to_string(line_of(kSyncSrc, "ASSERT_G")), "thread (9,0,0)"});
    check_recovers();
}

// Installed by main before the executor installs its own: faults outside kernels must end here.
static void prev_handler(int) {
    static const char msg[] = "test_exec: SIGSEGV outside a kernel reached the previous handler\n";
    if (write(2, msg, sizeof msg - 1) < 0) _exit(43);
    _exit(42);
}

// A fault outside any kernel goes to the handler installed before ours (in a child process).
static void test_foreign_fault() {
    pid_t pid = fork();
    if (pid == 0) {
        int devnull = open("/dev/null", O_WRONLY);  // the child's message is expected
        if (devnull >= 0) dup2(devnull, 2);
        volatile int* nowhere = nullptr;
        *nowhere = 1;
        _exit(1);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    check(WIFEXITED(status) && WEXITSTATUS(status) == 42,
          "a fault outside run_grid went to the previous handler (status " + std::to_string(status) + ")");
}

static void test_plain_module() {
    const KernelInfo* k = kernel(g_plain, "scale_add");
    check(k && k->nparams == 4, "scale_add has 4 parameters");
    if (k) {
        check(k->sizes[0] == 8 && k->sizes[2] == 4 && k->sizes[3] == 8, "parameter sizes");
        check(k->aligns[2] == 4 && k->aligns[3] == 8, "parameter alignments");
        check(k->is_ptr[0] && k->is_ptr[1] && !k->is_ptr[2] && !k->is_ptr[3], "pointer parameters");
    }
    const long long n = 1000;
    std::vector<float> in(n), out(n, 0);
    for (int i = 0; i < n; i++) in[i] = (float)i - 500;
    Args a;
    a.add(out.data()).add((const float*)in.data()).add(0.5f).add(n);
    RunResult r = launch(k, {4, 1, 1}, {256, 1, 1}, 0, a);
    check(r.code == 0, r.message);
    bool ok = true;
    for (int i = 0; i < n; i++) ok &= out[i] == std::fmax(in[i] * 0.5f, -1.0f) + (float)std::min(i, 3);
    check(ok, "scale_add results");

    float f = 0;
    double d = 0;
    int i = 0;
    unsigned u = 0;
    Args b;
    b.add(&f).add(&d).add(&i).add(&u);
    r = launch(kernel(g_plain, "plain_atomics"), {3, 1, 1}, {100, 1, 1}, 0, b);
    check(r.code == 0 && f == 150.0f && d == 75.0 && i == 300 && u == 99, "atomics");
}

static void test_concurrent() {
    const KernelInfo* k = kernel(g_sync, "block_sum");
    bool ok[2] = {true, true};
    auto worker = [&](int id) {
        std::vector<float> in(4 * 256), out(4);
        for (size_t j = 0; j < in.size(); j++) in[j] = (float)(j % 7 + id);
        for (int rep = 0; rep < 30; rep++) {
            Args a;
            a.add(out.data()).add((const float*)in.data());
            RunResult r = launch(k, {4, 1, 1}, {256, 1, 1}, 0, a, rep * 2 + id);
            for (int b = 0; b < 4; b++) {
                float want = 0;
                for (int t = 0; t < 256; t++) want += in[b * 256 + t];
                ok[id] = ok[id] && r.code == 0 && out[b] == want;
            }
        }
    };
    std::thread t0(worker, 0), t1(worker, 1);
    t0.join();
    t1.join();
    check(ok[0] && ok[1], "two threads running the same kernel (static shared memory) at once");
}

static void test_images() {
    std::string err;
    std::vector<char> junk(128, 'x');
    check(fakecuda::load_module(junk.data(), err) == nullptr && contains(err, "magic"), "junk image refused: " + err);
    Compiled c = compile("extern \"C\" __global__ void k(int* p) { *p = 1; }", "tiny.cu");
    check(c.rc == 0, c.log);
    if (c.rc != 0) return;
    std::vector<char> other = c.image;
    other[8] ^= 0x7f;  // the ABI version
    check(fakecuda::load_module(other.data(), err) == nullptr && contains(err, "ABI"), "other ABI refused: " + err);
    // Load, run, unload many times (names of memfds get reused).
    for (int rep = 0; rep < 20; rep++) {
        Module* m = fakecuda::load_module(c.image.data(), err);
        check(m != nullptr, err);
        if (!m) return;
        int v = 0;
        Args a;
        a.add(&v);
        RunResult r = launch(kernel(m, "k"), {1, 1, 1}, {1, 1, 1}, 0, a);
        check(r.code == 0 && v == 1, "tiny kernel");
        check(fakecuda::find_kernel(m, "nope") == nullptr, "unknown kernel");
        fakecuda::unload_module(m);
    }
}

// Source forms the fake NVRTC's source pass must handle.
static void test_source_forms() {
    std::string src = R"CU(
// __global__ in a comment, and "extern \"C\" __global__ void fake();" in a string
const char* text = "extern \"C\" __global__ void not_a_kernel(int);";
extern __shared__ float file_scope[];
extern "C" {
__global__ void in_block(int* p) { p[0] = 7; }
__global__ void __launch_bounds__(256, 2) bounded(int* p, float x) { p[1] = (int)x; }
}
template <int N> __global__ void templated(int* p) { p[2] = N; }
extern "C" __global__ void proto(int* p);
extern "C" __global__ __launch_bounds__(64) void uses_shared(int* p) {
    file_scope[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    extern __shared__ __align__(16) int local_view[];
    p[3 + threadIdx.x] = local_view[31 - threadIdx.x] == __float_as_int(31.0f - threadIdx.x);
}
extern "C" __global__ void proto(int* p) { p[35] = 1; }
)CU";
    Module* m = compile_and_load(src, "forms.cu");
    if (!m) return;
    for (const char* name : {"in_block", "bounded", "uses_shared", "proto"}) kernel(m, name);
    check(fakecuda::find_kernel(m, "templated") == nullptr && fakecuda::find_kernel(m, "not_a_kernel") == nullptr &&
              fakecuda::find_kernel(m, "fake") == nullptr,
          "templates, comments and strings register nothing");
    std::vector<int> p(40, 0);
    Args a;
    a.add(p.data());
    launch(kernel(m, "in_block"), {1, 1, 1}, {1, 1, 1}, 0, a);
    Args b;
    b.add(p.data()).add(3.0f);
    launch(kernel(m, "bounded"), {1, 1, 1}, {1, 1, 1}, 0, b);
    RunResult r = launch(kernel(m, "uses_shared"), {1, 1, 1}, {32, 1, 1}, 32 * 4, a);
    check(r.code == 0, r.message);
    launch(kernel(m, "proto"), {1, 1, 1}, {1, 1, 1}, 0, a);
    check(p[0] == 7 && p[1] == 3 && p[35] == 1, "extern \"C\" block, __launch_bounds__, prototype");
    check(std::count(p.begin() + 3, p.begin() + 35, 1) == 32, "file-scope and local extern __shared__ share the buffer");
    fakecuda::unload_module(m);
}

static void test_compile_errors() {
    std::string src = "// a broken kernel\nextern \"C\" __global__ void broken(float* p) {\n"
                      "    p[0] = undefined_thing;\n}\n";
    Compiled c = compile(src, "broken.cu");
    check(c.rc == 6, "NVRTC_ERROR_COMPILATION expected, got " + std::to_string(c.rc));
    check(contains(c.log, "broken.cu:3:") && contains(c.log, "undefined_thing"), "log names broken.cu:3:\n" + c.log);
    Compiled o = compile("extern \"C\" __global__ void k() {}", "k.cu", {"--gpu-architecture=sm_90", "--bogus-flag"});
    check(o.rc == 5 && contains(o.log, "--bogus-flag"), "unknown option refused: " + std::to_string(o.rc) + " " + o.log);
    Compiled arch = compile("extern \"C\" __global__ void k() {}", "k.cu", {"--gpu-architecture=vulkan"});
    check(arch.rc == 5, "bad architecture refused");
    Compiled sh = compile("extern \"C\" __global__ void k() {\n extern __shared__ float a[], b[];\n}", "sh.cu");
    check(sh.rc == 6 && contains(sh.log, "sh.cu:2:"), "unsupported extern __shared__ form: " + sh.log);
    // -D reaches g++; a header given to nvrtcCreateProgram can be included.
    const char* header = "#define FROM_HEADER 4\n";
    const char* header_name = "consts.h";
    void* prog = nullptr;
    const char* src2 = "#include \"consts.h\"\nextern \"C\" __global__ void k(int* p) { *p = VALUE + FROM_HEADER; }";
    nv.create(&prog, src2, "defines.cu", 1, &header, &header_name);
    const char* opts[] = {"--gpu-architecture=sm_90", "-DVALUE=3"};
    int rc = nv.compile(prog, 2, opts);
    size_t size = 0;
    std::vector<char> image;
    if (rc == 0 && nv.cubin_size(prog, &size) == 0) {
        image.resize(size);
        nv.cubin(prog, image.data());
    }
    nv.destroy(&prog);
    check(rc == 0, "-D and a program header compile");
    std::string err;
    Module* m = image.empty() ? nullptr : fakecuda::load_module(image.data(), err);
    if (m) {
        int v = 0;
        Args a;
        a.add(&v);
        launch(kernel(m, "k"), {1, 1, 1}, {1, 1, 1}, 0, a);
        check(v == 7, "VALUE + FROM_HEADER == 7");
        fakecuda::unload_module(m);
    }
    int major = 0, minor = 0;
    nv.version(&major, &minor);
    check(major == 13 && minor == 0, "nvrtcVersion 13.0");
}

// The kernels of each project file (crates/horizon-backend/src/cuda/kernels.rs, FUNCTIONS).
static const std::vector<std::pair<const char*, std::vector<const char*>>> kProjectKernels = {
    {"attention", {"attention_forward", "attention_forward_tiled", "attention_delta", "attention_backward_dq",
                   "attention_backward_dkv", "attention_backward_dq_tiled", "attention_backward_dkv_tiled"}},
    {"attention_decode", {"attention_decode"}},
    {"attention_tc", {"attention_forward_tc", "attention_backward_dq_tc", "attention_backward_dkv_tc"}},
    {"convert", {"convert_f32_to_bf16"}},
    {"cross_entropy", {"cross_entropy_forward", "cross_entropy_fused"}},
    {"embedding", {"embedding_forward", "embedding_backward"}},
    {"gate", {"sigmoid_gate_forward", "sigmoid_gate_backward"}},
    {"geglu", {"geglu_forward", "geglu_backward"}},
    {"grad_norm", {"grad_norm_partial"}},
    {"head_rmsnorm", {"head_rmsnorm_forward", "head_rmsnorm_backward_dinp", "head_rmsnorm_backward_dweight"}},
    {"matmul", {"matmul_bias_forward", "matmul_bias_backward"}},
    {"moe", {"moe_route_forward", "moe_route_backward", "moe_aux_stats", "moe_gather", "moe_scatter_add",
             "moe_scale_rows", "moe_row_dots"}},
    {"residual", {"residual_forward", "add_inplace"}},
    {"rmsnorm", {"rmsnorm_forward", "rmsnorm_backward_dinp", "rmsnorm_backward_dweight"}},
    {"rope", {"rope_rotate"}},
    {"swiglu", {"swiglu_forward", "swiglu_backward"}},
};
static std::vector<std::pair<std::string, Module*>> g_project;

static Module* project(const char* op) {
    for (auto& e : g_project)
        if (e.first == op) return e.second;
    return nullptr;
}

static void test_project_compiles(const std::string& dir) {
    for (const auto& e : kProjectKernels) {
        std::string src = read_text(dir + "/" + e.first + ".cu");
        check(!src.empty(), std::string("cannot read ") + dir + "/" + e.first + ".cu");
        Module* m = compile_and_load(src, (std::string(e.first) + ".cu").c_str());
        g_project.emplace_back(e.first, m);
        for (const char* name : e.second) kernel(m, name);
    }
}

static void close_to(double got, double want, double tol, const std::string& what) {
    check(std::fabs(got - want) <= tol * (1 + std::fabs(want)),
          what + ": " + std::to_string(got) + " vs " + std::to_string(want));
}

static void test_project_rmsnorm_grad_norm() {
    const int n = 3, c = 300;
    std::vector<float> inp(n * c), out(n * c), rstd(n);
    std::vector<unsigned short> w(c);
    for (int i = 0; i < n * c; i++) inp[i] = std::sin(0.1f * i);
    for (int j = 0; j < c; j++) w[j] = j % 2 ? 0x3f80 : 0x4000;  // 1.0, 2.0 in bf16
    Args a;
    a.add(out.data()).add(rstd.data()).add((const float*)inp.data()).add((const unsigned short*)w.data()).add(n).add(c).add(1e-5f).add(0.0f);
    RunResult r = launch(kernel(project("rmsnorm"), "rmsnorm_forward"), {n, 1, 1}, {256, 1, 1}, 0, a, 11);
    check(r.code == 0, r.message);
    for (int row = 0; row < n; row++) {
        double ss = 0;
        for (int j = 0; j < c; j++) ss += (double)inp[row * c + j] * inp[row * c + j];
        double rs = 1.0 / std::sqrt(ss / c + 1e-5);
        close_to(rstd[row], rs, 1e-5, "rmsnorm rstd");
        for (int j = 0; j < c; j += 37) close_to(out[row * c + j], inp[row * c + j] * rs * (j % 2 ? 1 : 2), 1e-5, "rmsnorm out");
    }

    const long long len = 5000;
    const int blocks = 4;
    std::vector<float> x(len);
    std::vector<double> partial(blocks);
    for (long long i = 0; i < len; i++) x[i] = (float)((i % 17) - 8) * 0.25f;
    Args g;
    g.add(partial.data()).add((const float*)x.data()).add(len);
    r = launch(kernel(project("grad_norm"), "grad_norm_partial"), {blocks, 1, 1}, {256, 1, 1}, 0, g, 5);
    check(r.code == 0, r.message);
    double got = 0, want = 0;
    for (double p : partial) got += p;
    for (float v : x) want += (double)v * v;
    close_to(got, want, 1e-12, "grad_norm");
}

// attention_forward against a direct CPU evaluation (B=2, T=41: two key tiles and a ragged
// last query block; H=4 query heads over KVH=2).
static void test_project_attention() {
    const int B = 2, T = 41, H = 4, KVH = 2, D = 16, W = (H + 2 * KVH) * D;
    std::vector<float> qkv(B * T * W), out(B * T * H * D, -7.0f), lse(B * H * T);
    for (size_t i = 0; i < qkv.size(); i++) qkv[i] = std::sin(0.37f * (float)i) * 0.8f;
    Args a;
    a.add(out.data()).add(lse.data()).add((const float*)qkv.data()).add(T).add(H).add(KVH).add(D).add(0).add(1.0f / std::sqrt((float)D));
    size_t smem = (2 * 32 * (D + 1) + 8 * D) * sizeof(float);
    RunResult r = launch(kernel(project("attention"), "attention_forward"), {(T + 7) / 8, H, B}, {256, 1, 1}, smem, a, 21);
    check(r.code == 0, r.message);
    double worst = 0;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                int g = h / (H / KVH);
                const float* q = &qkv[(b * T + i) * W + h * D];
                std::vector<double> s(i + 1);
                double m = -1e300, l = 0;
                for (int j = 0; j <= i; j++) {
                    const float* k = &qkv[(b * T + j) * W + (H + g) * D];
                    double acc = 0;
                    for (int d = 0; d < D; d++) acc += (double)q[d] * k[d];
                    s[j] = acc / std::sqrt((double)D);
                    m = std::max(m, s[j]);
                }
                for (int j = 0; j <= i; j++) l += std::exp(s[j] - m);
                close_to(lse[(b * H + h) * T + i], m + std::log(l), 1e-5, "attention lse");
                for (int d = 0; d < D; d++) {
                    double o = 0;
                    for (int j = 0; j <= i; j++) o += std::exp(s[j] - m) / l * qkv[(b * T + j) * W + (H + KVH + g) * D + d];
                    worst = std::max(worst, std::fabs(o - out[(b * T + i) * H * D + h * D + d]));
                }
            }
    check(worst < 1e-5, "attention_forward max error " + std::to_string(worst));
}

static void test_project_cross_entropy() {
    const int n = 3, v = 1000;
    std::vector<float> logits(n * v), losses(n, -1);
    std::vector<int> targets = {7, -100, 999};
    for (int i = 0; i < n * v; i++) logits[i] = std::cos(0.01f * i) * 3;
    Args a;
    a.add(losses.data()).add((const float*)logits.data()).add((const int*)targets.data()).add(n).add(v);
    RunResult r = launch(kernel(project("cross_entropy"), "cross_entropy_forward"), {n, 1, 1}, {256, 1, 1}, 0, a, 8);
    check(r.code == 0, r.message);
    for (int row = 0; row < n; row++) {
        if (targets[row] == -100) {
            check(losses[row] == 0.0f, "ignored row");
            continue;
        }
        double m = -1e300, s = 0;
        for (int j = 0; j < v; j++) m = std::max(m, (double)logits[row * v + j]);
        for (int j = 0; j < v; j++) s += std::exp(logits[row * v + j] - m);
        close_to(losses[row], m + std::log(s) - logits[row * v + targets[row]], 1e-5, "cross entropy");
    }
}

static void benchmark() {
    const KernelInfo* k = kernel(g_sync, "barrier_loop");
    std::vector<int> out(8);
    const int iters = 2000, threads = 256, blocks = 4;
    Args a;
    a.add(iters).add(out.data());
    launch(k, {1, 1, 1}, {threads, 1, 1}, 0, a);  // warm up (stacks)
    auto t0 = std::chrono::steady_clock::now();
    RunResult r = launch(k, {blocks, 1, 1}, {threads, 1, 1}, 0, a);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    check(r.code == 0, r.message);
    double switches = (double)blocks * threads * (iters + 1);  // one per barrier arrival, one per exit
    printf("bench: %.1f M fiber switches/s (%d threads x %d barriers x %d blocks in %.3f s)\n",
           switches / s / 1e6, threads, iters, blocks, s);

    const KernelInfo* kb = kernel(g_sync, "block_sum");
    std::vector<float> in(256 * 256, 1.0f), sums(256);
    Args b;
    b.add(sums.data()).add((const float*)in.data());
    t0 = std::chrono::steady_clock::now();
    for (int rep = 0; rep < 10; rep++) launch(kb, {256, 1, 1}, {256, 1, 1}, 0, b, rep);
    s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("bench: block_sum (2 shuffle rounds + 1 barrier): %.1f M threads/s\n", 10.0 * 256 * 256 / s / 1e6);

    const KernelInfo* kp = kernel(g_plain, "scale_add");
    const long long n = 1 << 20;
    std::vector<float> x(n, 1.0f), y(n);
    Args c;
    c.add(y.data()).add((const float*)x.data()).add(2.0f).add(n);
    t0 = std::chrono::steady_clock::now();
    for (int rep = 0; rep < 5; rep++) launch(kp, {(unsigned)(n / 256), 1, 1}, {256, 1, 1}, 0, c, rep);
    s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("bench: elementwise kernel without barriers (plain calls): %.1f M threads/s\n", 5.0 * n / s / 1e6);
}

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s <libnvrtc.so> <kernels folder>\n", argv[0]);
        return 2;
    }
    setvbuf(stdout, nullptr, _IOLBF, 0);
    signal(SIGSEGV, prev_handler);  // before the executor's: see test_foreign_fault
    open_nvrtc(argv[1]);
    run_test("compile the test kernels", [] {
        g_sync = compile_and_load(kSyncSrc, "exec_test.cu");
        g_plain = compile_and_load(kPlainSrc, "exec_plain.cu");
    });
    if (!g_sync || !g_plain) return 1;
    run_test("reductions under several seeds", test_reductions);
    run_test("warp operations", test_warp_ops);
    run_test("seeded block order", test_seeds);
    run_test("3-D thread and block coordinates", test_coords);
    run_test("barrier failures", test_barrier_failures);
    run_test("shuffle failures", test_shuffle_failures);
    run_test("wmma on bf16 tensor cores", test_wmma);
    run_test("mma.sync m16n8k16 and ldmatrix in their documented layouts", test_mma);
    run_test("cp.async lands at its wait_group", test_cp_async);
    run_test("dynamic shared memory", test_smem_failures);
    run_test("faults", test_faults);
    run_test("faults outside kernels", test_foreign_fault);
    run_test("module without barriers", test_plain_module);
    run_test("two threads at once", test_concurrent);
    run_test("images", test_images);
    run_test("source forms", test_source_forms);
    run_test("compile errors, options and headers", test_compile_errors);
    std::string dir = argv[2];
    run_test("every kernel file of the project compiles", [&] { test_project_compiles(dir); });
    run_test("project: rmsnorm_forward, grad_norm_partial", test_project_rmsnorm_grad_norm);
    run_test("project: attention_forward", test_project_attention);
    run_test("project: cross_entropy_forward", test_project_cross_entropy);
    benchmark();
    for (auto& e : g_project) fakecuda::unload_module(e.second);
    fakecuda::unload_module(g_sync);
    fakecuda::unload_module(g_plain);
    if (g_failures) printf("%d check(s) FAILED\n", g_failures);
    else printf("all exec tests passed\n");
    return g_failures ? 1 : 0;
}
