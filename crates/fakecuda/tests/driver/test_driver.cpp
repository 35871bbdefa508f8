// Tests of the fake CUDA driver (libcuda.so) and cuBLAS (libcublas.so): loads both with dlopen,
// as cudarc does, and checks the CUDA behaviour the backend depends on -- contexts, pageable vs
// pinned copies, stream order, events and cuStreamWaitEvent, memory guards and checks, launch
// refusals, the sticky error, and cublasGemmEx against a naive reference.
//   make -C crates/fakecuda test-driver
// Kernels come from the test stub executor (exec_stub.cpp) when libcuda.so was built with it,
// else from the fake NVRTC (libnvrtc.so) compiling kKernelSource.
#include <dlfcn.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "driver_types.h"

// ---- the entry points, declared only for decltype ---------------------------------------------

namespace proto {
extern "C" {
CUresult cuInit(unsigned);
CUresult cuDriverGetVersion(int*);
CUresult cuDeviceGetCount(int*);
CUresult cuDeviceGet(CUdevice*, int);
CUresult cuDeviceGetName(char*, int, CUdevice);
CUresult cuDeviceGetAttribute(int*, int, CUdevice);
CUresult cuDeviceTotalMem_v2(size_t*, CUdevice);
CUresult cuDevicePrimaryCtxRetain(CUcontext*, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuCtxGetCurrent(CUcontext*);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxPushCurrent_v2(CUcontext);
CUresult cuCtxPopCurrent_v2(CUcontext*);
CUresult cuCtxSynchronize();
CUresult cuCtxGetDevice(CUdevice*);
CUresult cuStreamCreate(CUstream*, unsigned);
CUresult cuStreamDestroy_v2(CUstream);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamQuery(CUstream);
CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned);
CUresult cuLaunchHostFunc(CUstream, CUhostFn, void*);
CUresult cuMemGetInfo_v2(size_t*, size_t*);
CUresult cuMemAlloc_v2(CUdeviceptr*, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemsetD8_v2(CUdeviceptr, unsigned char, size_t);
CUresult cuMemsetD8Async(CUdeviceptr, unsigned char, size_t, CUstream);
CUresult cuMemsetD32Async(CUdeviceptr, unsigned, size_t, CUstream);
CUresult cuMemHostAlloc(void**, size_t, unsigned);
CUresult cuMemFreeHost(void*);
CUresult cuMemHostRegister_v2(void*, size_t, unsigned);
CUresult cuMemHostUnregister(void*);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void*, size_t);
CUresult cuMemcpyDtoH_v2(void*, CUdeviceptr, size_t);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void*, size_t, CUstream);
CUresult cuMemcpyDtoHAsync_v2(void*, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult cuEventCreate(CUevent*, unsigned);
CUresult cuEventRecord(CUevent, CUstream);
CUresult cuEventQuery(CUevent);
CUresult cuEventSynchronize(CUevent);
CUresult cuEventElapsedTime(float*, CUevent, CUevent);
CUresult cuEventElapsedTime_v2(float*, CUevent, CUevent);
CUresult cuEventDestroy_v2(CUevent);
CUresult cuModuleLoadData(CUmodule*, const void*);
CUresult cuModuleGetFunction(CUfunction*, CUmodule, const char*);
CUresult cuModuleUnload(CUmodule);
CUresult cuFuncSetAttribute(CUfunction, int, int);
CUresult cuFuncGetAttribute(int*, int, CUfunction);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, CUstream, void**, void**);
CUresult cuGetErrorString(CUresult, const char**);
CUresult cuGetErrorName(CUresult, const char**);
cublasStatus_t cublasCreate_v2(cublasHandle_t*);
cublasStatus_t cublasDestroy_v2(cublasHandle_t);
cublasStatus_t cublasSetStream_v2(cublasHandle_t, cudaStream_t);
cublasStatus_t cublasGetStream_v2(cublasHandle_t, cudaStream_t*);
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t, void*, size_t);
cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t);
const char* cublasGetStatusString(cublasStatus_t);
cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                            const void*, const void*, cudaDataType, int, const void*,
                            cudaDataType, int, const void*, void*, cudaDataType, int,
                            cublasComputeType_t, cublasGemmAlgo_t);
// The fake NVRTC (real-executor mode only).
int nvrtcCreateProgram(void**, const char*, const char*, int, const char* const*,
                       const char* const*);
int nvrtcCompileProgram(void*, int, const char* const*);
int nvrtcGetCUBINSize(void*, size_t*);
int nvrtcGetCUBIN(void*, char*);
int nvrtcGetProgramLogSize(void*, size_t*);
int nvrtcGetProgramLog(void*, char*);
int nvrtcDestroyProgram(void**);
}
}  // namespace proto

#define API(name) decltype(&proto::name) name = nullptr
struct Api {
    API(cuInit); API(cuDriverGetVersion); API(cuDeviceGetCount); API(cuDeviceGet);
    API(cuDeviceGetName); API(cuDeviceGetAttribute); API(cuDeviceTotalMem_v2);
    API(cuDevicePrimaryCtxRetain); API(cuDevicePrimaryCtxRelease_v2); API(cuCtxGetCurrent);
    API(cuCtxSetCurrent); API(cuCtxPushCurrent_v2); API(cuCtxPopCurrent_v2);
    API(cuCtxSynchronize); API(cuCtxGetDevice); API(cuStreamCreate); API(cuStreamDestroy_v2);
    API(cuStreamSynchronize); API(cuStreamQuery); API(cuStreamWaitEvent); API(cuLaunchHostFunc);
    API(cuMemGetInfo_v2); API(cuMemAlloc_v2); API(cuMemFree_v2); API(cuMemsetD8_v2);
    API(cuMemsetD8Async); API(cuMemsetD32Async); API(cuMemHostAlloc); API(cuMemFreeHost);
    API(cuMemHostRegister_v2); API(cuMemHostUnregister);
    API(cuMemcpyHtoD_v2); API(cuMemcpyDtoH_v2); API(cuMemcpyHtoDAsync_v2);
    API(cuMemcpyDtoHAsync_v2); API(cuMemcpyDtoDAsync_v2); API(cuEventCreate); API(cuEventRecord);
    API(cuEventQuery); API(cuEventSynchronize); API(cuEventElapsedTime);
    API(cuEventElapsedTime_v2); API(cuEventDestroy_v2); API(cuModuleLoadData);
    API(cuModuleGetFunction); API(cuModuleUnload); API(cuFuncSetAttribute);
    API(cuFuncGetAttribute); API(cuLaunchKernel); API(cuGetErrorString); API(cuGetErrorName);
    API(cublasCreate_v2); API(cublasDestroy_v2); API(cublasSetStream_v2); API(cublasGetStream_v2);
    API(cublasSetWorkspace_v2); API(cublasSetMathMode); API(cublasGetStatusString);
    API(cublasGemmEx);
    API(nvrtcCreateProgram); API(nvrtcCompileProgram); API(nvrtcGetCUBINSize);
    API(nvrtcGetCUBIN); API(nvrtcGetProgramLogSize); API(nvrtcGetProgramLog);
    API(nvrtcDestroyProgram);
};
#undef API

static Api cu;
static void* g_libcuda = nullptr;

// ---- a tiny test harness -----------------------------------------------------------------------

static int g_checks = 0, g_failures = 0;
static const char* g_test = "";

static void check(bool ok, const char* what, const char* file, int line) {
    ++g_checks;
    if (ok) return;
    ++g_failures;
    fprintf(stderr, "FAILED [%s] %s:%d: %s\n", g_test, file, line, what);
}

#define CHECK(cond) check((cond), #cond, __FILE__, __LINE__)
#define CHECK_RC(call, want)                                                                 \
    do {                                                                                     \
        int rc_ = (call);                                                                    \
        if (rc_ != (want)) fprintf(stderr, "  -> got %d, want %d\n", rc_, (int)(want));      \
        check(rc_ == (want), #call " == " #want, __FILE__, __LINE__);                         \
    } while (0)
#define OK(call) CHECK_RC(call, CUDA_SUCCESS)

static void begin(const char* name) {
    g_test = name;
    fprintf(stderr, "-- %s\n", name);
}

static void* must_dlopen(const char* name) {
    void* h = dlopen(name, RTLD_LAZY | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "cannot dlopen %s: %s\n", name, dlerror());
        exit(2);
    }
    return h;
}

template <class F>
static void load(void* lib, F& f, const char* name, bool required = true) {
    f = (F)dlsym(lib, name);
    if (!f && required) {
        fprintf(stderr, "missing symbol %s\n", name);
        exit(2);
    }
}

