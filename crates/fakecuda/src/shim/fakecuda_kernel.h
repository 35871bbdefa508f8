// The header the fake NVRTC (src/nvrtc.cpp) puts in front of every kernel source before it
// compiles the source as C++ with g++: it gives CUDA's keywords, built-in variables, intrinsics,
// barriers, shuffles and atomics a meaning on the CPU. It is embedded in libnvrtc.so at build
// time (the Makefile turns it into a string), so it needs no install step.
//
// Two parts:
//  * the module ABI (namespace fakecuda_abi): what a compiled module and the executor
//    (src/exec.cpp, in libcuda.so) agree on. exec.cpp and nvrtc.cpp include this header with
//    FAKECUDA_ABI_ONLY defined and see only this part.
//  * the kernel side: everything a .cu file may use.
//
// How a kernel reads threadIdx: the module has a thread_local pointer `fakecuda::cur` to the
// running CUDA thread's ThreadState; the executor learns its address through the exported
// fakecuda_module_tls() at the start of each launch and rewrites it at every fiber switch. So
// `threadIdx.x` is one TLS lookup (cached by the compiler within a function) and two loads.
//
// Barriers and warp collectives call back into the executor through the Runtime table that the
// executor hands to fakecuda_module_bind() when it loads the module. Each call passes its call
// site: __LINE__ (for messages) and __COUNTER__ (a unique id per call site, the fake "PC").

#ifndef FAKECUDA_ABI_H_
#define FAKECUDA_ABI_H_
#include <stddef.h>
#include <stdint.h>

namespace fakecuda_abi {

// Bumped whenever anything in this namespace changes; images and modules carry it.
constexpr unsigned kAbiVersion = 1;

struct U3 {
    unsigned x, y, z;
};

// The executor's view of one CUDA thread, as the kernel reads it.
struct ThreadState {
    U3 thread_idx, block_idx, block_dim, grid_dim;
    void* dyn_smem;  // this block's dynamic shared memory
    void* exec;      // the executor's own per-thread record (a fiber, or null)
};

// Warp collective operations (Runtime::warp's `op`).
enum WarpOp : int { kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll, kSyncWarp };
// Block barrier flavours (Runtime::barrier's `op`).
enum BarrierOp : int { kBarSync, kBarCount, kBarAnd, kBarOr };

// The executor's entry points, handed to the module at load time.
struct Runtime {
    unsigned abi;
    // __syncthreads and friends; returns the count / and / or of `pred` over the block.
    int (*barrier)(const ThreadState* ts, int line, int site, int op, int pred);
    // A warp collective; `value` holds the caller's bits, the result the bits it receives.
    uint64_t (*warp)(const ThreadState* ts, int line, int site, int op, unsigned mask,
                     uint64_t value, int arg, int width);
    // Aborts the launch (assert, __trap); does not return.
    void (*trap)(const ThreadState* ts, int code, const char* what, int line);
};

// One `extern "C" __global__` function of a module.
struct KernelDesc {
    const char* name;
    unsigned nparams;
    const size_t* sizes;
    const size_t* aligns;
    const unsigned char* is_ptr;
    void (*thunk)(void* const* params);  // calls the kernel with *(T_i*)params[i]
};

// Module flags (fakecuda_module_flags): the source uses no barrier or warp collective, so the
// executor may run its threads as plain calls, without fibers.
constexpr unsigned kModuleNoSync = 1;

// What every module exports (extern "C", checked by load_module):
//   unsigned fakecuda_module_abi(void);
//   unsigned fakecuda_module_flags(void);
//   void fakecuda_module_bind(const Runtime*);
//   const ThreadState** fakecuda_module_tls(void);  // the calling OS thread's `cur`
//   const KernelDesc* fakecuda_module_kernels(unsigned* count);

}  // namespace fakecuda_abi
#endif  // FAKECUDA_ABI_H_

#if !defined(FAKECUDA_ABI_ONLY) && !defined(FAKECUDA_KERNEL_H_)
#define FAKECUDA_KERNEL_H_

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <type_traits>
#include <utility>

#define FAKECUDA_EXPORT extern "C" __attribute__((visibility("default")))

