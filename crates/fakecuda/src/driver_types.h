// The CUDA driver and cuBLAS types and enum values that the fake libcuda.so (driver.cpp), the
// fake libcublas.so (cublas.cpp) and their tests use. No CUDA header exists here: every value is
// copied from cudarc 0.19.10's driver/sys/mod.rs and cublas/sys/mod.rs (feature cuda-13000),
// with NVIDIA's names, so the ABI matches what cudarc calls.
#pragma once
#include <cstddef>
#include <cstdint>

extern "C" {

// ---- driver ------------------------------------------------------------------------------------

typedef int CUresult;  // cudaError_enum (repr u32 in cudarc: only return listed values)
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st* CUcontext;
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef void (*CUhostFn)(void* userData);
typedef struct CUuuid_st {
    char bytes[16];
} CUuuid;

// Every CUresult of cuda-13000: X(name, value, description). cuGetErrorName/String use the
// table; the enum below is generated from it.
#define FAKECUDA_CU_ERRORS(X)                                                                     \
    X(CUDA_SUCCESS, 0, "no error")                                                                \
    X(CUDA_ERROR_INVALID_VALUE, 1, "invalid argument")                                           \
    X(CUDA_ERROR_OUT_OF_MEMORY, 2, "out of memory")                                               \
    X(CUDA_ERROR_NOT_INITIALIZED, 3, "initialization error")                                     \
    X(CUDA_ERROR_DEINITIALIZED, 4, "driver shutting down")                                       \
    X(CUDA_ERROR_PROFILER_DISABLED, 5, "profiler disabled while using external profiling tool")  \
    X(CUDA_ERROR_PROFILER_NOT_INITIALIZED, 6, "profiler not initialized: call cudaProfilerInitialize()") \
    X(CUDA_ERROR_PROFILER_ALREADY_STARTED, 7, "profiler already started")                        \
    X(CUDA_ERROR_PROFILER_ALREADY_STOPPED, 8, "profiler already stopped")                        \
    X(CUDA_ERROR_STUB_LIBRARY, 34, "CUDA driver is a stub library")                              \
    X(CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER, 36, "CUDA call requires a newer driver")           \
    X(CUDA_ERROR_DEVICE_UNAVAILABLE, 46, "CUDA-capable device(s) is/are busy or unavailable")   \
    X(CUDA_ERROR_NO_DEVICE, 100, "no CUDA-capable device is detected")                          \
    X(CUDA_ERROR_INVALID_DEVICE, 101, "invalid device ordinal")                                 \
    X(CUDA_ERROR_DEVICE_NOT_LICENSED, 102, "device doesn't have valid Grid license")            \
    X(CUDA_ERROR_INVALID_IMAGE, 200, "device kernel image is invalid")                          \
    X(CUDA_ERROR_INVALID_CONTEXT, 201, "invalid device context")                                \
    X(CUDA_ERROR_CONTEXT_ALREADY_CURRENT, 202, "context already current")                       \
    X(CUDA_ERROR_MAP_FAILED, 205, "mapping of buffer object failed")                            \
    X(CUDA_ERROR_UNMAP_FAILED, 206, "unmapping of buffer object failed")                        \
    X(CUDA_ERROR_ARRAY_IS_MAPPED, 207, "array is mapped")                                       \
    X(CUDA_ERROR_ALREADY_MAPPED, 208, "resource already mapped")                                \
    X(CUDA_ERROR_NO_BINARY_FOR_GPU, 209, "no kernel image is available for execution on the device") \
    X(CUDA_ERROR_ALREADY_ACQUIRED, 210, "resource already acquired")                            \
    X(CUDA_ERROR_NOT_MAPPED, 211, "resource not mapped")                                        \
    X(CUDA_ERROR_NOT_MAPPED_AS_ARRAY, 212, "resource not mapped as array")                      \
    X(CUDA_ERROR_NOT_MAPPED_AS_POINTER, 213, "resource not mapped as pointer")                  \
    X(CUDA_ERROR_ECC_UNCORRECTABLE, 214, "uncorrectable ECC error encountered")                 \
    X(CUDA_ERROR_UNSUPPORTED_LIMIT, 215, "limit is not supported on this architecture")         \
    X(CUDA_ERROR_CONTEXT_ALREADY_IN_USE, 216, "exclusive-thread device already in use by a different thread") \
    X(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, 217, "peer access is not supported between these two devices") \
    X(CUDA_ERROR_INVALID_PTX, 218, "a PTX JIT compilation failed")                              \
    X(CUDA_ERROR_INVALID_GRAPHICS_CONTEXT, 219, "invalid OpenGL or DirectX context")            \
    X(CUDA_ERROR_NVLINK_UNCORRECTABLE, 220, "uncorrectable NVLink error detected during the execution") \
    X(CUDA_ERROR_JIT_COMPILER_NOT_FOUND, 221, "PTX JIT compiler library not found")             \
    X(CUDA_ERROR_UNSUPPORTED_PTX_VERSION, 222, "the provided PTX was compiled with an unsupported toolchain.") \
    X(CUDA_ERROR_JIT_COMPILATION_DISABLED, 223, "PTX JIT compilation was disabled")             \
    X(CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY, 224, "the provided execution affinity is not supported") \
    X(CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC, 225, "the provided PTX contains unsupported call to cudaDeviceSynchronize") \
    X(CUDA_ERROR_CONTAINED, 226, "an exception occurred on the device that is now contained by the GPU's error containment capability") \
    X(CUDA_ERROR_INVALID_SOURCE, 300, "device kernel image is invalid")                         \
    X(CUDA_ERROR_FILE_NOT_FOUND, 301, "file not found")                                         \
    X(CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND, 302, "shared object symbol not found")         \
    X(CUDA_ERROR_SHARED_OBJECT_INIT_FAILED, 303, "shared object initialization failed")         \
    X(CUDA_ERROR_OPERATING_SYSTEM, 304, "OS call failed or operation not supported on this OS") \
    X(CUDA_ERROR_INVALID_HANDLE, 400, "invalid resource handle")                                \
    X(CUDA_ERROR_ILLEGAL_STATE, 401, "the operation cannot be performed in the present state")  \
    X(CUDA_ERROR_LOSSY_QUERY, 402, "attempted introspection would be semantically lossy")       \
    X(CUDA_ERROR_NOT_FOUND, 500, "named symbol not found")                                      \
    X(CUDA_ERROR_NOT_READY, 600, "device not ready")                                            \
    X(CUDA_ERROR_ILLEGAL_ADDRESS, 700, "an illegal memory access was encountered")              \
    X(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, 701, "too many resources requested for launch")       \
    X(CUDA_ERROR_LAUNCH_TIMEOUT, 702, "the launch timed out and was terminated")                \
    X(CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING, 703, "launch uses incompatible texturing mode") \
    X(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, 704, "peer access is already enabled")            \
    X(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, 705, "peer access has not been enabled")              \
    X(CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, 708, "cannot set while device is active in this process") \
    X(CUDA_ERROR_CONTEXT_IS_DESTROYED, 709, "context is destroyed")                             \
    X(CUDA_ERROR_ASSERT, 710, "device-side assert triggered")                                   \
    X(CUDA_ERROR_TOO_MANY_PEERS, 711, "peer mapping resources exhausted")                       \
    X(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, 712, "part or all of the requested memory range is already mapped") \
    X(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, 713, "pointer does not correspond to a registered memory region") \
    X(CUDA_ERROR_HARDWARE_STACK_ERROR, 714, "hardware stack error")                             \
    X(CUDA_ERROR_ILLEGAL_INSTRUCTION, 715, "an illegal instruction was encountered")            \
    X(CUDA_ERROR_MISALIGNED_ADDRESS, 716, "misaligned address")                                 \
    X(CUDA_ERROR_INVALID_ADDRESS_SPACE, 717, "operation not supported on global/shared address space") \
    X(CUDA_ERROR_INVALID_PC, 718, "invalid program counter")                                    \
    X(CUDA_ERROR_LAUNCH_FAILED, 719, "unspecified launch failure")                              \
    X(CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE, 720, "too many blocks in cooperative launch")    \
    X(CUDA_ERROR_TENSOR_MEMORY_LEAK, 721, "tensor memory not completely freed")                 \
    X(CUDA_ERROR_NOT_PERMITTED, 800, "operation not permitted")                                 \
    X(CUDA_ERROR_NOT_SUPPORTED, 801, "operation not supported")                                 \
    X(CUDA_ERROR_SYSTEM_NOT_READY, 802, "system not yet initialized")                           \
    X(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, 803, "system has unsupported display driver / cuda driver combination") \
    X(CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE, 804, "forward compatibility was attempted on non supported HW") \
    X(CUDA_ERROR_MPS_CONNECTION_FAILED, 805, "MPS client failed to connect to the MPS control daemon or the MPS server") \
    X(CUDA_ERROR_MPS_RPC_FAILURE, 806, "the remote procedural call between the MPS server and the MPS client failed") \
    X(CUDA_ERROR_MPS_SERVER_NOT_READY, 807, "MPS server is not ready to accept new MPS client requests") \
    X(CUDA_ERROR_MPS_MAX_CLIENTS_REACHED, 808, "the hardware resources required to create MPS client have been exhausted") \
    X(CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED, 809, "the hardware resources required to support device connections have been exhausted") \
    X(CUDA_ERROR_MPS_CLIENT_TERMINATED, 810, "the MPS client has been terminated by the server") \
    X(CUDA_ERROR_CDP_NOT_SUPPORTED, 811, "is using CUDA Dynamic Parallelism, but the current configuration, like MPS, does not support it") \
    X(CUDA_ERROR_CDP_VERSION_MISMATCH, 812, "unsupported interaction between different versions of CUDA Dynamic Parallelism") \
    X(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, 900, "operation not permitted when stream is capturing") \
    X(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, 901, "operation failed due to a previous error during capture") \
    X(CUDA_ERROR_STREAM_CAPTURE_MERGE, 902, "operation would result in a merge of separate capture sequences") \
    X(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, 903, "capture was not ended in the same stream as it began") \
    X(CUDA_ERROR_STREAM_CAPTURE_UNJOINED, 904, "capturing stream has unjoined work")            \
    X(CUDA_ERROR_STREAM_CAPTURE_ISOLATION, 905, "dependency created on uncaptured work in another stream") \
    X(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, 906, "operation would make the legacy stream depend on a capturing blocking stream") \
    X(CUDA_ERROR_CAPTURED_EVENT, 907, "operation not permitted on an event last recorded in a capturing stream") \
    X(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, 908, "attempt to terminate a thread-local capture sequence from another thread") \
    X(CUDA_ERROR_TIMEOUT, 909, "wait operation timed out")                                      \
    X(CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, 910, "the graph update was not performed because it included changes which violated constraints specific to instantiated graph update") \
    X(CUDA_ERROR_EXTERNAL_DEVICE, 911, "an async error has occurred in external entity outside of CUDA") \
    X(CUDA_ERROR_INVALID_CLUSTER_SIZE, 912, "a kernel launch error has occurred due to cluster misconfiguration") \
    X(CUDA_ERROR_FUNCTION_NOT_LOADED, 913, "the function handle is not loaded when calling an API that requires a loaded function") \
    X(CUDA_ERROR_INVALID_RESOURCE_TYPE, 914, "one or more resources passed in are not valid resource types for the operation") \
    X(CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION, 915, "one or more resources are insufficient or non-applicable for the operation") \
    X(CUDA_ERROR_KEY_ROTATION, 916, "an error happened during the key rotation sequence")       \
    X(CUDA_ERROR_UNKNOWN, 999, "unknown error")

#define FAKECUDA_CU_ENUM(name, value, text) name = value,
enum cudaError_enum { FAKECUDA_CU_ERRORS(FAKECUDA_CU_ENUM) };
#undef FAKECUDA_CU_ENUM

// CUdevice_attribute (the ones the fake reports something other than 0 for, or cudarc asks).
enum CUdevice_attribute_enum {
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1,
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X = 2,
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y = 3,
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z = 4,
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X = 5,
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y = 6,
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z = 7,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK = 8,
    CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY = 9,
    CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10,
    CU_DEVICE_ATTRIBUTE_MAX_PITCH = 11,
    CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK = 12,
    CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13,
    CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT = 14,
    CU_DEVICE_ATTRIBUTE_GPU_OVERLAP = 15,
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
    CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY = 19,
    CU_DEVICE_ATTRIBUTE_SURFACE_ALIGNMENT = 30,
    CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS = 31,
    CU_DEVICE_ATTRIBUTE_ECC_ENABLED = 32,
    CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33,
    CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36,
    CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37,
    CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38,
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 39,
    CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT = 40,
    CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
    CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT = 51,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
    CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED = 78,
    CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED = 79,
    CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED = 80,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81,
    CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR = 82,
    CU_DEVICE_ATTRIBUTE_SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO = 87,
    CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED = 90,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97,
    CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR = 106,
    CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK = 111,
    CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 115,
    CU_DEVICE_ATTRIBUTE_MAX = 148,
};

enum CUfunction_attribute_enum {
    CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0,
    CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1,
    CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES = 2,
    CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3,
    CU_FUNC_ATTRIBUTE_NUM_REGS = 4,
    CU_FUNC_ATTRIBUTE_PTX_VERSION = 5,
    CU_FUNC_ATTRIBUTE_BINARY_VERSION = 6,
    CU_FUNC_ATTRIBUTE_CACHE_MODE_CA = 7,
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
    CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9,
    CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET = 10,
    CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH = 11,
    CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT = 12,
    CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH = 13,
    CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14,
    CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 15,
    CU_FUNC_ATTRIBUTE_MAX = 16,
};

enum CUevent_flags_enum {
    CU_EVENT_DEFAULT = 0,
    CU_EVENT_BLOCKING_SYNC = 1,
    CU_EVENT_DISABLE_TIMING = 2,
    CU_EVENT_INTERPROCESS = 4,
};

enum CUevent_wait_flags_enum { CU_EVENT_WAIT_DEFAULT = 0, CU_EVENT_WAIT_EXTERNAL = 1 };

enum CUstream_flags_enum { CU_STREAM_DEFAULT = 0, CU_STREAM_NON_BLOCKING = 1 };

// Special stream handles (cuda.h): the legacy default stream and the per-thread default stream.
#define FAKECUDA_CU_STREAM_LEGACY ((CUstream)0x1)
#define FAKECUDA_CU_STREAM_PER_THREAD ((CUstream)0x2)

// ---- cuBLAS ------------------------------------------------------------------------------------

typedef struct cublasContext* cublasHandle_t;
typedef CUstream cudaStream_t;  // the runtime's stream is the driver's
typedef int cublasStatus_t;
typedef int cublasOperation_t;
typedef int cudaDataType;
typedef int cublasComputeType_t;
typedef int cublasGemmAlgo_t;
typedef int cublasMath_t;
typedef int cublasPointerMode_t;

enum cublasStatus_enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_ARCH_MISMATCH = 8,
    CUBLAS_STATUS_MAPPING_ERROR = 11,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_INTERNAL_ERROR = 14,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
    CUBLAS_STATUS_LICENSE_ERROR = 16,
};

enum cublasOperation_enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2, CUBLAS_OP_CONJG = 3 };

enum cudaDataType_enum { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 };

enum cublasComputeType_enum {
    CUBLAS_COMPUTE_16F = 64,
    CUBLAS_COMPUTE_32F = 68,
    CUBLAS_COMPUTE_32F_PEDANTIC = 69,
    CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
};

enum cublasGemmAlgo_enum { CUBLAS_GEMM_DEFAULT = -1 };

enum cublasMath_enum {
    CUBLAS_DEFAULT_MATH = 0,
    CUBLAS_TENSOR_OP_MATH = 1,
    CUBLAS_PEDANTIC_MATH = 2,
    CUBLAS_TF32_TENSOR_OP_MATH = 3,
    CUBLAS_FP32_EMULATED_BF16X9_MATH = 4,
    CUBLAS_FP64_EMULATED_FIXEDPOINT_MATH = 8,
    CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16,
};

enum cublasPointerMode_enum { CUBLAS_POINTER_MODE_HOST = 0, CUBLAS_POINTER_MODE_DEVICE = 1 };

}  // extern "C"