#define LOAD(lib, name) load(lib, cu.name, #name)
static void load_all() {
    void* d = g_libcuda = must_dlopen("libcuda.so");
    LOAD(d, cuInit); LOAD(d, cuDriverGetVersion); LOAD(d, cuDeviceGetCount); LOAD(d, cuDeviceGet);
    LOAD(d, cuDeviceGetName); LOAD(d, cuDeviceGetAttribute); LOAD(d, cuDeviceTotalMem_v2);
    LOAD(d, cuDevicePrimaryCtxRetain); LOAD(d, cuDevicePrimaryCtxRelease_v2);
    LOAD(d, cuCtxGetCurrent); LOAD(d, cuCtxSetCurrent); LOAD(d, cuCtxPushCurrent_v2);
    LOAD(d, cuCtxPopCurrent_v2); LOAD(d, cuCtxSynchronize); LOAD(d, cuCtxGetDevice);
    LOAD(d, cuStreamCreate); LOAD(d, cuStreamDestroy_v2); LOAD(d, cuStreamSynchronize);
    LOAD(d, cuStreamQuery); LOAD(d, cuStreamWaitEvent); LOAD(d, cuLaunchHostFunc);
    LOAD(d, cuMemGetInfo_v2); LOAD(d, cuMemAlloc_v2); LOAD(d, cuMemFree_v2);
    LOAD(d, cuMemsetD8_v2); LOAD(d, cuMemsetD8Async); LOAD(d, cuMemsetD32Async);
    LOAD(d, cuMemHostAlloc); LOAD(d, cuMemFreeHost);
    LOAD(d, cuMemHostRegister_v2); LOAD(d, cuMemHostUnregister); LOAD(d, cuMemcpyHtoD_v2);
    LOAD(d, cuMemcpyDtoH_v2); LOAD(d, cuMemcpyHtoDAsync_v2); LOAD(d, cuMemcpyDtoHAsync_v2);
    LOAD(d, cuMemcpyDtoDAsync_v2); LOAD(d, cuEventCreate); LOAD(d, cuEventRecord);
    LOAD(d, cuEventQuery); LOAD(d, cuEventSynchronize); LOAD(d, cuEventElapsedTime);
    LOAD(d, cuEventElapsedTime_v2); LOAD(d, cuEventDestroy_v2); LOAD(d, cuModuleLoadData);
    LOAD(d, cuModuleGetFunction); LOAD(d, cuModuleUnload); LOAD(d, cuFuncSetAttribute);
    LOAD(d, cuFuncGetAttribute); LOAD(d, cuLaunchKernel); LOAD(d, cuGetErrorString);
    LOAD(d, cuGetErrorName);
    void* b = must_dlopen("libcublas.so");
    LOAD(b, cublasCreate_v2); LOAD(b, cublasDestroy_v2); LOAD(b, cublasSetStream_v2);
    LOAD(b, cublasGetStream_v2); LOAD(b, cublasSetWorkspace_v2); LOAD(b, cublasSetMathMode);
    LOAD(b, cublasGetStatusString); LOAD(b, cublasGemmEx);
}
#undef LOAD

// ---- helpers -----------------------------------------------------------------------------------

using Ms = std::chrono::milliseconds;
static void sleep_ms(int ms) { std::this_thread::sleep_for(Ms(ms)); }

// A host function that blocks its stream until opened.
struct Gate {
    std::mutex m;
    std::condition_variable cv;
    bool open = false;
    void release() {
        std::lock_guard<std::mutex> lk(m);
        open = true;
        cv.notify_all();
    }
    static void wait_fn(void* p) {
        Gate* g = (Gate*)p;
        std::unique_lock<std::mutex> lk(g->m);
        g->cv.wait(lk, [&] { return g->open; });
    }
};

// Host functions that record the order in which a stream reached them.
struct Log {
    std::mutex m;
    std::vector<int> items;
    std::deque<std::pair<Log*, int>> args;  // stable storage for the host functions' arguments
    void* arg(int v) {
        std::lock_guard<std::mutex> lk(m);
        args.emplace_back(this, v);
        return &args.back();
    }
    static void append_fn(void* p) {
        auto* a = (std::pair<Log*, int>*)p;
        std::lock_guard<std::mutex> lk(a->first->m);
        a->first->items.push_back(a->second);
    }
    std::vector<int> snapshot() {
        std::lock_guard<std::mutex> lk(m);
        return items;
    }
};

static void sleep_fn(void* ms) { sleep_ms((int)(intptr_t)ms); }
static void set_flag_fn(void* f) { ((std::atomic<int>*)f)->store(1); }

static CUstream new_stream(unsigned flags = CU_STREAM_NON_BLOCKING) {
    CUstream s = nullptr;
    OK(cu.cuStreamCreate(&s, flags));
    return s;
}

static CUevent new_event(unsigned flags = CU_EVENT_DEFAULT) {
    CUevent e = nullptr;
    OK(cu.cuEventCreate(&e, flags));
    return e;
}

static CUdeviceptr dalloc(size_t bytes) {
    CUdeviceptr p = 0;
    OK(cu.cuMemAlloc_v2(&p, bytes));
    return p;
}

static void gate(CUstream s, Gate& g) { OK(cu.cuLaunchHostFunc(s, Gate::wait_fn, &g)); }

static std::vector<float> download(CUdeviceptr p, size_t n) {
    std::vector<float> v(n);
    OK(cu.cuMemcpyDtoH_v2(v.data(), p, n * sizeof(float)));
    return v;
}

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

// Runs `f` in a forked child; true when the child died of SIGSEGV (or SIGBUS).
static bool faults(const std::function<void()>& f) {
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        f();
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFSIGNALED(status) && (WTERMSIG(status) == SIGSEGV || WTERMSIG(status) == SIGBUS);
}

// ---- the test kernels --------------------------------------------------------------------------

static const char* kKernelSource = R"(
extern "C" __global__ void write_value(float* p, float v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}
extern "C" __global__ void fault(float* p, int n) {
    if (blockIdx.x == 0 && threadIdx.x == 0) p[n] = 1.0f;
}
extern "C" __global__ void uses_smem(float* p) {
    extern __shared__ float s[];
    s[threadIdx.x] = 1.0f;
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (unsigned i = 0; i < blockDim.x; ++i) sum += s[i];
        p[0] = sum;
    }
}
)";

// The module image: the stub's name, or the kernels compiled by the fake NVRTC.
static std::vector<char> kernel_image() {
    if (dlsym(g_libcuda, "fakecuda_exec_is_stub")) {
        const char* s = "FAKECUDA-STUB-IMAGE";
        return std::vector<char>(s, s + strlen(s) + 1);
    }
    void* n = must_dlopen("libnvrtc.so");
    load(n, cu.nvrtcCreateProgram, "nvrtcCreateProgram");
    load(n, cu.nvrtcCompileProgram, "nvrtcCompileProgram");
    load(n, cu.nvrtcGetCUBINSize, "nvrtcGetCUBINSize");
    load(n, cu.nvrtcGetCUBIN, "nvrtcGetCUBIN");
    load(n, cu.nvrtcGetProgramLogSize, "nvrtcGetProgramLogSize");
    load(n, cu.nvrtcGetProgramLog, "nvrtcGetProgramLog");
    load(n, cu.nvrtcDestroyProgram, "nvrtcDestroyProgram");
    void* prog = nullptr;
    const char* opts[] = {"--gpu-architecture=sm_90", "--std=c++17"};
    if (cu.nvrtcCreateProgram(&prog, kKernelSource, "test_kernels.cu", 0, nullptr, nullptr) ||
        cu.nvrtcCompileProgram(prog, 2, opts)) {
        size_t len = 0;
        cu.nvrtcGetProgramLogSize(prog, &len);
        std::string log(len, '\0');
        cu.nvrtcGetProgramLog(prog, &log[0]);
        fprintf(stderr, "the fake NVRTC cannot compile the test kernels:\n%s\n", log.c_str());
        exit(2);
    }
    size_t size = 0;
    cu.nvrtcGetCUBINSize(prog, &size);
    std::vector<char> image(size);
    cu.nvrtcGetCUBIN(prog, image.data());
    cu.nvrtcDestroyProgram(&prog);
    return image;
}

struct Kernels {
    CUmodule mod = nullptr;
    CUfunction write_value = nullptr, fault = nullptr, uses_smem = nullptr;
};

static Kernels load_kernels() {
    static std::vector<char> image = kernel_image();
    Kernels k;
    OK(cu.cuModuleLoadData(&k.mod, image.data()));
    OK(cu.cuModuleGetFunction(&k.write_value, k.mod, "write_value"));
    OK(cu.cuModuleGetFunction(&k.fault, k.mod, "fault"));
    OK(cu.cuModuleGetFunction(&k.uses_smem, k.mod, "uses_smem"));
    return k;
}

static CUresult launch_write(CUfunction f, CUdeviceptr p, float v, int n, CUstream s,
                             unsigned block = 128) {
    void* args[] = {&p, &v, &n};
    unsigned grid = (unsigned)((n + block - 1) / block);
    return cu.cuLaunchKernel(f, grid ? grid : 1, 1, 1, block, 1, 1, 0, s, args, nullptr);
}

// ---- driver tests ------------------------------------------------------------------------------

static CUcontext g_ctx = nullptr;