// ---- Keywords --------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __grid_constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __cudart_builtin__
// Static shared memory: one copy per OS thread. All fibers of a block run on one OS thread, so
// they share it; two streams' workers running the same kernel do not. (`extern __shared__`
// arrays are rewritten by the fake NVRTC into pointers to the launch's dynamic buffer.)
#define __shared__ static thread_local
// __restrict__ is a g++ keyword already.
#define __CUDACC__ 1
#define __CUDACC_RTC__ 1
#define __FAKECUDA__ 1

namespace fakecuda {
static thread_local const ::fakecuda_abi::ThreadState* cur;
static const ::fakecuda_abi::Runtime* rt;
inline void* dyn_smem() { return cur->dyn_smem; }
}  // namespace fakecuda

// ---- Built-in variables and types ------------------------------------------------------------
typedef ::fakecuda_abi::U3 uint3;
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};
#define threadIdx (::fakecuda::cur->thread_idx)
#define blockIdx (::fakecuda::cur->block_idx)
#define blockDim (::fakecuda::cur->block_dim)
#define gridDim (::fakecuda::cur->grid_dim)
constexpr int warpSize = 32;

#define FAKECUDA_VEC2(T, N, A) \
    struct __attribute__((aligned(A))) N##2 { T x, y; }; \
    inline N##2 make_##N##2(T x, T y) { return N##2{x, y}; }
#define FAKECUDA_VEC3(T, N) \
    struct N##3 { T x, y, z; }; \
    inline N##3 make_##N##3(T x, T y, T z) { return N##3{x, y, z}; }
#define FAKECUDA_VEC4(T, N, A) \
    struct __attribute__((aligned(A))) N##4 { T x, y, z, w; }; \
    inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4{x, y, z, w}; }
FAKECUDA_VEC2(float, float, 8)
FAKECUDA_VEC3(float, float)
FAKECUDA_VEC4(float, float, 16)
FAKECUDA_VEC2(double, double, 16)
FAKECUDA_VEC2(int, int, 8)
FAKECUDA_VEC3(int, int)
FAKECUDA_VEC4(int, int, 16)
FAKECUDA_VEC2(unsigned, uint, 8)
FAKECUDA_VEC4(unsigned, uint, 16)
FAKECUDA_VEC2(unsigned short, ushort, 4)
FAKECUDA_VEC4(unsigned short, ushort, 8)
FAKECUDA_VEC4(unsigned char, uchar, 4)
FAKECUDA_VEC2(long long, longlong, 16)
inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return uint3{x, y, z}; }
#undef FAKECUDA_VEC2
#undef FAKECUDA_VEC3
#undef FAKECUDA_VEC4

// ---- Barriers and warp collectives -----------------------------------------------------------
namespace fakecuda {

// A compiler barrier: memory written before a __syncthreads must really be in memory, and be
// read again after it (shared arrays are static thread_locals the compiler could cache).
#define FAKECUDA_FENCE() asm volatile("" ::: "memory")

inline int barrier(int line, int site, int op, int pred) {
    FAKECUDA_FENCE();
    int r = rt->barrier(cur, line, site, op, pred);
    FAKECUDA_FENCE();
    return r;
}

template <class T>
inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                  "warp shuffles move values of at most 8 bytes");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}

template <class T>
inline T from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}

template <class T>
inline T shfl(int line, int site, int op, unsigned mask, T v, int arg, int width = 32) {
    return from_bits<T>(rt->warp(cur, line, site, op, mask, to_bits(v), arg, width));
}

inline uint64_t warp_vote(int line, int site, int op, unsigned mask, int pred) {
    FAKECUDA_FENCE();
    uint64_t r = rt->warp(cur, line, site, op, mask, pred != 0, 0, 32);
    FAKECUDA_FENCE();
    return r;
}

// __syncwarp(mask = all): the macro builds one of these at the call site and calls it with the
// optional mask (a portable way to have an optional macro argument).
struct SyncWarp {
    int line, site;
    void operator()(unsigned mask = 0xffffffffu) const {
        warp_vote(line, site, ::fakecuda_abi::kSyncWarp, mask, 0);
    }
};

