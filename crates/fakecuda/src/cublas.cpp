// The fake cuBLAS (libcublas.so): the handle calls cudarc makes and cublasGemmEx with bf16 A and
// B, fp32 C and fp32 accumulation -- what Horizon's matmul.rs runs -- computed on the CPU in
// stream order on the fake driver's streams. It links nothing: the driver's extra entry points
// (driver_api.h) are found at run time in the libcuda.so that cudarc loaded first.
//
// Checks what a GPU would punish: leading dimensions, every matrix's full extent inside one live
// device allocation, host scalars (the pointer mode is host), a workspace inside a live
// allocation and 256-byte aligned. Anything outside the supported subset is refused with
// CUBLAS_STATUS_NOT_SUPPORTED or CUBLAS_STATUS_INVALID_VALUE and a "fakecuda: ..." line on
// stderr.
#include <dlfcn.h>

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "complain.h"
#include "driver_api.h"
#include "driver_types.h"

#define CUBLASAPI extern "C" __attribute__((visibility("default")))

namespace {

using fakecuda::complain;

// ---- the driver's entry points -----------------------------------------------------------------

struct Driver {
    decltype(&fakecuda_enqueue) enqueue = nullptr;
    decltype(&fakecuda_check_device_range) check_range = nullptr;
    decltype(&fakecuda_device_pointer_kind) pointer_kind = nullptr;
    decltype(&fakecuda_check_stream) check_stream = nullptr;
    decltype(&fakecuda_synchronize_owner) synchronize_owner = nullptr;
};

void* lookup(void* lib, const char* name) {
    void* p = dlsym(RTLD_DEFAULT, name);
    return p ? p : (lib ? dlsym(lib, name) : nullptr);
}

bool resolve(Driver& d) {
    // cudarc opened libcuda.so (RTLD_LOCAL) before any cuBLAS call; find that copy.
    void* lib = dlopen("libcuda.so", RTLD_LAZY | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcuda.so", RTLD_LAZY);
    d.enqueue = (decltype(d.enqueue))lookup(lib, "fakecuda_enqueue");
    d.check_range = (decltype(d.check_range))lookup(lib, "fakecuda_check_device_range");
    d.pointer_kind = (decltype(d.pointer_kind))lookup(lib, "fakecuda_device_pointer_kind");
    d.check_stream = (decltype(d.check_stream))lookup(lib, "fakecuda_check_stream");
    d.synchronize_owner =
        (decltype(d.synchronize_owner))lookup(lib, "fakecuda_synchronize_owner");
    return d.enqueue && d.check_range && d.pointer_kind && d.check_stream && d.synchronize_owner;
}

// The driver's entry points, or null (with a message) when libcuda.so is not the fake one.
const Driver* driver() {
    static Driver* d = nullptr;
    static std::once_flag once;
    std::call_once(once, [] {
        Driver* found = new Driver;
        if (resolve(*found)) {
            d = found;
        } else {
            complain("libcublas.so: the fake driver's entry points (fakecuda_enqueue, ...) are "
                     "not loaded: load fakecuda's libcuda.so first (LD_LIBRARY_PATH)");
            delete found;
        }
    });
    return d;
}

// ---- handles -----------------------------------------------------------------------------------

struct Handle {
    CUstream stream = nullptr;
    void* workspace = nullptr;  // null: cuBLAS's default (the fake needs none)
    size_t workspace_bytes = 0;
    int math = CUBLAS_DEFAULT_MATH;
    int pointer_mode = CUBLAS_POINTER_MODE_HOST;
};

std::mutex& handles_mu() {
    static std::mutex* m = new std::mutex;
    return *m;
}

std::unordered_set<Handle*>& handles() {
    static auto* s = new std::unordered_set<Handle*>;
    return *s;
}

Handle* find_handle(cublasHandle_t h) {
    std::lock_guard<std::mutex> lk(handles_mu());
    Handle* p = (Handle*)h;
    return handles().count(p) ? p : nullptr;
}

// ---- the GEMM ----------------------------------------------------------------------------------

// One cublasGemmEx, everything copied at the call: C = alpha op(A) op(B) + beta C, column-major.
struct Gemm {
    bool ta = false, tb = false;  // op = transpose
    int m = 0, n = 0, k = 0;
    float alpha = 1, beta = 0;
    const uint16_t* a = nullptr;
    const uint16_t* b = nullptr;
    float* c = nullptr;
    long long lda = 0, ldb = 0, ldc = 0;
};

typedef float v4 __attribute__((vector_size(16)));

float bf16(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// Packs the n x k bf16 matrix X (column-major with leading dimension ld, or stored transposed,
// so that X(r, p) = x[p + r * ld]) as `padded` rows of kp floats, row r = X(r, 0..k), zero-padded.
// op(A) is X = A (m x k); op(B) is packed by columns, X = op(B)^T (n x k).
std::vector<v4> pack(const uint16_t* x, long long ld, bool transposed, int n, int k, int padded,
                     int kp) {
    std::vector<v4> out((size_t)padded * kp / 4, v4{0, 0, 0, 0});
    float* dst = (float*)out.data();
    for (int r = 0; r < n; ++r)
        for (int p = 0; p < k; ++p)
            dst[(size_t)r * kp + p] = bf16(transposed ? x[p + r * ld] : x[r + p * ld]);
    return out;
}

float hsum(v4 x) { return (x[0] + x[1]) + (x[2] + x[3]); }

void store(const Gemm& g, int i, int j, float acc) {
    if (i >= g.m || j >= g.n) return;
    float& c = g.c[i + j * g.ldc];
    c = g.beta == 0.0f ? g.alpha * acc : g.alpha * acc + g.beta * c;  // beta 0: C is not read
}

// 2 rows of op(A) times 4 columns of op(B): 8 dot products of kp/4 vectors.
void micro_2x4(const Gemm& g, const v4* a, const v4* b, int kv, int i, int j) {
    v4 acc[2][4] = {};
    const v4* a0 = a + (size_t)i * kv;
    const v4* a1 = a0 + kv;
    const v4* b0 = b + (size_t)j * kv;
    for (int p = 0; p < kv; ++p) {
        v4 x0 = a0[p], x1 = a1[p];
        for (int c = 0; c < 4; ++c) {
            v4 y = b0[(size_t)c * kv + p];
            acc[0][c] += x0 * y;
            acc[1][c] += x1 * y;
        }
    }
    for (int r = 0; r < 2; ++r)
        for (int c = 0; c < 4; ++c) store(g, i + r, j + c, hsum(acc[r][c]));
}

void run_gemm(const Gemm& g) {
    int kp = std::max(4, (g.k + 3) / 4 * 4), kv = kp / 4;  // k = 0: one zero vector
    int rows = (g.m + 1) / 2 * 2, cols = (g.n + 3) / 4 * 4;
    std::vector<v4> a = pack(g.a, g.lda, g.ta, g.m, g.k, rows, kp);   // op(A)(i, p)
    std::vector<v4> b = pack(g.b, g.ldb, !g.tb, g.n, g.k, cols, kp);  // op(B)(p, j), by column j
    const int kRowBlock = 64;  // rows of packed A kept in cache while all columns pass
    for (int i0 = 0; i0 < rows; i0 += kRowBlock)
        for (int j = 0; j < cols; j += 4)
            for (int i = i0; i < std::min(rows, i0 + kRowBlock); i += 2)
                micro_2x4(g, a.data(), b.data(), kv, i, j);
}

void gemm_task(void* arg, int failed) {
    std::unique_ptr<Gemm> g((Gemm*)arg);
    if (!failed) run_gemm(*g);
}

// ---- cublasGemmEx's checks ---------------------------------------------------------------------

const char* op_name(int op) {
    switch (op) {
        case CUBLAS_OP_N: return "N";
        case CUBLAS_OP_T: return "T";
        case CUBLAS_OP_C: return "C";
        case CUBLAS_OP_CONJG: return "CONJG";
        default: return "?";
    }
}

cublasStatus_t check_ops(int ta, int tb) {
    for (int op : {ta, tb}) {
        if (op == CUBLAS_OP_N || op == CUBLAS_OP_T) continue;
        bool known = op == CUBLAS_OP_C || op == CUBLAS_OP_CONJG;
        complain("cublasGemmEx: operation %s (%d) is not supported by fakecuda (only N and T)",
                 op_name(op), op);
        return known ? CUBLAS_STATUS_NOT_SUPPORTED : CUBLAS_STATUS_INVALID_VALUE;
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t check_types(int at, int bt, int ct, int compute) {
    if (at == CUDA_R_16BF && bt == CUDA_R_16BF && ct == CUDA_R_32F && compute == CUBLAS_COMPUTE_32F)
        return CUBLAS_STATUS_SUCCESS;
    complain("cublasGemmEx: types A %d, B %d, C %d, compute %d are not supported by fakecuda "
             "(only A, B CUDA_R_16BF (14), C CUDA_R_32F (0), CUBLAS_COMPUTE_32F (68))",
             at, bt, ct, compute);
    return CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t check_ld(const char* what, long long ld, long long rows) {
    if (ld >= std::max(1LL, rows)) return CUBLAS_STATUS_SUCCESS;
    complain("cublasGemmEx: %s = %lld is less than max(1, %lld)", what, ld, rows);
    return CUBLAS_STATUS_INVALID_VALUE;
}

// A matrix of `rows` x `cols` elements of `elem` bytes, leading dimension ld, must lie in one
// live allocation.
cublasStatus_t check_matrix(const char* what, const void* p, long long rows, long long cols,
                            long long ld, size_t elem) {
    if (rows == 0 || cols == 0) return CUBLAS_STATUS_SUCCESS;
    size_t bytes = (size_t)((cols - 1) * ld + rows) * elem;
    char label[96];
    snprintf(label, sizeof label, "cublasGemmEx: matrix %s (%lld x %lld, ld %lld)", what, rows,
             cols, ld);
    return driver()->check_range(p, bytes, label) ? CUBLAS_STATUS_INVALID_VALUE
                                                  : CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t check_scalar(const char* what, const void* p) {
    if (!p) {
        complain("cublasGemmEx: %s is null", what);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (driver()->pointer_kind(p)) {
        complain("cublasGemmEx: %s (%p) is device memory, but the pointer mode is host", what, p);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t check_workspace(const Handle& h, const char* what) {
    if (!h.workspace) return CUBLAS_STATUS_SUCCESS;
    if ((uintptr_t)h.workspace % 256) {
        complain("%s: the workspace %p is not 256-byte aligned", what, h.workspace);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    char label[96];
    snprintf(label, sizeof label, "%s: the handle's workspace", what);
    return driver()->check_range(h.workspace, h.workspace_bytes, label)
               ? CUBLAS_STATUS_INVALID_VALUE
               : CUBLAS_STATUS_SUCCESS;
}

// All checks on a GEMM whose sizes are positive; fills `g` from the arguments.
cublasStatus_t check_gemm(const Handle& h, Gemm& g, const void* alpha, const void* beta) {
    long long ra = g.ta ? g.k : g.m, ca = g.ta ? g.m : g.k;  // A as stored
    long long rb = g.tb ? g.n : g.k, cb = g.tb ? g.k : g.n;  // B as stored
    cublasStatus_t s;
    if ((s = check_ld("lda", g.lda, ra)) || (s = check_ld("ldb", g.ldb, rb)) ||
        (s = check_ld("ldc", g.ldc, g.m)))
        return s;
    if ((s = check_scalar("alpha", alpha)) || (s = check_scalar("beta", beta))) return s;
    if (g.k > 0 && ((s = check_matrix("A", g.a, ra, ca, g.lda, 2)) ||
                    (s = check_matrix("B", g.b, rb, cb, g.ldb, 2))))
        return s;
    if ((s = check_matrix("C", g.c, g.m, g.n, g.ldc, 4))) return s;
    if ((s = check_workspace(h, "cublasGemmEx"))) return s;
    g.alpha = *(const float*)alpha;
    g.beta = *(const float*)beta;
    return CUBLAS_STATUS_SUCCESS;
}

const char* status_name(int s) {
    switch (s) {
        case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
        case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
        case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
        case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
        case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
        case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
        case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
        case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
        case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
        case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
        default: return "CUBLAS_STATUS_UNKNOWN";
    }
}

const char* status_string(int s) {
    switch (s) {
        case CUBLAS_STATUS_SUCCESS: return "the operation completed successfully";
        case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
        case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
        case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
        case CUBLAS_STATUS_ARCH_MISMATCH: return "an absent device architectural feature is required";
        case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory space failed";
        case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
        case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
        case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
        case CUBLAS_STATUS_LICENSE_ERROR: return "error detected trying to check the license";
        default: return "unknown error";
    }
}

}  // namespace

// ==== exported ==================================================================================

CUBLASAPI cublasStatus_t cublasCreate_v2(cublasHandle_t* out) {
    if (!out) return CUBLAS_STATUS_INVALID_VALUE;
    if (!driver()) return CUBLAS_STATUS_NOT_INITIALIZED;
    Handle* h = new Handle;
    std::lock_guard<std::mutex> lk(handles_mu());
    handles().insert(h);
    *out = (cublasHandle_t)h;
    return CUBLAS_STATUS_SUCCESS;
}

// As cuBLAS documents, destroying a handle synchronizes (its stream's context).
CUBLASAPI cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
    Handle* h = find_handle(handle);
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    driver()->synchronize_owner(h->stream);
    std::lock_guard<std::mutex> lk(handles_mu());
    handles().erase(h);
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

// Also resets the workspace to cuBLAS's default, as cublasSetStream does.
CUBLASAPI cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
    Handle* h = find_handle(handle);
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    CUresult e = driver()->check_stream(stream);
    if (e) {
        complain("cublasSetStream_v2: stream %p is not usable (CUDA error %d)", (void*)stream, e);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    h->stream = stream;
    h->workspace = nullptr;
    h->workspace_bytes = 0;
    return CUBLAS_STATUS_SUCCESS;
}

CUBLASAPI cublasStatus_t cublasGetStream_v2(cublasHandle_t handle, cudaStream_t* stream) {
    Handle* h = find_handle(handle);
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!stream) return CUBLAS_STATUS_INVALID_VALUE;
    *stream = h->stream;
    return CUBLAS_STATUS_SUCCESS;
}

CUBLASAPI cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace,
                                               size_t bytes) {
    Handle* h = find_handle(handle);
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    Handle next = *h;
    next.workspace = bytes ? workspace : nullptr;
    next.workspace_bytes = workspace ? bytes : 0;
    cublasStatus_t s = check_workspace(next, "cublasSetWorkspace_v2");
    if (s) return s;
    *h = next;
    return CUBLAS_STATUS_SUCCESS;
}

CUBLASAPI cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
    Handle* h = find_handle(handle);
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    int base = mode & ~CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
    if (base < 0 || (base > CUBLAS_FP32_EMULATED_BF16X9_MATH &&
                     base != CUBLAS_FP64_EMULATED_FIXEDPOINT_MATH))
        return CUBLAS_STATUS_INVALID_VALUE;
    h->math = mode;  // recorded; the fake computes in plain fp32 whatever the mode
    return CUBLAS_STATUS_SUCCESS;
}

CUBLASAPI cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t* mode) {
    Handle* h = find_handle(handle);
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
    *mode = h->math;
    return CUBLAS_STATUS_SUCCESS;
}

CUBLASAPI cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t mode) {
    Handle* h = find_handle(handle);
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (mode == CUBLAS_POINTER_MODE_HOST) return CUBLAS_STATUS_SUCCESS;
    complain("cublasSetPointerMode_v2: only CUBLAS_POINTER_MODE_HOST is supported by fakecuda");
    return mode == CUBLAS_POINTER_MODE_DEVICE ? CUBLAS_STATUS_NOT_SUPPORTED
                                              : CUBLAS_STATUS_INVALID_VALUE;
}

CUBLASAPI cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t handle,
                                                 cublasPointerMode_t* mode) {
    Handle* h = find_handle(handle);
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
    *mode = h->pointer_mode;
    return CUBLAS_STATUS_SUCCESS;
}

CUBLASAPI const char* cublasGetStatusName(cublasStatus_t status) { return status_name(status); }

CUBLASAPI const char* cublasGetStatusString(cublasStatus_t status) {
    return status_string(status);
}

CUBLASAPI cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                                      cublasOperation_t transb, int m, int n, int k,
                                      const void* alpha, const void* A, cudaDataType Atype,
                                      int lda, const void* B, cudaDataType Btype, int ldb,
                                      const void* beta, void* C, cudaDataType Ctype, int ldc,
                                      cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
    (void)algo;  // every algorithm is the same loop here
    Handle* h = find_handle(handle);
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (m < 0 || n < 0 || k < 0) {
        complain("cublasGemmEx: negative size m %d, n %d, k %d", m, n, k);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    cublasStatus_t s;
    if ((s = check_ops(transa, transb)) || (s = check_types(Atype, Btype, Ctype, computeType)))
        return s;
    if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    auto g = std::make_unique<Gemm>();
    g->ta = transa == CUBLAS_OP_T;
    g->tb = transb == CUBLAS_OP_T;
    g->m = m, g->n = n, g->k = k;
    g->a = (const uint16_t*)A, g->b = (const uint16_t*)B, g->c = (float*)C;
    g->lda = lda, g->ldb = ldb, g->ldc = ldc;
    if ((s = check_gemm(*h, *g, alpha, beta))) return s;
    CUresult e = driver()->enqueue(h->stream, gemm_task, g.get());
    if (e) {
        complain("cublasGemmEx: cannot enqueue on stream %p (CUDA error %d)", (void*)h->stream, e);
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    g.release();  // gemm_task owns it now
    return CUBLAS_STATUS_SUCCESS;
}
