// A stand-in for the kernel executor (src/exec.cpp) so the driver tests build and run before it
// exists: exec.h's functions over three hand-written "kernels" that test_driver.cpp launches.
// Its only image is the string "FAKECUDA-STUB-IMAGE"; it exports fakecuda_exec_is_stub so the
// test knows to pass that image instead of compiling the kernels with the fake NVRTC.
#include <cstring>
#include <string>

#include "exec.h"

extern "C" {
__attribute__((visibility("default"))) int fakecuda_exec_is_stub = 1;
}

namespace fakecuda {

struct Module {
    int unused = 0;
};

namespace {

const size_t kSizes3[] = {8, 4, 4};
const size_t kAligns3[] = {8, 4, 4};
const unsigned char kIsPtr3[] = {1, 0, 0};
const size_t kSizes2[] = {8, 4};
const size_t kAligns2[] = {8, 4};
const unsigned char kIsPtr2[] = {1, 0};
const size_t kSizes1[] = {8};
const size_t kAligns1[] = {8};
const unsigned char kIsPtr1[] = {1};

// write_value(float* p, float v, int n): p[i] = v for every i < n of the grid.
const KernelInfo kWriteValue = {"write_value", 3, kSizes3, kAligns3, kIsPtr3};
// fault(float* p, int n): writes p[n] (one past the end): the stub reports an illegal address.
const KernelInfo kFault = {"fault", 2, kSizes2, kAligns2, kIsPtr2};
// uses_smem(float* p): p[0] = blockDim.x (each thread adds 1 through shared memory).
const KernelInfo kUsesSmem = {"uses_smem", 1, kSizes1, kAligns1, kIsPtr1};

template <class T>
T arg(void* const* params, int i) {
    T v;
    memcpy(&v, params[i], sizeof v);
    return v;
}

}  // namespace

Module* load_module(const void* image, std::string& err) {
    if (strcmp((const char*)image, "FAKECUDA-STUB-IMAGE") != 0) {
        err = "not an image of the test stub executor (tests/driver/exec_stub.cpp)";
        return nullptr;
    }
    return new Module;
}

void unload_module(Module* m) { delete m; }

const KernelInfo* find_kernel(Module*, const char* name) {
    for (const KernelInfo* k : {&kWriteValue, &kFault, &kUsesSmem})
        if (strcmp(k->name, name) == 0) return k;
    return nullptr;
}

RunResult run_grid(const KernelInfo* k, Dim3 grid, Dim3 block, size_t dyn_smem_bytes,
                   void* const* params, uint64_t seed) {
    (void)seed;
    (void)dyn_smem_bytes;
    RunResult r;
    if (k == &kWriteValue) {
        float* p = arg<float*>(params, 0);
        float v = arg<float>(params, 1);
        int n = arg<int>(params, 2);
        long long threads = (long long)grid.x * block.x;
        for (long long i = 0; i < threads && i < n; ++i) p[i] = v;
    } else if (k == &kFault) {
        r.code = 700;
        r.message = "fault: block (0, 0, 0) thread (0, 0, 0): illegal address (stub executor)";
    } else if (k == &kUsesSmem) {
        arg<float*>(params, 0)[0] = (float)block.x;
    }
    return r;
}

}  // namespace fakecuda