[[noreturn]] inline void trap(int code, const char* what, int line) {
    rt->trap(cur, code, what, line);
    __builtin_unreachable();
}

}  // namespace fakecuda

#define __syncthreads() ((void)::fakecuda::barrier(__LINE__, __COUNTER__, ::fakecuda_abi::kBarSync, 0))
#define __syncthreads_count(p) ::fakecuda::barrier(__LINE__, __COUNTER__, ::fakecuda_abi::kBarCount, (p))
#define __syncthreads_and(p) ::fakecuda::barrier(__LINE__, __COUNTER__, ::fakecuda_abi::kBarAnd, (p))
#define __syncthreads_or(p) ::fakecuda::barrier(__LINE__, __COUNTER__, ::fakecuda_abi::kBarOr, (p))
#define __shfl_sync(...) ::fakecuda::shfl(__LINE__, __COUNTER__, ::fakecuda_abi::kShflIdx, __VA_ARGS__)
#define __shfl_up_sync(...) ::fakecuda::shfl(__LINE__, __COUNTER__, ::fakecuda_abi::kShflUp, __VA_ARGS__)
#define __shfl_down_sync(...) ::fakecuda::shfl(__LINE__, __COUNTER__, ::fakecuda_abi::kShflDown, __VA_ARGS__)
#define __shfl_xor_sync(...) ::fakecuda::shfl(__LINE__, __COUNTER__, ::fakecuda_abi::kShflXor, __VA_ARGS__)
#define __ballot_sync(m, p) ((unsigned)::fakecuda::warp_vote(__LINE__, __COUNTER__, ::fakecuda_abi::kBallot, (m), (p)))
#define __any_sync(m, p) ((int)::fakecuda::warp_vote(__LINE__, __COUNTER__, ::fakecuda_abi::kAny, (m), (p)))
#define __all_sync(m, p) ((int)::fakecuda::warp_vote(__LINE__, __COUNTER__, ::fakecuda_abi::kAll, (m), (p)))
#define __syncwarp(...) (::fakecuda::SyncWarp{__LINE__, __COUNTER__}(__VA_ARGS__))
#define __trap() ::fakecuda::trap(719, "__trap() called", __LINE__)
#define __brkpt() ::fakecuda::trap(719, "__brkpt() called", __LINE__)
#undef assert
#define assert(e) ((e) ? (void)0 : ::fakecuda::trap(710, "assertion failed: " #e, __LINE__))

#define __threadfence() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define __threadfence_block() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define __threadfence_system() __atomic_thread_fence(__ATOMIC_SEQ_CST)
inline void __nanosleep(unsigned) {}

// ---- Reinterpretation and conversions --------------------------------------------------------
namespace fakecuda {
template <class To, class From>
inline To bit_cast(From f) {
    static_assert(sizeof(To) == sizeof(From), "bit_cast between different sizes");
    To t;
    memcpy(&t, &f, sizeof(To));
    return t;
}
}  // namespace fakecuda
inline float __int_as_float(int x) { return ::fakecuda::bit_cast<float>(x); }
inline int __float_as_int(float x) { return ::fakecuda::bit_cast<int>(x); }
inline unsigned __float_as_uint(float x) { return ::fakecuda::bit_cast<unsigned>(x); }
inline float __uint_as_float(unsigned x) { return ::fakecuda::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return ::fakecuda::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return ::fakecuda::bit_cast<double>(x); }
inline int __double2hiint(double x) { return (int)(__double_as_longlong(x) >> 32); }
inline int __double2loint(double x) { return (int)__double_as_longlong(x); }
inline double __hiloint2double(int hi, int lo) {
    return __longlong_as_double((long long)(((unsigned long long)(unsigned)hi << 32) | (unsigned)lo));
}
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline int __float2int_rz(float x) { return (int)x; }
inline int __float2int_rd(float x) { return (int)floorf(x); }
inline int __float2int_ru(float x) { return (int)ceilf(x); }
inline unsigned __float2uint_rn(float x) { return (unsigned)nearbyintf(x); }
inline unsigned __float2uint_rz(float x) { return (unsigned)x; }
inline long long __float2ll_rn(float x) { return (long long)nearbyintf(x); }
inline long long __float2ll_rz(float x) { return (long long)x; }
inline float __int2float_rn(int x) { return (float)x; }
inline float __uint2float_rn(unsigned x) { return (float)x; }
inline float __ll2float_rn(long long x) { return (float)x; }
inline float __double2float_rn(double x) { return (float)x; }
inline int __double2int_rn(double x) { return (int)nearbyint(x); }
inline int __double2int_rz(double x) { return (int)x; }

