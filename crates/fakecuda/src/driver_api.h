// What the fake libcuda.so (driver.cpp) exports beyond the CUDA driver API, for the fake
// libcublas.so (cublas.cpp) and the tests. libcublas.so links nothing: it finds these with
// dlsym on the already loaded libcuda.so (see cublas.cpp's `driver()`), so every entry point is
// extern "C" and named `fakecuda_*`.
//
// Device addresses are host addresses (kernels and GEMMs run on the CPU), so device pointers are
// plain pointers here.
#pragma once
#include <cstddef>

#include "driver_types.h"

extern "C" {

// Work enqueued on a stream: called on the stream's worker thread, in stream order, with
// `failed` == 0; or, once the context has a sticky error (an earlier kernel failed), with
// `failed` != 0 and nothing to compute: release `arg` and return. Must not call the driver.
typedef void (*fakecuda_work_fn)(void* arg, int failed);

// Enqueues `fn(arg, ...)` on stream `s` of the calling thread's current context (0 and the
// CU_STREAM_LEGACY / PER_THREAD handles are the legacy default stream). Returns a CUresult:
// CUDA_ERROR_INVALID_CONTEXT without a current context, CUDA_ERROR_INVALID_HANDLE for a stream
// that is not one of that context's, the sticky error of a failed context; `fn` is then never
// called.
CUresult fakecuda_enqueue(CUstream s, fakecuda_work_fn fn, void* arg);

// CUDA_SUCCESS when [ptr, ptr + bytes) lies inside one live cuMemAlloc allocation; otherwise
// CUDA_ERROR_INVALID_VALUE after printing "fakecuda: <what>: ..." on stderr with the address and
// the nearest allocation (or the freed one it lies in). `bytes` == 0 checks `ptr` alone.
CUresult fakecuda_check_device_range(const void* ptr, size_t bytes, const char* what);

// 1 when `ptr` lies inside a live cuMemAlloc allocation, 2 inside a freed (quarantined) one,
// 0 otherwise. Prints nothing.
int fakecuda_device_pointer_kind(const void* ptr);

// The page-locked bytes: those asked for by the live cuMemHostAlloc allocations (as asked: not
// the page-rounded mappings) and the live cuMemHostRegister ranges; in `count` (if not null) how
// many there are; with `mine` non-zero, only those the calling thread asked for (wherever they
// are freed). For tests that check a program pins exactly what it says while other tests in the
// process pin too.
size_t fakecuda_host_alloc_bytes(int mine, size_t* count);

// How many copies so far had a pageable host side (a real driver stages them through its own
// buffer, at a fraction of the link's rate, and returns when a download is done).
size_t fakecuda_pageable_copies(void);

// CUDA_SUCCESS when `s` is a stream of the calling thread's current context (or a default
// stream handle); the errors of fakecuda_enqueue otherwise. Enqueues nothing.
CUresult fakecuda_check_stream(CUstream s);

// Waits until every stream of the context that owns `s` has drained (for a default stream
// handle: the current context's, if any). Needs no current context (cublasDestroy runs in
// destructors that may not bind one). Returns that context's sticky error, or CUDA_SUCCESS.
CUresult fakecuda_synchronize_owner(CUstream s);

}  // extern "C"
