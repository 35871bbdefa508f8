// The interface between the fake driver (driver.cpp, cublas.cpp) and the kernel executor
// (exec.cpp, nvrtc.cpp, shim/fakecuda_kernel.h). Everything here lives in libcuda.so; the fake
// NVRTC (libnvrtc.so) only produces module images that `load_module` accepts.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace fakecuda {

struct Dim3 {
    unsigned x, y, z;
};

// One kernel of a loaded module: what cuLaunchKernel needs to copy and check its arguments.
struct KernelInfo {
    const char* name;
    int nparams;
    const size_t* sizes;          // sizeof of each parameter
    const size_t* aligns;         // alignof of each parameter
    const unsigned char* is_ptr;  // 1 where the parameter is a pointer (checked by the driver)
};

struct Module;  // a loaded image (opaque to the driver)

// Loads an image made by the fake NVRTC. Returns null and sets `err` when the bytes are not one.
Module* load_module(const void* image, std::string& err);
void unload_module(Module* m);
// The kernel `name` of `m`, or null.
const KernelInfo* find_kernel(Module* m, const char* name);

// Result of running a grid: code 0 (CUDA_SUCCESS) or a CUresult (700 illegal address,
// 719 launch failed, ...), and a message naming the kernel, the block, the thread and what went
// wrong.
struct RunResult {
    int code = 0;
    std::string message;
};

// Runs every block of `grid` on the calling thread (a stream's worker), each CUDA thread of a
// block a fiber. `params[i]` points to parameter i's bytes (already copied by the driver).
// `seed` shuffles the block order and the order in which ready fibers resume.
RunResult run_grid(const KernelInfo* k, Dim3 grid, Dim3 block, size_t dyn_smem_bytes,
                   void* const* params, uint64_t seed);

}  // namespace fakecuda