// ---- Math ------------------------------------------------------------------------------------
// The standard float functions (expf, logf, sqrtf, tanhf, fmaxf, ...) come from <math.h>; the
// fast-math intrinsics below are the accurate functions (results may differ from a GPU's in the
// last bits, as they do between GPU generations).
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { sincosf(x, s, c); }
inline float __tanhf(float x) { return tanhf(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __fdiv_rn(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fsub_rn(float x, float y) { return x - y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fmaf_rn(float x, float y, float z) { return fmaf(x, y, z); }
inline double __dadd_rn(double x, double y) { return x + y; }
inline double __dmul_rn(double x, double y) { return x * y; }
inline double __fma_rn(double x, double y, double z) { return fma(x, y, z); }
inline float __saturatef(float x) { return x != x ? 0.0f : fminf(fmaxf(x, 0.0f), 1.0f); }

// min/max for every pair of arithmetic types, with the usual conversions (floating-point pairs
// behave as fmin/fmax, as CUDA's do).
namespace fakecuda {
template <class A, class B>
using MinMaxT = std::enable_if_t<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value,
                                 std::common_type_t<A, B>>;
}  // namespace fakecuda
template <class A, class B>
inline ::fakecuda::MinMaxT<A, B> min(A a, B b) {
    typedef ::fakecuda::MinMaxT<A, B> C;
    if constexpr (std::is_floating_point<C>::value) return fmin((C)a, (C)b);
    else return (C)a < (C)b ? (C)a : (C)b;
}
template <class A, class B>
inline ::fakecuda::MinMaxT<A, B> max(A a, B b) {
    typedef ::fakecuda::MinMaxT<A, B> C;
    if constexpr (std::is_floating_point<C>::value) return fmax((C)a, (C)b);
    else return (C)a > (C)b ? (C)a : (C)b;
}
inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long llmin(long long a, long long b) { return a < b ? a : b; }
inline long long llmax(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long ullmin(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long ullmax(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

// ---- Integer intrinsics ----------------------------------------------------------------------
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    return __builtin_bswap32(x);
}
inline int __mul24(int x, int y) { return (int)((long long)((x << 8) >> 8) * ((y << 8) >> 8)); }
inline unsigned __umul24(unsigned x, unsigned y) { return (x & 0xffffffu) * (y & 0xffffffu); }
inline int __mulhi(int x, int y) { return (int)(((long long)x * y) >> 32); }
inline unsigned __umulhi(unsigned x, unsigned y) { return (unsigned)(((unsigned long long)x * y) >> 32); }
inline long long __mul64hi(long long x, long long y) { return (long long)(((__int128)x * y) >> 64); }
inline unsigned long long __umul64hi(unsigned long long x, unsigned long long y) {
    return (unsigned long long)(((unsigned __int128)x * y) >> 64);
}

// ---- Cached loads and stores -----------------------------------------------------------------
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// ---- Atomics ---------------------------------------------------------------------------------
// Real atomics (two streams' workers may run kernels on the same memory at once).
namespace fakecuda {
template <class T, class F>
inline T atomic_update(T* p, F f) {  // CAS loop: *p = f(*p), returns the old value
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(p, &old, f(old), true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
template <class T, class U, class F>
inline T atomic_update_float(T* p, F f) {  // the same on the bits U of a float type T
    U* q = reinterpret_cast<U*>(p);
    U old = __atomic_load_n(q, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(q, &old, bit_cast<U>(f(bit_cast<T>(old))), true,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return bit_cast<T>(old);
}
}  // namespace fakecuda
#define FAKECUDA_ATOMIC_INT(T) \
    inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); } \
    inline T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); } \
    inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); } \
    inline T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_RELAXED); } \
    inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); } \
    inline T atomicXor(T* p, T v) { return __atomic_fetch_xor(p, v, __ATOMIC_RELAXED); } \
    inline T atomicMin(T* p, T v) { return ::fakecuda::atomic_update(p, [v](T o) { return o < v ? o : v; }); } \
    inline T atomicMax(T* p, T v) { return ::fakecuda::atomic_update(p, [v](T o) { return o > v ? o : v; }); } \
    inline T atomicCAS(T* p, T cmp, T v) { \
        __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED); \
        return cmp; \
    }