static void test_before_init_and_without_context() {
    begin("before cuInit, then without a current context");
    CUdeviceptr p;
    int count;
    CHECK_RC(cu.cuDeviceGetCount(&count), CUDA_ERROR_NOT_INITIALIZED);
    CHECK_RC(cu.cuMemAlloc_v2(&p, 16), CUDA_ERROR_NOT_INITIALIZED);
    OK(cu.cuInit(0));
    CHECK_RC(cu.cuInit(1), CUDA_ERROR_INVALID_VALUE);
    CUstream s;
    CUevent e;
    CUmodule m;
    CUcontext c = (CUcontext)1;
    OK(cu.cuCtxGetCurrent(&c));
    CHECK(c == nullptr);
    CHECK_RC(cu.cuMemAlloc_v2(&p, 16), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_RC(cu.cuStreamCreate(&s, 0), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_RC(cu.cuEventCreate(&e, 0), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_RC(cu.cuModuleLoadData(&m, "x"), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_RC(cu.cuCtxSynchronize(), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_RC(cu.cuStreamSynchronize(nullptr), CUDA_ERROR_INVALID_CONTEXT);
    float x = 0;
    CHECK_RC(cu.cuMemcpyHtoD_v2(0x1000, &x, 4), CUDA_ERROR_INVALID_CONTEXT);
    void* h;
    CHECK_RC(cu.cuMemHostAlloc(&h, 64, 0), CUDA_ERROR_INVALID_CONTEXT);
}

static void test_device_queries() {
    begin("device queries");
    int v = 0;
    OK(cu.cuDriverGetVersion(&v));
    CHECK(v == 13000);
    OK(cu.cuDeviceGetCount(&v));
    CHECK(v == 2);  // FAKECUDA_DEVICES=2, set by main
    CUdevice d;
    OK(cu.cuDeviceGet(&d, 0));
    CHECK(d == 0);
    CHECK_RC(cu.cuDeviceGet(&d, 2), CUDA_ERROR_INVALID_DEVICE);
    char name[128];
    OK(cu.cuDeviceGetName(name, sizeof name, 0));
    CHECK(strcmp(name, "fakecuda (Horizon's CUDA test double, sm_90)") == 0);
    struct { int attr, want; } attrs[] = {
        {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 9},
        {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0},
        {CU_DEVICE_ATTRIBUTE_WARP_SIZE, 32},
        {CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, 1024},
        {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z, 64},
        {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, 2147483647},
        {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y, 65535},
        {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK, 49152},
        {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, 232448},
        {CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 132},
        {CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, 0},
        {140, 0},
    };
    for (auto& a : attrs) {
        OK(cu.cuDeviceGetAttribute(&v, a.attr, 0));
        CHECK(v == a.want);
    }
    CHECK_RC(cu.cuDeviceGetAttribute(&v, 100000, 0), CUDA_ERROR_INVALID_VALUE);
    size_t total = 0;
    OK(cu.cuDeviceTotalMem_v2(&total, 0));
    CHECK(total == (64u << 20));  // FAKECUDA_MEMORY_BYTES=64M, set by main
    const char* str = nullptr;
    OK(cu.cuGetErrorName(CUDA_ERROR_NOT_READY, &str));
    CHECK(str && strcmp(str, "CUDA_ERROR_NOT_READY") == 0);
    OK(cu.cuGetErrorString(CUDA_ERROR_ILLEGAL_ADDRESS, &str));
    CHECK(str && strstr(str, "illegal memory access"));
    CHECK_RC(cu.cuGetErrorString(12345, &str), CUDA_ERROR_INVALID_VALUE);
}

static void test_contexts() {
    begin("primary contexts, current context, push/pop");
    CUcontext c0 = nullptr, c0b = nullptr, c1 = nullptr, got = nullptr;
    OK(cu.cuDevicePrimaryCtxRetain(&c0, 0));
    OK(cu.cuDevicePrimaryCtxRetain(&c0b, 0));
    CHECK(c0 && c0 == c0b);
    OK(cu.cuDevicePrimaryCtxRetain(&c1, 1));
    CHECK(c1 && c1 != c0);
    OK(cu.cuCtxSetCurrent(c0));
    OK(cu.cuCtxGetCurrent(&got));
    CHECK(got == c0);
    CUdevice d = -1;
    OK(cu.cuCtxGetDevice(&d));
    CHECK(d == 0);
    OK(cu.cuCtxPushCurrent_v2(c1));
    OK(cu.cuCtxGetDevice(&d));
    CHECK(d == 1);
    // Memory is charged per device.
    size_t free0 = 0, free1 = 0, total = 0;
    CUdeviceptr p = dalloc(1 << 20);
    OK(cu.cuMemGetInfo_v2(&free1, &total));
    OK(cu.cuCtxPopCurrent_v2(&got));
    CHECK(got == c1);
    OK(cu.cuMemGetInfo_v2(&free0, &total));
    CHECK(free0 == total && free1 == total - (1 << 20));
    OK(cu.cuCtxPushCurrent_v2(c1));
    OK(cu.cuMemFree_v2(p));
    OK(cu.cuCtxPopCurrent_v2(nullptr));
    OK(cu.cuCtxGetCurrent(&got));
    CHECK(got == c0);
    CHECK_RC(cu.cuCtxSetCurrent((CUcontext)0x1234), CUDA_ERROR_INVALID_CONTEXT);
    OK(cu.cuDevicePrimaryCtxRelease_v2(1));
    CHECK_RC(cu.cuDevicePrimaryCtxRelease_v2(1), CUDA_ERROR_INVALID_CONTEXT);
    OK(cu.cuDevicePrimaryCtxRelease_v2(0));  // c0 stays retained once: the tests' context
    g_ctx = c0;
    // The current context is per thread.
    std::thread([&] {
        CUdeviceptr q;
        CHECK_RC(cu.cuMemAlloc_v2(&q, 16), CUDA_ERROR_INVALID_CONTEXT);
        OK(cu.cuCtxSetCurrent(g_ctx));
        OK(cu.cuMemAlloc_v2(&q, 16));
        OK(cu.cuMemFree_v2(q));
    }).join();
}

static void test_memory_layout_and_guards() {
    begin("allocations: alignment, NaN fill, guard pages, use after free");
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    CUdeviceptr p = dalloc(1000);
    CHECK(p % 256 == 0);
    CHECK((p + 1024) % page == 0);  // ends (rounded to 256) at the upper guard page
    std::vector<float> v = download(p, 250);
    bool all_nan = true;
    for (float x : v) all_nan = all_nan && bits(x) == 0xFFFFFFFFu && std::isnan(x);
    CHECK(all_nan);
    CHECK(faults([&] { (void)*(volatile char*)(p + 1024); }));                // upper guard
    CHECK(faults([&] { (void)*(volatile char*)((p / page) * page - 1); }));  // lower guard
    CHECK(!faults([&] { (void)*(volatile char*)(p + 999); }));
    OK(cu.cuMemFree_v2(p));
    CHECK(faults([&] { (void)*(volatile char*)p; }));  // freed: PROT_NONE
    CHECK_RC(cu.cuMemFree_v2(p), CUDA_ERROR_INVALID_VALUE);  // double free
    CUdeviceptr q = dalloc(4096);
    CHECK_RC(cu.cuMemFree_v2(q + 256), CUDA_ERROR_INVALID_VALUE);  // not the start
    OK(cu.cuMemFree_v2(q));
    CHECK_RC(cu.cuMemAlloc_v2(&q, 0), CUDA_ERROR_INVALID_VALUE);
}

static void test_out_of_memory() {
    begin("FAKECUDA_MEMORY_BYTES and CUDA_ERROR_OUT_OF_MEMORY");
    size_t free_b = 0, total = 0;
    OK(cu.cuMemGetInfo_v2(&free_b, &total));
    CHECK(total == (64u << 20) && free_b == total);
    CUdeviceptr a = dalloc(40 << 20), b = 0;
    OK(cu.cuMemGetInfo_v2(&free_b, &total));
    CHECK(free_b == total - (40u << 20));
    CHECK_RC(cu.cuMemAlloc_v2(&b, 30 << 20), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_RC(cu.cuMemAlloc_v2(&b, (size_t)1 << 62), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cu.cuMemFree_v2(a));
    OK(cu.cuMemAlloc_v2(&b, 30 << 20));
    OK(cu.cuMemFree_v2(b));
}

static void test_copy_checks() {
    begin("copies: range checks against live allocations");
    CUstream s = new_stream();
    CUdeviceptr p = dalloc(1024);
    std::vector<char> host(2048, 1);
    OK(cu.cuMemcpyHtoDAsync_v2(p, host.data(), 1024, s));
    CHECK_RC(cu.cuMemcpyHtoDAsync_v2(p, host.data(), 1025, s), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cu.cuMemcpyHtoDAsync_v2(p + 512, host.data(), 513, s), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cu.cuMemcpyDtoHAsync_v2(host.data(), p - 256, 16, s), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cu.cuMemsetD8Async(p + 1000, 0, 25, s), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cu.cuMemsetD32Async(p + 2, 0, 4, s), CUDA_ERROR_INVALID_VALUE);  // misaligned
    CUdeviceptr q = dalloc(1024);
    OK(cu.cuMemcpyDtoDAsync_v2(q, p, 1024, s));
    CHECK_RC(cu.cuMemcpyDtoDAsync_v2(q, p + 8, 1024, s), CUDA_ERROR_INVALID_VALUE);
    // A device pointer passed as host memory.
    CHECK_RC(cu.cuMemcpyHtoDAsync_v2(p, (const void*)q, 16, s), CUDA_ERROR_INVALID_VALUE);
    // A pinned range overrun.
    void* pinned = nullptr;
    OK(cu.cuMemHostAlloc(&pinned, 4096, 0));
    CHECK_RC(cu.cuMemcpyHtoDAsync_v2(p, (char*)pinned + 4000, 200, s), CUDA_ERROR_INVALID_VALUE);
    OK(cu.cuMemFree_v2(q));
    CHECK_RC(cu.cuMemcpyDtoDAsync_v2(q, p, 16, s), CUDA_ERROR_INVALID_VALUE);  // freed
    OK(cu.cuStreamSynchronize(s));
    OK(cu.cuMemFreeHost(pinned));
    CHECK_RC(cu.cuMemFreeHost(pinned), CUDA_ERROR_INVALID_VALUE);
    OK(cu.cuMemFree_v2(p));
    OK(cu.cuStreamDestroy_v2(s));
}

static void test_host_alloc_bytes() {
    begin("fakecuda_host_alloc_bytes: the bytes asked for, per thread");
    using Count = size_t (*)(int, size_t*);
    auto count = reinterpret_cast<Count>(dlsym(g_libcuda, "fakecuda_host_alloc_bytes"));
    CHECK(count != nullptr);
    if (!count) return;
    size_t n0 = 0, n = 0;
    size_t all0 = count(0, nullptr), mine0 = count(1, &n0);
    void* a = nullptr;
    void* b = nullptr;
    OK(cu.cuMemHostAlloc(&a, 1000, 0));  // not a page: counted as asked, not as mapped
    OK(cu.cuMemHostAlloc(&b, 5000, 0));
    CHECK(count(1, &n) == mine0 + 6000 && n == n0 + 2);
    CHECK(count(0, nullptr) == all0 + 6000);
    size_t other = 1;
    std::thread([&] { other = count(1, nullptr); }).join();
    CHECK(other == 0);  // another thread asked for none of them
    OK(cu.cuMemFreeHost(a));
    CHECK(count(1, nullptr) == mine0 + 5000);
    OK(cu.cuMemFreeHost(b));
    CHECK(count(1, nullptr) == mine0 && count(0, nullptr) == all0);
}

static void test_host_register() {
    begin("cuMemHostRegister: the caller's memory, pinned in place");
    using Count = size_t (*)(int, size_t*);
    using Pageable = size_t (*)(void);
    auto count = reinterpret_cast<Count>(dlsym(g_libcuda, "fakecuda_host_alloc_bytes"));
    auto pageable = reinterpret_cast<Pageable>(dlsym(g_libcuda, "fakecuda_pageable_copies"));
    CHECK(count != nullptr && pageable != nullptr);
    if (!count || !pageable) return;
    const int n = 256;
    CUstream s = new_stream();
    CUdeviceptr d = dalloc(n * 4);
    std::vector<float> host(n + 8, 0.0f);
    float* mine = host.data() + 4;  // not page-aligned: CUDA takes any range
    size_t mine0 = count(1, nullptr), copies0 = pageable();
    OK(cu.cuMemHostRegister_v2(mine, n * 4, 0));
    CHECK(count(1, nullptr) == mine0 + n * 4);
    // Overlapping ranges are refused; cuMemFreeHost does not take a registered pointer.
    CHECK_RC(cu.cuMemHostRegister_v2(host.data(), 32, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    CHECK_RC(cu.cuMemHostRegister_v2(mine + n - 1, 64, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    CHECK_RC(cu.cuMemFreeHost(mine), CUDA_ERROR_INVALID_VALUE);
    // A pinned DtoH: written later, by the stream; no pageable copy counted.
    {
        Gate g;
        gate(s, g);
        OK(cu.cuMemsetD32Async(d, bits(6.0f), n, s));
        OK(cu.cuMemcpyDtoHAsync_v2(mine, d, n * 4, s));
        CHECK(mine[0] == 0.0f);
        g.release();
        OK(cu.cuStreamSynchronize(s));
        CHECK(mine[0] == 6.0f && mine[n - 1] == 6.0f && host[3] == 0.0f && host[n + 4] == 0.0f);
    }
    CHECK(pageable() == copies0);
    // Just before the range: pageable, and counted.
    OK(cu.cuMemcpyDtoHAsync_v2(host.data(), d, 16, s));
    CHECK(pageable() == copies0 + 1);
    OK(cu.cuMemHostUnregister(mine));
    CHECK(count(1, nullptr) == mine0);
    CHECK_RC(cu.cuMemHostUnregister(mine), CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    OK(cu.cuMemcpyDtoHAsync_v2(mine, d, n * 4, s));  // pageable again
    CHECK(pageable() == copies0 + 2);
    OK(cu.cuMemFree_v2(d));
    OK(cu.cuStreamDestroy_v2(s));
}

static void test_pageable_and_pinned_copies() {
    begin("pageable vs pinned host memory");
    const int n = 256;
    CUstream s = new_stream();
    CUdeviceptr d = dalloc(n * 4);
    // Pageable HtoD: staged at the call.
    {
        Gate g;
        std::vector<float> src(n, 1.0f);
        gate(s, g);
        OK(cu.cuMemcpyHtoDAsync_v2(d, src.data(), n * 4, s));
        std::fill(src.begin(), src.end(), 2.0f);
        g.release();
        OK(cu.cuStreamSynchronize(s));
        CHECK(download(d, n) == std::vector<float>(n, 1.0f));
    }
    // Pinned HtoD: read when the stream reaches the copy.
    float* pinned = nullptr;
    OK(cu.cuMemHostAlloc((void**)&pinned, n * 4, 0));
    {
        Gate g;
        std::fill(pinned, pinned + n, 1.0f);
        gate(s, g);
        OK(cu.cuMemcpyHtoDAsync_v2(d, pinned, n * 4, s));
        std::fill(pinned, pinned + n, 3.0f);
        g.release();
        OK(cu.cuStreamSynchronize(s));
        CHECK(download(d, n) == std::vector<float>(n, 3.0f));
    }
    // Pageable DtoH: returns only when done.
    {
        std::vector<float> dst(n, 0.0f);
        auto t0 = std::chrono::steady_clock::now();
        OK(cu.cuLaunchHostFunc(s, sleep_fn, (void*)(intptr_t)50));
        OK(cu.cuMemsetD32Async(d, bits(4.0f), n, s));
        OK(cu.cuMemcpyDtoHAsync_v2(dst.data(), d, n * 4, s));
        CHECK(std::chrono::steady_clock::now() - t0 >= Ms(45));
        CHECK(dst == std::vector<float>(n, 4.0f));
    }
    // Pinned DtoH: written later, by the stream.
    {
        Gate g;
        std::fill(pinned, pinned + n, 0.0f);
        gate(s, g);
        OK(cu.cuMemsetD32Async(d, bits(5.0f), n, s));
        OK(cu.cuMemcpyDtoHAsync_v2(pinned, d, n * 4, s));
        CHECK(pinned[0] == 0.0f && pinned[n - 1] == 0.0f);
        CHECK_RC(cu.cuStreamQuery(s), CUDA_ERROR_NOT_READY);
        g.release();
        OK(cu.cuStreamSynchronize(s));
        CHECK(pinned[0] == 5.0f && pinned[n - 1] == 5.0f);
        OK(cu.cuStreamQuery(s));
    }
    // Synchronous memset and copies.
    OK(cu.cuMemsetD8_v2(d, 0, n * 4));
    CHECK(download(d, n) == std::vector<float>(n, 0.0f));
    OK(cu.cuMemFreeHost(pinned));
    OK(cu.cuMemFree_v2(d));
    OK(cu.cuStreamDestroy_v2(s));
}

static void test_stream_order() {
    begin("stream order, independent streams, destroyed streams drain");
    CUstream a = new_stream(), b = new_stream();
    Log log;
    OK(cu.cuLaunchHostFunc(a, sleep_fn, (void*)(intptr_t)20));
    OK(cu.cuLaunchHostFunc(a, Log::append_fn, log.arg(1)));
    OK(cu.cuLaunchHostFunc(a, Log::append_fn, log.arg(2)));
    OK(cu.cuLaunchHostFunc(b, Log::append_fn, log.arg(10)));
    OK(cu.cuStreamSynchronize(b));
    OK(cu.cuStreamSynchronize(a));
    CHECK((log.snapshot() == std::vector<int>{10, 1, 2}));
    // A gated stream does not hold up another one.
    Gate g;
    std::atomic<int> flag{0};
    gate(a, g);
    OK(cu.cuLaunchHostFunc(b, set_flag_fn, &flag));
    OK(cu.cuStreamSynchronize(b));
    CHECK(flag == 1);
    CHECK_RC(cu.cuStreamQuery(a), CUDA_ERROR_NOT_READY);
    // A destroyed stream still runs its work; its handle is invalid at once.
    std::atomic<int> late{0};
    OK(cu.cuLaunchHostFunc(a, set_flag_fn, &late));
    OK(cu.cuStreamDestroy_v2(a));
    CHECK_RC(cu.cuStreamQuery(a), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cu.cuLaunchHostFunc(a, set_flag_fn, &late), CUDA_ERROR_INVALID_HANDLE);
    CHECK(late == 0);
    g.release();
    OK(cu.cuCtxSynchronize());
    CHECK(late == 1);
    OK(cu.cuStreamDestroy_v2(b));
    CHECK_RC(cu.cuStreamDestroy_v2(nullptr), CUDA_ERROR_INVALID_HANDLE);
}

static void test_legacy_default_stream() {
    begin("the legacy NULL stream and blocking / non-blocking streams");
    CUstream blocking = new_stream(CU_STREAM_DEFAULT), nonblocking = new_stream();
    // NULL-stream work waits for a blocking stream, not for a non-blocking one.
    Gate g1, g2;
    std::atomic<int> f1{0}, f2{0};
    gate(blocking, g1);
    gate(nonblocking, g2);
    OK(cu.cuLaunchHostFunc(nullptr, set_flag_fn, &f1));
    sleep_ms(30);
    CHECK(f1 == 0);
    float x = 1.0f;
    CUdeviceptr d = dalloc(4);
    g1.release();
    OK(cu.cuMemcpyHtoD_v2(d, &x, 4));  // synchronous, on the NULL stream: no wait on nonblocking
    CHECK(f1 == 1);
    OK(cu.cuStreamSynchronize(nullptr));
    g2.release();
    // Blocking streams' later work waits for the NULL stream; non-blocking streams' does not.
    Gate g3;
    std::atomic<int> f3{0}, f4{0};
    gate(nullptr, g3);
    OK(cu.cuLaunchHostFunc(blocking, set_flag_fn, &f3));
    OK(cu.cuLaunchHostFunc(nonblocking, set_flag_fn, &f4));
    OK(cu.cuStreamSynchronize(nonblocking));
    CHECK(f4 == 1);
    sleep_ms(30);
    CHECK(f3 == 0);
    g3.release();
    OK(cu.cuStreamSynchronize(blocking));
    CHECK(f3 == 1);
    OK(cu.cuMemFree_v2(d));
    OK(cu.cuStreamDestroy_v2(blocking));
    OK(cu.cuStreamDestroy_v2(nonblocking));
}

static void test_events() {
    begin("events: record, query, synchronize, elapsed time");
    CUstream s = new_stream();
    CUevent a = new_event(), b = new_event(), never = new_event();
    CUevent notime = new_event(CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC);
    float ms = -1;
    OK(cu.cuEventQuery(never));
    OK(cu.cuEventSynchronize(never));
    CHECK_RC(cu.cuEventElapsedTime(&ms, never, never), CUDA_ERROR_INVALID_HANDLE);
    Gate g;
    gate(s, g);
    OK(cu.cuEventRecord(a, s));
    OK(cu.cuLaunchHostFunc(s, sleep_fn, (void*)(intptr_t)20));
    OK(cu.cuEventRecord(b, s));
    OK(cu.cuEventRecord(notime, s));
    CHECK_RC(cu.cuEventQuery(a), CUDA_ERROR_NOT_READY);
    CHECK_RC(cu.cuEventElapsedTime(&ms, a, b), CUDA_ERROR_NOT_READY);
    g.release();
    OK(cu.cuEventSynchronize(b));
    OK(cu.cuEventQuery(a));
    OK(cu.cuEventQuery(b));
    OK(cu.cuEventElapsedTime(&ms, a, b));
    CHECK(ms >= 19.0f && ms < 2000.0f);
    OK(cu.cuEventElapsedTime_v2(&ms, a, b));
    CHECK(ms >= 19.0f);
    OK(cu.cuEventSynchronize(notime));
    CHECK_RC(cu.cuEventElapsedTime(&ms, a, notime), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cu.cuEventCreate(&a, 64), CUDA_ERROR_INVALID_VALUE);
    // Re-recording: the event is pending again until the new record is reached.
    Gate g2;
    gate(s, g2);
    OK(cu.cuEventRecord(b, s));
    CHECK_RC(cu.cuEventQuery(b), CUDA_ERROR_NOT_READY);
    g2.release();
    OK(cu.cuEventSynchronize(b));
    OK(cu.cuEventQuery(b));
    for (CUevent e : {a, b, never, notime}) OK(cu.cuEventDestroy_v2(e));
    CHECK_RC(cu.cuEventQuery(a), CUDA_ERROR_INVALID_HANDLE);
    OK(cu.cuStreamDestroy_v2(s));
}

static void test_stream_wait_event() {
    begin("cuStreamWaitEvent waits for the record that is the latest at the call");
    CUstream a = new_stream(), b = new_stream(), c = new_stream();
    CUevent e = new_event();
    // Plain wait.
    {
        Gate g;
        std::atomic<int> done{0};
        gate(a, g);
        OK(cu.cuEventRecord(e, a));
        OK(cu.cuStreamWaitEvent(b, e, 0));
        OK(cu.cuLaunchHostFunc(b, set_flag_fn, &done));
        sleep_ms(30);
        CHECK(done == 0);
        g.release();
        OK(cu.cuStreamSynchronize(b));
        CHECK(done == 1);
    }
    // Re-recorded (complete at once) after the wait was enqueued: b still waits for a.
    {
        Gate g;
        std::atomic<int> done{0};
        gate(a, g);
        OK(cu.cuEventRecord(e, a));
        OK(cu.cuStreamWaitEvent(b, e, 0));
        OK(cu.cuLaunchHostFunc(b, set_flag_fn, &done));
        OK(cu.cuEventRecord(e, c));
        OK(cu.cuEventSynchronize(e));  // the latest record (on c) is complete...
        sleep_ms(30);
        CHECK(done == 0);  // ...but b waits for the one on a
        g.release();
        OK(cu.cuStreamSynchronize(b));
        CHECK(done == 1);
    }
    // Completed record, then re-recorded on a gated stream before the wait: b waits for it.
    {
        Gate g;
        std::atomic<int> done{0};
        OK(cu.cuEventRecord(e, c));
        OK(cu.cuStreamSynchronize(c));
        gate(a, g);
        OK(cu.cuEventRecord(e, a));
        OK(cu.cuStreamWaitEvent(b, e, 0));
        OK(cu.cuLaunchHostFunc(b, set_flag_fn, &done));
        sleep_ms(30);
        CHECK(done == 0);
        g.release();
        OK(cu.cuStreamSynchronize(b));
        CHECK(done == 1);
    }
    // Never recorded: no wait. Destroyed after the wait: the wait still holds.
    {
        CUevent fresh = new_event();
        std::atomic<int> done{0};
        OK(cu.cuStreamWaitEvent(b, fresh, 0));
        OK(cu.cuLaunchHostFunc(b, set_flag_fn, &done));
        OK(cu.cuStreamSynchronize(b));
        CHECK(done == 1);
        Gate g;
        std::atomic<int> done2{0};
        gate(a, g);
        OK(cu.cuEventRecord(fresh, a));
        OK(cu.cuStreamWaitEvent(b, fresh, 0));
        OK(cu.cuEventDestroy_v2(fresh));
        OK(cu.cuLaunchHostFunc(b, set_flag_fn, &done2));
        sleep_ms(30);
        CHECK(done2 == 0);
        g.release();
        OK(cu.cuStreamSynchronize(b));
        CHECK(done2 == 1);
    }
    CHECK_RC(cu.cuStreamWaitEvent(b, e, 7), CUDA_ERROR_INVALID_VALUE);
    OK(cu.cuEventDestroy_v2(e));
    for (CUstream s : {a, b, c}) OK(cu.cuStreamDestroy_v2(s));
}

// Two streams hand a token back and forth through two re-recorded events: the log must
// alternate A0 B0 A1 B1 ... whatever the jitter.
static void test_ping_pong() {
    begin("ping-pong: two streams waiting on each other's re-recorded events");
    CUstream a = new_stream(), b = new_stream();
    CUevent ea = new_event(CU_EVENT_DISABLE_TIMING), eb = new_event(CU_EVENT_DISABLE_TIMING);
    Log log;
    const int rounds = 100;
    Gate g;
    gate(a, g);  // everything is enqueued before anything runs
    for (int i = 0; i < rounds; ++i) {
        OK(cu.cuLaunchHostFunc(a, Log::append_fn, log.arg(2 * i)));
        OK(cu.cuEventRecord(ea, a));
        OK(cu.cuStreamWaitEvent(b, ea, 0));
        OK(cu.cuLaunchHostFunc(b, Log::append_fn, log.arg(2 * i + 1)));
        OK(cu.cuEventRecord(eb, b));
        OK(cu.cuStreamWaitEvent(a, eb, 0));
    }
    g.release();
    OK(cu.cuCtxSynchronize());
    std::vector<int> want(2 * rounds);
    for (int i = 0; i < 2 * rounds; ++i) want[i] = i;
    CHECK(log.snapshot() == want);
    OK(cu.cuEventDestroy_v2(ea));
    OK(cu.cuEventDestroy_v2(eb));
    OK(cu.cuStreamDestroy_v2(a));
    OK(cu.cuStreamDestroy_v2(b));
}

static void test_launches(const Kernels& k) {
    begin("launches: arguments copied at the call, refusals");
    CUstream s = new_stream();
    const int n = 1000;
    CUdeviceptr p = dalloc(n * 4);
    // The arguments are read at the call, not when the stream runs the kernel.
    {
        Gate g;
        gate(s, g);
        float v = 1.5f;
        void* args[] = {&p, &v, (void*)&n};
        OK(cu.cuLaunchKernel(k.write_value, 8, 1, 1, 128, 1, 1, 0, s, args, nullptr));
        v = 9.0f;
        g.release();
        OK(cu.cuStreamSynchronize(s));
        CHECK(download(p, n) == std::vector<float>(n, 1.5f));
    }
    OK(launch_write(k.write_value, p + 400, 2.0f, 0, s));  // interior pointer
    OK(launch_write(k.write_value, p + n * 4, 2.0f, 0, s));  // one past the end
    CHECK_RC(launch_write(k.write_value, p + n * 4 + 256, 2.0f, 1, s), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(launch_write(k.write_value, 0, 2.0f, 1, s), CUDA_ERROR_INVALID_VALUE);
    void* pinned = nullptr;
    OK(cu.cuMemHostAlloc(&pinned, 4096, 0));
    CHECK_RC(launch_write(k.write_value, (CUdeviceptr)pinned, 2.0f, 1, s),
             CUDA_ERROR_INVALID_VALUE);
    OK(cu.cuMemFreeHost(pinned));
    CUdeviceptr freed = dalloc(64);
    OK(cu.cuMemFree_v2(freed));
    CHECK_RC(launch_write(k.write_value, freed, 2.0f, 16, s), CUDA_ERROR_INVALID_VALUE);
    // Grid, block and shared memory limits; `extra`.
    float v = 0;
    int cnt = 1;
    void* args[] = {&p, &v, &cnt};
    auto launch = [&](unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                      unsigned bz) {
        return cu.cuLaunchKernel(k.write_value, gx, gy, gz, bx, by, bz, 0, s, args, nullptr);
    };
    CHECK_RC(launch(1, 1, 1, 1025, 1, 1), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(launch(1, 1, 1, 32, 32, 2), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(launch(1, 1, 1, 1, 1, 65), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(launch(0, 1, 1, 32, 1, 1), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(launch(1, 65536, 1, 32, 1, 1), CUDA_ERROR_INVALID_VALUE);
    OK(launch(1, 2, 1, 32, 32, 1));
    CHECK_RC(launch(2147483647u + 1u, 1, 1, 32, 1, 1), CUDA_ERROR_INVALID_VALUE);
    void* extra[] = {nullptr};
    CHECK_RC(cu.cuLaunchKernel(k.write_value, 1, 1, 1, 1, 1, 1, 0, s, args, extra),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cu.cuLaunchKernel(k.write_value, 1, 1, 1, 1, 1, 1, 0, s, nullptr, nullptr),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cu.cuLaunchKernel(k.write_value, 1, 1, 1, 1, 1, 1, 0, (CUstream)0x99, args, nullptr),
             CUDA_ERROR_INVALID_HANDLE);
    void* sargs[] = {&p};
    int limit = 0;
    OK(cu.cuFuncGetAttribute(&limit, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, k.uses_smem));
    CHECK(limit == 49152);
    CHECK_RC(cu.cuLaunchKernel(k.uses_smem, 1, 1, 1, 64, 1, 1, 49153, s, sargs, nullptr),
             CUDA_ERROR_INVALID_VALUE);
    OK(cu.cuFuncSetAttribute(k.uses_smem, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 60000));
    CHECK_RC(cu.cuFuncSetAttribute(k.uses_smem, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                   232449), CUDA_ERROR_INVALID_VALUE);
    OK(cu.cuLaunchKernel(k.uses_smem, 1, 1, 1, 64, 1, 1, 60000, s, sargs, nullptr));
    OK(cu.cuStreamSynchronize(s));
    CHECK(download(p, 1)[0] == 64.0f);
    // The limit is per function.
    OK(cu.cuFuncGetAttribute(&limit, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                             k.write_value));
    CHECK(limit == 49152);
    OK(cu.cuMemFree_v2(p));
    OK(cu.cuStreamDestroy_v2(s));
}

static void test_modules() {
    begin("modules: bad image, missing function");
    CUmodule m = nullptr;
    std::vector<char> junk(4096, 'x');  // big enough for any header the loader reads
    junk.back() = 0;
    CHECK_RC(cu.cuModuleLoadData(&m, junk.data()), CUDA_ERROR_INVALID_IMAGE);
    Kernels k = load_kernels();
    CUfunction f = nullptr, again = nullptr;
    CHECK_RC(cu.cuModuleGetFunction(&f, k.mod, "no_such_kernel"), CUDA_ERROR_NOT_FOUND);
    OK(cu.cuModuleGetFunction(&again, k.mod, "write_value"));
    CHECK(again == k.write_value);
    OK(cu.cuModuleUnload(k.mod));
    CUdeviceptr p = dalloc(64);
    CHECK_RC(launch_write(k.write_value, p, 1.0f, 1, nullptr), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cu.cuModuleUnload(k.mod), CUDA_ERROR_INVALID_HANDLE);
    OK(cu.cuMemFree_v2(p));
}

// Drops the tests' context to refcount 0 (destroying it, which clears a sticky error) and makes a
// new one current.
static void reset_context() {
    OK(cu.cuDevicePrimaryCtxRelease_v2(0));
    OK(cu.cuDevicePrimaryCtxRetain(&g_ctx, 0));
    OK(cu.cuCtxSetCurrent(g_ctx));
}

static void test_sticky_error() {
    begin("a failing kernel leaves a sticky error; a context reset clears it");
    Kernels k = load_kernels();
    CUstream s = new_stream();
    CUdeviceptr p = dalloc(4096);
    CUevent e = new_event();
    int n = 1024;
    void* args[] = {&p, &n};
    OK(cu.cuLaunchKernel(k.fault, 1, 1, 1, 32, 1, 1, 0, s, args, nullptr));
    int rc = cu.cuStreamSynchronize(s);
    CHECK(rc == CUDA_ERROR_ILLEGAL_ADDRESS || rc == CUDA_ERROR_LAUNCH_FAILED);
    CUdeviceptr q;
    CHECK_RC(cu.cuMemAlloc_v2(&q, 16), rc);
    CHECK_RC(cu.cuCtxSynchronize(), rc);
    CHECK_RC(cu.cuEventRecord(e, s), rc);
    CHECK_RC(cu.cuStreamSynchronize(nullptr), rc);
    CHECK_RC(launch_write(k.write_value, p, 1.0f, 1, s), rc);
    float x = 0;
    CHECK_RC(cu.cuMemcpyDtoH_v2(&x, p, 4), rc);
    reset_context();
    OK(cu.cuMemAlloc_v2(&q, 16));
    OK(cu.cuCtxSynchronize());
    OK(cu.cuMemFree_v2(q));
    CHECK_RC(cu.cuStreamSynchronize(s), CUDA_ERROR_INVALID_HANDLE);  // went with the context
}

static void test_overrun_detected_at_free() {
    begin("a write past an allocation's end (inside its alignment slack) is caught at free");
    CUdeviceptr p = dalloc(100);
    ((unsigned char*)p)[100] = 0;  // device memory is host memory here
    CHECK_RC(cu.cuMemFree_v2(p), CUDA_ERROR_ILLEGAL_ADDRESS);
    CHECK_RC(cu.cuCtxSynchronize(), CUDA_ERROR_ILLEGAL_ADDRESS);
    reset_context();
    OK(cu.cuCtxSynchronize());
}

// ---- cuBLAS tests ------------------------------------------------------------------------------

static uint16_t to_bf16(float f) {
    uint32_t u = bits(f);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

struct Matrix {
    std::vector<uint16_t> host;
    CUdeviceptr dev = 0;
};

static Matrix bf16_matrix(size_t n, std::mt19937& rng) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    Matrix m;
    m.host.resize(n);
    for (auto& x : m.host) x = to_bf16(u(rng));
    m.dev = dalloc(std::max<size_t>(n, 1) * 2);
    OK(cu.cuMemcpyHtoD_v2(m.dev, m.host.data(), n * 2));
    return m;
}

struct GemmCase {
    int ta, tb, m, n, k, pad;
    float alpha, beta;
};

// C = alpha op(A) op(B) + beta C against a double-precision loop over the same bf16 values.
static void check_gemm_case(cublasHandle_t h, const GemmCase& t, std::mt19937& rng) {
    int ra = t.ta ? t.k : t.m, ca = t.ta ? t.m : t.k;
    int rb = t.tb ? t.n : t.k, cb = t.tb ? t.k : t.n;
    int lda = std::max(1, ra) + t.pad, ldb = std::max(1, rb) + t.pad, ldc = std::max(1, t.m) + t.pad;
    Matrix a = bf16_matrix((size_t)lda * ca, rng), b = bf16_matrix((size_t)ldb * cb, rng);
    std::vector<float> c((size_t)ldc * t.n);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (auto& x : c) x = t.beta == 0.0f ? NAN : u(rng);
    CUdeviceptr dc = dalloc(c.size() * 4);
    OK(cu.cuMemcpyHtoD_v2(dc, c.data(), c.size() * 4));
    CHECK_RC(cu.cublasGemmEx(h, t.ta, t.tb, t.m, t.n, t.k, &t.alpha, (void*)a.dev, CUDA_R_16BF,
                             lda, (void*)b.dev, CUDA_R_16BF, ldb, &t.beta, (void*)dc, CUDA_R_32F,
                             ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), CUBLAS_STATUS_SUCCESS);
    // The synchronous copy runs on the legacy stream, which does not wait for the handle's
    // non-blocking stream: synchronize first (a test that forgot this raced, as on a GPU).
    OK(cu.cuCtxSynchronize());
    std::vector<float> got = download(dc, c.size());
    double worst = 0;
    bool finite = true;
    for (int j = 0; j < t.n; ++j) {
        for (int i = 0; i < t.m; ++i) {
            double sum = 0, mag = 0;
            for (int p = 0; p < t.k; ++p) {
                double x = from_bf16(t.ta ? a.host[p + (size_t)i * lda] : a.host[i + (size_t)p * lda]);
                double y = from_bf16(t.tb ? b.host[j + (size_t)p * ldb] : b.host[p + (size_t)j * ldb]);
                sum += x * y;
                mag += std::fabs(x * y);
            }
            double want = t.alpha * sum + (t.beta == 0.0f ? 0.0 : t.beta * c[i + (size_t)j * ldc]);
            double g = got[i + (size_t)j * ldc];
            finite = finite && std::isfinite(g);
            worst = std::max(worst, std::fabs(g - want) / (1e-6 + mag + std::fabs(want)));
        }
        for (int i = t.m; i < ldc; ++i)  // padding rows are untouched
            finite = finite && bits(got[i + (size_t)j * ldc]) == bits(c[i + (size_t)j * ldc]);
    }
    if (!(finite && worst < 1e-5))
        fprintf(stderr, "  gemm %c%c m %d n %d k %d pad %d alpha %g beta %g: worst %g finite %d\n",
                t.ta ? 'T' : 'N', t.tb ? 'T' : 'N', t.m, t.n, t.k, t.pad, t.alpha, t.beta, worst,
                finite);
    CHECK(finite && worst < 1e-5);
    OK(cu.cuMemFree_v2(a.dev));
    OK(cu.cuMemFree_v2(b.dev));
    OK(cu.cuMemFree_v2(dc));
}

static void test_gemm_values(cublasHandle_t h) {
    begin("cublasGemmEx against a naive reference (N/T, beta 0 / 1, padding)");
    std::mt19937 rng(42);
    const int shapes[][3] = {{1, 1, 1}, {37, 19, 53}, {64, 33, 128}, {8, 5, 3}, {6, 7, 0}};
    for (auto& sh : shapes)
        for (int ta = 0; ta < 2; ++ta)
            for (int tb = 0; tb < 2; ++tb)
                for (float beta : {0.0f, 1.0f})
                    for (int pad : {0, 3})
                        check_gemm_case(h, {ta, tb, sh[0], sh[1], sh[2], pad, 0.5f, beta}, rng);
}

// The three products of matmul.rs, against row-major definitions.
static void test_gemm_matmul_shapes(cublasHandle_t h) {
    begin("cublasGemmEx: matmul.rs's forward, dinp and dweight products");
    const int N = 24, IC = 40, OC = 56;
    std::mt19937 rng(7);
    Matrix w = bf16_matrix(OC * IC, rng), x = bf16_matrix(N * IC, rng), dy = bf16_matrix(N * OC, rng);
    CUdeviceptr out = dalloc(N * OC * 4), dinp = dalloc(N * IC * 4), dw = dalloc(OC * IC * 4);
    OK(cu.cuMemsetD8_v2(dw, 0, OC * IC * 4));
    float one = 1.0f, zero = 0.0f;
    auto gemm = [&](int ta, int tb, int m, int n, int k, CUdeviceptr a, int lda, CUdeviceptr b,
                    int ldb, float beta, CUdeviceptr c, int ldc) {
        CHECK_RC(cu.cublasGemmEx(h, ta, tb, m, n, k, &one, (void*)a, CUDA_R_16BF, lda, (void*)b,
                                 CUDA_R_16BF, ldb, beta == 0 ? &zero : &one, (void*)c, CUDA_R_32F,
                                 ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 CUBLAS_STATUS_SUCCESS);
    };
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, IC, w.dev, IC, x.dev, IC, 0, out, OC);
    gemm(CUBLAS_OP_N, CUBLAS_OP_N, IC, N, OC, w.dev, IC, dy.dev, OC, 0, dinp, IC);
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, IC, OC, N, x.dev, IC, dy.dev, OC, 1, dw, IC);
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, IC, OC, N, x.dev, IC, dy.dev, OC, 1, dw, IC);  // accumulates
    auto W = [&](int o, int i) { return (double)from_bf16(w.host[o * IC + i]); };
    auto X = [&](int r, int i) { return (double)from_bf16(x.host[r * IC + i]); };
    auto DY = [&](int r, int o) { return (double)from_bf16(dy.host[r * OC + o]); };
    OK(cu.cuCtxSynchronize());
    std::vector<float> o = download(out, N * OC), di = download(dinp, N * IC), dwv = download(dw, OC * IC);
    double worst = 0;
    for (int r = 0; r < N; ++r)
        for (int oc = 0; oc < OC; ++oc) {
            double s = 0;
            for (int i = 0; i < IC; ++i) s += X(r, i) * W(oc, i);
            worst = std::max(worst, std::fabs(o[r * OC + oc] - s));
        }
    for (int r = 0; r < N; ++r)
        for (int i = 0; i < IC; ++i) {
            double s = 0;
            for (int oc = 0; oc < OC; ++oc) s += DY(r, oc) * W(oc, i);
            worst = std::max(worst, std::fabs(di[r * IC + i] - s));
        }
    for (int oc = 0; oc < OC; ++oc)
        for (int i = 0; i < IC; ++i) {
            double s = 0;
            for (int r = 0; r < N; ++r) s += DY(r, oc) * X(r, i);
            worst = std::max(worst, std::fabs(dwv[oc * IC + i] - 2 * s));
        }
    CHECK(worst < 1e-4);
    for (CUdeviceptr p : {w.dev, x.dev, dy.dev, out, dinp, dw}) OK(cu.cuMemFree_v2(p));
}

static void test_gemm_stream_order_and_refusals(cublasHandle_t h, CUstream s) {
    begin("cublasGemmEx: stream order, workspace, refusals");
    std::mt19937 rng(3);
    const int m = 16, n = 8, k = 32;
    Matrix a = bf16_matrix(m * k, rng), b = bf16_matrix(k * n, rng);
    CUdeviceptr c = dalloc(m * n * 4);
    float one = 1.0f, zero = 0.0f;
    auto gemm = [&](int ta, int tb, int mm, int nn, int kk, CUdeviceptr pa, int at, int lda,
                    CUdeviceptr pb, int ldb, const void* beta, CUdeviceptr pc, int ct, int ldc,
                    int compute) {
        return cu.cublasGemmEx(h, ta, tb, mm, nn, kk, &one, (void*)pa, at, lda, (void*)pb, at, ldb,
                               beta, (void*)pc, ct, ldc, compute, CUBLAS_GEMM_DEFAULT);
    };
    auto good = [&] {
        return gemm(CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, a.dev, CUDA_R_16BF, m, b.dev, k, &zero, c,
                    CUDA_R_32F, m, CUBLAS_COMPUTE_32F);
    };
    // In stream order: nothing happens while the stream is gated; C is all NaN (fresh memory).
    Gate g;
    gate(s, g);
    CHECK_RC(good(), CUBLAS_STATUS_SUCCESS);
    sleep_ms(20);
    CHECK(std::isnan(((float*)c)[0]));
    g.release();
    OK(cu.cuStreamSynchronize(s));
    CHECK(std::isfinite(((float*)c)[0]));
    // Refusals.
    CHECK_RC(gemm(CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, a.dev, CUDA_R_32F, m, b.dev, k, &zero, c,
                  CUDA_R_32F, m, CUBLAS_COMPUTE_32F), CUBLAS_STATUS_NOT_SUPPORTED);
    CHECK_RC(gemm(CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, a.dev, CUDA_R_16BF, m, b.dev, k, &zero, c,
                  CUDA_R_16BF, m, CUBLAS_COMPUTE_32F), CUBLAS_STATUS_NOT_SUPPORTED);
    CHECK_RC(gemm(CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, a.dev, CUDA_R_16BF, m, b.dev, k, &zero, c,
                  CUDA_R_32F, m, CUBLAS_COMPUTE_32F_FAST_TF32), CUBLAS_STATUS_NOT_SUPPORTED);
    CHECK_RC(gemm(CUBLAS_OP_C, CUBLAS_OP_N, m, n, k, a.dev, CUDA_R_16BF, k, b.dev, k, &zero, c,
                  CUDA_R_32F, m, CUBLAS_COMPUTE_32F), CUBLAS_STATUS_NOT_SUPPORTED);
    CHECK_RC(gemm(9, CUBLAS_OP_N, m, n, k, a.dev, CUDA_R_16BF, m, b.dev, k, &zero, c, CUDA_R_32F,
                  m, CUBLAS_COMPUTE_32F), CUBLAS_STATUS_INVALID_VALUE);
    CHECK_RC(gemm(CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, a.dev, CUDA_R_16BF, m - 1, b.dev, k, &zero, c,
                  CUDA_R_32F, m, CUBLAS_COMPUTE_32F), CUBLAS_STATUS_INVALID_VALUE);  // lda
    CHECK_RC(gemm(CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, a.dev, CUDA_R_16BF, m, b.dev, k, &zero, c,
                  CUDA_R_32F, m, CUBLAS_COMPUTE_32F), CUBLAS_STATUS_INVALID_VALUE);  // lda < k
    CHECK_RC(gemm(CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, a.dev, CUDA_R_16BF, m, b.dev, k, &zero, c,
                  CUDA_R_32F, m - 1, CUBLAS_COMPUTE_32F), CUBLAS_STATUS_INVALID_VALUE);  // ldc
    CHECK_RC(gemm(CUBLAS_OP_N, CUBLAS_OP_N, m, n, k + 1, a.dev, CUDA_R_16BF, m, b.dev, k + 1,
                  &zero, c, CUDA_R_32F, m, CUBLAS_COMPUTE_32F),
             CUBLAS_STATUS_INVALID_VALUE);  // A and B run past their allocations
    CHECK_RC(gemm(CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, a.dev, CUDA_R_16BF, m, b.dev, k, (void*)c, c,
                  CUDA_R_32F, m, CUBLAS_COMPUTE_32F), CUBLAS_STATUS_INVALID_VALUE);  // device beta
    CHECK_RC(gemm(CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, a.dev, CUDA_R_16BF, m, b.dev, k, nullptr, c,
                  CUDA_R_32F, m, CUBLAS_COMPUTE_32F), CUBLAS_STATUS_INVALID_VALUE);
    CHECK_RC(gemm(CUBLAS_OP_N, CUBLAS_OP_N, -1, n, k, a.dev, CUDA_R_16BF, m, b.dev, k, &zero, c,
                  CUDA_R_32F, m, CUBLAS_COMPUTE_32F), CUBLAS_STATUS_INVALID_VALUE);
    CHECK_RC(gemm(CUBLAS_OP_N, CUBLAS_OP_N, 0, n, k, 0, CUDA_R_16BF, m, 0, k, &zero, 0, CUDA_R_32F,
                  m, CUBLAS_COMPUTE_32F), CUBLAS_STATUS_SUCCESS);  // empty: nothing to check
    CHECK_RC(cu.cublasGemmEx(nullptr, 0, 0, m, n, k, &one, (void*)a.dev, CUDA_R_16BF, m,
                             (void*)b.dev, CUDA_R_16BF, k, &zero, (void*)c, CUDA_R_32F, m,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
             CUBLAS_STATUS_NOT_INITIALIZED);
    // The workspace: 256-byte aligned, inside a live allocation, re-checked at each GEMM.
    CUdeviceptr ws = dalloc(1 << 16);
    CHECK_RC(cu.cublasSetWorkspace_v2(h, (void*)(ws + 8), 1024), CUBLAS_STATUS_INVALID_VALUE);
    CHECK_RC(cu.cublasSetWorkspace_v2(h, (void*)ws, 1 << 17), CUBLAS_STATUS_INVALID_VALUE);
    CHECK_RC(cu.cublasSetWorkspace_v2(h, (void*)ws, 1 << 16), CUBLAS_STATUS_SUCCESS);
    CHECK_RC(good(), CUBLAS_STATUS_SUCCESS);
    OK(cu.cuMemFree_v2(ws));
    CHECK_RC(good(), CUBLAS_STATUS_INVALID_VALUE);  // the workspace was freed under the handle
    CHECK_RC(cu.cublasSetStream_v2(h, s), CUBLAS_STATUS_SUCCESS);  // resets the workspace
    CHECK_RC(good(), CUBLAS_STATUS_SUCCESS);
    cudaStream_t got = nullptr;
    CHECK_RC(cu.cublasGetStream_v2(h, &got), CUBLAS_STATUS_SUCCESS);
    CHECK(got == s);
    CHECK_RC(cu.cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), CUBLAS_STATUS_SUCCESS);
    CHECK(strstr(cu.cublasGetStatusString(CUBLAS_STATUS_NOT_SUPPORTED), "not supported"));
    OK(cu.cuMemFree_v2(c));
    CHECK_RC(good(), CUBLAS_STATUS_INVALID_VALUE);  // C freed
    OK(cu.cuStreamSynchronize(s));
    OK(cu.cuMemFree_v2(a.dev));
    OK(cu.cuMemFree_v2(b.dev));
}

static void test_gemm_speed(cublasHandle_t h, CUstream s) {
    begin("cublasGemmEx speed (informative)");
    std::mt19937 rng(5);
    const int m = 512, n = 512, k = 512;
    Matrix a = bf16_matrix(m * k, rng), b = bf16_matrix(k * n, rng);
    CUdeviceptr c = dalloc(m * n * 4);
    float one = 1.0f, zero = 0.0f;
    auto t0 = std::chrono::steady_clock::now();
    for (int rep = 0; rep < 3; ++rep)
        CHECK_RC(cu.cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, (void*)a.dev,
                                 CUDA_R_16BF, k, (void*)b.dev, CUDA_R_16BF, k, &zero, (void*)c,
                                 CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 CUBLAS_STATUS_SUCCESS);
    OK(cu.cuStreamSynchronize(s));
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fprintf(stderr, "   3 x %dx%dx%d GEMM: %.3f s, %.2f GFLOP/s\n", m, n, k, secs,
            3 * 2.0 * m * n * k / secs / 1e9);
    for (CUdeviceptr p : {a.dev, b.dev, c}) OK(cu.cuMemFree_v2(p));
}

static void test_cublas() {
    cublasHandle_t h = nullptr;
    CHECK_RC(cu.cublasCreate_v2(&h), CUBLAS_STATUS_SUCCESS);
    CUstream s = new_stream();
    CHECK_RC(cu.cublasSetStream_v2(h, s), CUBLAS_STATUS_SUCCESS);
    test_gemm_values(h);
    test_gemm_matmul_shapes(h);
    test_gemm_stream_order_and_refusals(h, s);
    test_gemm_speed(h, s);
    CHECK_RC(cu.cublasSetStream_v2(h, (CUstream)0x77), CUBLAS_STATUS_INVALID_VALUE);
    CHECK_RC(cu.cublasDestroy_v2(h), CUBLAS_STATUS_SUCCESS);
    CHECK_RC(cu.cublasDestroy_v2(h), CUBLAS_STATUS_NOT_INITIALIZED);
    OK(cu.cuStreamDestroy_v2(s));
}

int main() {
    setenv("FAKECUDA_DEVICES", "2", 1);
    setenv("FAKECUDA_MEMORY_BYTES", "64M", 1);
    load_all();
    fprintf(stderr, "fakecuda driver tests (FAKECUDA_JITTER_US=%s, FAKECUDA_SEED=%s, %s executor)\n",
            getenv("FAKECUDA_JITTER_US") ? getenv("FAKECUDA_JITTER_US") : "0",
            getenv("FAKECUDA_SEED") ? getenv("FAKECUDA_SEED") : "0",
            dlsym(g_libcuda, "fakecuda_exec_is_stub") ? "stub" : "real");
    test_before_init_and_without_context();
    test_device_queries();
    test_contexts();
    test_memory_layout_and_guards();
    test_out_of_memory();
    test_copy_checks();
    test_pageable_and_pinned_copies();
    test_host_alloc_bytes();
    test_host_register();
    test_stream_order();
    test_legacy_default_stream();
    test_events();
    test_stream_wait_event();
    test_ping_pong();
    test_modules();
    Kernels k = load_kernels();
    test_launches(k);
    test_cublas();
    OK(cu.cuModuleUnload(k.mod));
    test_sticky_error();
    test_overrun_detected_at_free();
    // Leave streams alive at exit: the process must still exit cleanly.
    CUstream left = new_stream();
    OK(cu.cuLaunchHostFunc(left, sleep_fn, (void*)(intptr_t)10));
    fprintf(stderr, "%s: %d checks, %d failed\n", g_failures ? "FAILED" : "ok", g_checks,
            g_failures);
    return g_failures ? 1 : 0;
}
