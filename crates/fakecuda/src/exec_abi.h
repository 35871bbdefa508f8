// What the fake NVRTC (nvrtc.cpp) and the executor (exec.cpp) share: the module ABI of
// shim/fakecuda_kernel.h (its ABI-only part) and the layout of the "CUBIN" image that NVRTC
// hands out and cuModuleLoadData accepts.
#pragma once
#define FAKECUDA_ABI_ONLY 1
#include "shim/fakecuda_kernel.h"
#undef FAKECUDA_ABI_ONLY

#include <cstdint>
#include <cstring>

namespace fakecuda {

// The image: this header, then `so_size` bytes of a shared object compiled from the kernel
// source (the module).
struct ImageHeader {
    char magic[8];     // "FAKECUDA", no terminator
    uint32_t abi;      // fakecuda_abi::kAbiVersion of the NVRTC that made it
    uint32_t flags;    // reserved, 0
    uint64_t so_size;  // bytes that follow
};
static_assert(sizeof(ImageHeader) == 24, "ImageHeader layout");

constexpr char kImageMagic[8] = {'F', 'A', 'K', 'E', 'C', 'U', 'D', 'A'};

inline ImageHeader make_image_header(uint64_t so_size) {
    ImageHeader h;
    memcpy(h.magic, kImageMagic, sizeof h.magic);
    h.abi = fakecuda_abi::kAbiVersion;
    h.flags = 0;
    h.so_size = so_size;
    return h;
}

}  // namespace fakecuda