FAKECUDA_ATOMIC_INT(int)
FAKECUDA_ATOMIC_INT(unsigned)
FAKECUDA_ATOMIC_INT(long long)
FAKECUDA_ATOMIC_INT(unsigned long long)
#undef FAKECUDA_ATOMIC_INT
inline float atomicAdd(float* p, float v) {
    return ::fakecuda::atomic_update_float<float, unsigned>(p, [v](float o) { return o + v; });
}
inline double atomicAdd(double* p, double v) {
    return ::fakecuda::atomic_update_float<double, unsigned long long>(p, [v](double o) { return o + v; });
}
inline float atomicExch(float* p, float v) {
    return __int_as_float(__atomic_exchange_n(reinterpret_cast<int*>(p), __float_as_int(v), __ATOMIC_RELAXED));
}
inline unsigned atomicInc(unsigned* p, unsigned m) {
    return ::fakecuda::atomic_update(p, [m](unsigned o) { return o >= m ? 0u : o + 1; });
}
inline unsigned atomicDec(unsigned* p, unsigned m) {
    return ::fakecuda::atomic_update(p, [m](unsigned o) { return (o == 0 || o > m) ? m : o - 1; });
}
#define atomicAdd_block atomicAdd
#define atomicAdd_system atomicAdd
#define atomicMax_block atomicMax
#define atomicMin_block atomicMin
#define atomicCAS_block atomicCAS
#define atomicExch_block atomicExch

// ---- Tensor-core products: PTX wmma, m16n16k16, bf16 x bf16 -> fp32 --------------------------
// NVRTC ships no mma.h, so kernels reach the tensor cores through the PTX instructions
// (wmma.load.{a,b,c}, wmma.mma, wmma.store.d) in inline asm, which g++ cannot run: a kernel
// calls these instead when __FAKECUDA__ is defined (kernels/attention_tc.cu). A fragment's
// layout across the warp's lanes is opaque in PTX, so any layout that keeps the semantics is a
// faithful double: here lane L holds logical elements 8L..8L+7 of the 16 x 16 matrix in
// row-major order ((row, column) of A and C, (k, n) of B), two bf16 to a 32-bit register. Loads
// and stores touch only the lane's own elements, so a lane that reads what another lane stored
// without a __syncwarp between reads stale data, as on a GPU. The product is a warp collective
// (every lane deposits its fragments, meets the others, computes its own outputs, meets them
// again), so a lane missing from it fails the launch as a missing shuffle lane does. What PTX
// requires of the operands is checked: 32-byte aligned addresses and rows of a multiple of 16
// bytes (trap 716, misaligned address).
namespace fakecuda {

// One warp's operands of a product, in logical order.
struct WmmaTile {
    unsigned short a[256], b[256];
    float c[256];
};
// Per block: a block's threads are fibers of one OS thread.
static thread_local WmmaTile wmma_tiles[32];

// The calling thread's index in its block (x fastest); its warp is index / 32, its lane index % 32.
inline unsigned wmma_thread_index() {
    return cur->thread_idx.x + cur->block_dim.x * (cur->thread_idx.y + cur->block_dim.y * cur->thread_idx.z);
}

inline void wmma_check(const void* p, unsigned ld, unsigned elem_bytes, int line) {
    if (reinterpret_cast<uintptr_t>(p) % 32 != 0)
        trap(716, "wmma: the matrix address is not 32-byte aligned", line);
    if ((ld * elem_bytes) % 16 != 0 || ld < 16)
        trap(716, "wmma: the leading dimension is not a multiple of 16 bytes (or is below 16)", line);
}

inline float wmma_bf16(unsigned short b) { return __uint_as_float((unsigned)b << 16); }

// A or B fragment of bf16 from p: element (r, c) at p[r * ld + c] (row-major) or p[c * ld + r].
inline void wmma_load_bf16(unsigned (&frag)[4], const unsigned short* p, unsigned ld, bool col_major,
                           int line) {
    wmma_check(p, ld, 2, line);
    unsigned lane = wmma_thread_index() % 32;
    unsigned short e[8];
    for (unsigned i = 0; i < 8; i++) {
        unsigned r = (8 * lane + i) / 16, c = (8 * lane + i) % 16;
        e[i] = col_major ? p[c * ld + r] : p[r * ld + c];
    }
    memcpy(frag, e, sizeof e);
}

// An fp32 accumulator fragment from / to row-major p (element (r, c) at p[r * ld + c]).
inline void wmma_load_f32(float (&frag)[8], const float* p, unsigned ld, int line) {
    wmma_check(p, ld, 4, line);
    unsigned lane = wmma_thread_index() % 32;
    for (unsigned i = 0; i < 8; i++) frag[i] = p[((8 * lane + i) / 16) * ld + (8 * lane + i) % 16];
}

inline void wmma_store_f32(float* p, const float (&frag)[8], unsigned ld, int line) {
    wmma_check(p, ld, 4, line);
    unsigned lane = wmma_thread_index() % 32;
    for (unsigned i = 0; i < 8; i++) p[((8 * lane + i) / 16) * ld + (8 * lane + i) % 16] = frag[i];
    FAKECUDA_FENCE();
}

// c += a b over the whole warp (wmma.mma.sync.aligned, fp32 accumulate).
inline void wmma_mma_bf16(float (&c)[8], const unsigned (&a)[4], const unsigned (&b)[4], int line) {
    unsigned tid = wmma_thread_index(), lane = tid % 32;
    WmmaTile& s = wmma_tiles[(tid / 32) % 32];
    memcpy(&s.a[8 * lane], a, 16);
    memcpy(&s.b[8 * lane], b, 16);
    memcpy(&s.c[8 * lane], c, 32);
    warp_vote(line, -1, ::fakecuda_abi::kSyncWarp, 0xffffffffu, 0);
    float d[8];
    for (unsigned i = 0; i < 8; i++) {
        unsigned m = (8 * lane + i) / 16, n = (8 * lane + i) % 16;
        float acc = s.c[8 * lane + i];
        for (unsigned k = 0; k < 16; k++) acc += wmma_bf16(s.a[m * 16 + k]) * wmma_bf16(s.b[k * 16 + n]);
        d[i] = acc;
    }
    warp_vote(line, -2, ::fakecuda_abi::kSyncWarp, 0xffffffffu, 0);
    memcpy(c, d, sizeof d);
}


// ---- Tensor-core products: PTX mma.sync m16n8k16 and ldmatrix, bf16 x bf16 -> fp32 -----------
// Unlike wmma's, these fragments have the layouts the PTX ISA documents ("Matrix Fragments for
// mma.m16n8k16", "ldmatrix"), so a kernel may compute on them in registers (the softmax of
// kernels/attention_mma.cu does): the double implements exactly those layouts. With
// g = lane / 4 and q = lane % 4, two bf16 to a 32-bit register (the lower column or k first):
//   A (16 x 16, row): a[0] = A[g][2q, 2q+1], a[1] = A[g+8][2q, 2q+1], a[2] = A[g][2q+8, 2q+9],
//                     a[3] = A[g+8][2q+8, 2q+9];
//   B (16 x 8, col):  b[0] = B[2q, 2q+1][g], b[1] = B[2q+8, 2q+9][g];
//   C, D (16 x 8):    c[0], c[1] = C[g][2q, 2q+1]; c[2], c[3] = C[g+8][2q, 2q+1].
// ldmatrix.x4 loads four 8 x 8 bf16 matrices: lane 8j + i gives the address of row i of matrix j
// (16 bytes, 16-byte aligned: trap 716 otherwise); register j of lane L receives matrix j's
// row L/4, columns 2(L%4) and 2(L%4)+1, or with .trans the same of its transpose (its column
// L/4, rows 2(L%4) and 2(L%4)+1). Both are warp collectives, as the wmma product above.
struct MmaWarp {
    unsigned a[32][4], b[32][2];
    float c[32][4];
    const unsigned short* rows[32];
};
static thread_local MmaWarp mma_warps[32];

inline MmaWarp& mma_warp() { return mma_warps[(wmma_thread_index() / 32) % 32]; }

inline unsigned short mma_half(unsigned reg, unsigned hi) { return (unsigned short)(reg >> (16 * hi)); }

// d = a b + c over the whole warp (mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32).
inline void mma_m16n8k16_bf16(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2], int line) {
    unsigned lane = wmma_thread_index() % 32;
    MmaWarp& w = mma_warp();
    memcpy(w.a[lane], a, 16);
    memcpy(w.b[lane], b, 8);
    memcpy(w.c[lane], c, 16);
    warp_vote(line, -3, ::fakecuda_abi::kSyncWarp, 0xffffffffu, 0);
    // A[m][k] and B[k][n] from the lanes that hold them.
    auto a_at = [&](unsigned m, unsigned k) {
        unsigned owner = 4 * (m % 8) + (k % 8) / 2, reg = (m / 8) + 2 * (k / 8);
        return wmma_bf16(mma_half(w.a[owner][reg], k % 2));
    };
    auto b_at = [&](unsigned k, unsigned n) {
        unsigned owner = 4 * n + (k % 8) / 2;
        return wmma_bf16(mma_half(w.b[owner][k / 8], k % 2));
    };
    unsigned g = lane / 4, q = lane % 4;
    float d[4];
    for (unsigned e = 0; e < 4; e++) {
        unsigned m = g + 8 * (e / 2), n = 2 * q + e % 2;
        float acc = w.c[lane][e];
        for (unsigned k = 0; k < 16; k++) acc += a_at(m, k) * b_at(k, n);
        d[e] = acc;
    }
    warp_vote(line, -4, ::fakecuda_abi::kSyncWarp, 0xffffffffu, 0);
    memcpy(c, d, sizeof d);
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: this lane's row address `row`.
inline void ldmatrix_x4(unsigned (&r)[4], const unsigned short* row, bool trans, int line) {
    if (reinterpret_cast<uintptr_t>(row) % 16 != 0)
        trap(716, "ldmatrix: a row address is not 16-byte aligned", line);
    unsigned lane = wmma_thread_index() % 32;
    MmaWarp& w = mma_warp();
    w.rows[lane] = row;
    warp_vote(line, -5, ::fakecuda_abi::kSyncWarp, 0xffffffffu, 0);
    unsigned out[4];
    for (unsigned j = 0; j < 4; j++) {
        unsigned short e[2];
        for (unsigned h = 0; h < 2; h++) {
            unsigned i = lane / 4, k = 2 * (lane % 4) + h;  // (row, column) of the matrix
            e[h] = trans ? w.rows[8 * j + k][i] : w.rows[8 * j + i][k];
        }
        out[j] = (unsigned)e[0] | ((unsigned)e[1] << 16);
    }
    warp_vote(line, -6, ::fakecuda_abi::kSyncWarp, 0xffffffffu, 0);
    memcpy(r, out, sizeof out);
}


// ---- Asynchronous copies: PTX cp.async.cg.shared.global (16 bytes), commit_group, wait_group ---
// On a GPU a copy lands at some time between its issue and the cp.async.wait_group that lets
// its group complete; until then its destination is undefined. The double makes that
// observable: at issue the destination's 16 bytes become all ones (a NaN in bf16 and fp32), and
// the copy is made when a wait_group lets it complete (every committed group but the newest
// `n`). So a kernel that reads a tile before waiting for it, or refills a buffer other threads
// still read (no barrier between their reads and the issue), computes on NaNs. A barrier alone
// does not complete a copy. `src_bytes` below 16 fills the rest with zeros (PTX's src-size).
// Both addresses must be 16-byte aligned (trap 716). Copies still pending from an earlier
// block of the same thread slot, never waited for, trap (720) when the slot is next used.
struct CpAsyncCopy {
    void* dst;
    const void* src;
    unsigned src_bytes, group;
};
struct CpAsyncThread {
    static constexpr unsigned kCap = 64;
    CpAsyncCopy pending[kCap];
    unsigned count, committed;
    void* block;  // the dynamic shared memory of the block that issued them
};
static thread_local CpAsyncThread cp_async_threads[1024];

inline CpAsyncThread& cp_async_thread(int line) {
    CpAsyncThread& c = cp_async_threads[wmma_thread_index() % 1024];
    if (c.block != cur->dyn_smem) {
        if (c.count != 0) trap(720, "cp.async: copies of an earlier block were never waited for", line);
        c.block = cur->dyn_smem;
        c.committed = 0;
    }
    return c;
}

inline void cp_async_16(void* dst, const void* src, unsigned src_bytes, int line) {
    if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0)
        trap(716, "cp.async: an address is not 16-byte aligned", line);
    CpAsyncThread& c = cp_async_thread(line);
    if (c.count == CpAsyncThread::kCap)
        trap(720, "cp.async: more copies outstanding than the double holds (64 a thread)", line);
    c.pending[c.count++] = CpAsyncCopy{dst, src, src_bytes < 16 ? src_bytes : 16, c.committed};
    memset(dst, 0xff, 16);
    FAKECUDA_FENCE();
}

inline void cp_async_commit(int line) { cp_async_thread(line).committed++; }

inline void cp_async_wait(unsigned n, int line) {
    CpAsyncThread& c = cp_async_thread(line);
    unsigned kept = 0;
    for (unsigned i = 0; i < c.count; i++) {
        CpAsyncCopy& k = c.pending[i];
        if (k.group + n < c.committed) {
            memcpy(k.dst, k.src, k.src_bytes);
            memset(static_cast<char*>(k.dst) + k.src_bytes, 0, 16 - k.src_bytes);
        } else {
            c.pending[kept++] = k;
        }
    }
    c.count = kept;
    FAKECUDA_FENCE();
}

}  // namespace fakecuda

// ---- Module registration (used by the code the fake NVRTC appends) ---------------------------
namespace fakecuda {

template <class F, F fn>
struct KernelTraits;

template <class... A, void (*fn)(A...)>
struct KernelTraits<void (*)(A...), fn> {
    static constexpr unsigned n = sizeof...(A);
    static constexpr size_t sizes[n + 1] = {sizeof(A)..., 0};
    static constexpr size_t aligns[n + 1] = {alignof(A)..., 0};
    static constexpr unsigned char is_ptr[n + 1] = {(unsigned char)std::is_pointer<A>::value..., 0};
    template <size_t... I>
    static void call(void* const* p, std::index_sequence<I...>) {
        fn(*static_cast<A*>(p[I])...);
    }
    static void thunk(void* const* p) { call(p, std::index_sequence_for<A...>{}); }
};

template <class F, F fn>
constexpr ::fakecuda_abi::KernelDesc describe(const char* name) {
    typedef KernelTraits<F, fn> K;
    return ::fakecuda_abi::KernelDesc{name, K::n, K::sizes, K::aligns, K::is_ptr, &K::thunk};
}

}  // namespace fakecuda

#define FAKECUDA_KERNEL(k) ::fakecuda::describe<decltype(&k), &k>(#k)

// Defines the module's exports around the kernel table `table` (null-terminated).
#define FAKECUDA_MODULE(table, flags) \
    FAKECUDA_EXPORT unsigned fakecuda_module_abi(void) { return ::fakecuda_abi::kAbiVersion; } \
    FAKECUDA_EXPORT unsigned fakecuda_module_flags(void) { return (flags); } \
    FAKECUDA_EXPORT void fakecuda_module_bind(const ::fakecuda_abi::Runtime* r) { ::fakecuda::rt = r; } \
    FAKECUDA_EXPORT const ::fakecuda_abi::ThreadState** fakecuda_module_tls(void) { return &::fakecuda::cur; } \
    FAKECUDA_EXPORT const ::fakecuda_abi::KernelDesc* fakecuda_module_kernels(unsigned* count) { \
        *count = sizeof(table) / sizeof(table[0]) - 1; \
        return table; \
    }

#endif  // FAKECUDA_KERNEL_H_
