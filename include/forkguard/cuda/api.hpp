// The subset of the CUDA driver API and NVML that forkguard calls, declared without the toolkit.
//
// Types, CUresult / nvmlReturn_t values and function signatures follow NVIDIA's documented C API
// (cuda.h, nvml.h). Exported symbol names are the versioned ones the driver exports
// (cuMemAlloc_v2, ...). Where cuda.h is installed, tests/cuda/api_signature_check.cpp compares
// every declaration here with the toolkit's at compile time.
//
// The X-macro lists are the single source of truth: the loader (src/cuda/driver.cpp), the test
// driver (tests/support/fake_cuda/) and the signature check are all generated from them.
//
// Thread-safety: declarations only.
#pragma once

#include <cstddef>

// Opaque handle structs, named as in cuda.h so pointer types are identical to the toolkit's.
struct CUctx_st;
struct CUstream_st;
struct CUevent_st;
struct nvmlDevice_st;

namespace forkguard::cuda {

enum CUresult : int {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_DEINITIALIZED = 4,
  CUDA_ERROR_STUB_LIBRARY = 34,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_CONTEXT_ALREADY_CURRENT = 202,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
  CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
  CUDA_ERROR_NOT_PERMITTED = 800,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_UNKNOWN = 999,
};

enum CUdevice_attribute : int {
  CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33,
  CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
};

using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = ::CUctx_st*;
using CUstream = ::CUstream_st*;
using CUevent = ::CUevent_st*;

inline constexpr unsigned kCuEventDisableTiming = 0x2;  // CU_EVENT_DISABLE_TIMING
inline constexpr unsigned kCuStreamNonBlocking = 0x1;   // CU_STREAM_NON_BLOCKING

enum nvmlReturn_t : int {
  NVML_SUCCESS = 0,
  NVML_ERROR_UNINITIALIZED = 1,
  NVML_ERROR_INVALID_ARGUMENT = 2,
  NVML_ERROR_NOT_SUPPORTED = 3,
  NVML_ERROR_NO_PERMISSION = 4,
  NVML_ERROR_NOT_FOUND = 6,
  NVML_ERROR_INSUFFICIENT_SIZE = 7,
  NVML_ERROR_DRIVER_NOT_LOADED = 9,
  NVML_ERROR_LIBRARY_NOT_FOUND = 12,
  NVML_ERROR_UNKNOWN = 999,
};

using nvmlDevice_t = ::nvmlDevice_st*;

inline constexpr unsigned kNvmlDeviceNameBufferSize = 96;  // NVML_DEVICE_NAME_V2_BUFFER_SIZE
inline constexpr unsigned kNvmlDeviceUuidBufferSize = 96;  // NVML_DEVICE_UUID_V2_BUFFER_SIZE
inline constexpr unsigned kNvmlDriverVersionBufferSize =
    80;  // NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE

// X(name, return type, parameter list). Every entry is a symbol libcuda.so.1 exports.
#define FORKGUARD_CUDA_DRIVER_FUNCTIONS(X)                                                       \
  X(cuInit, CUresult, (unsigned int flags))                                                      \
  X(cuDriverGetVersion, CUresult, (int* version))                                                \
  X(cuGetErrorName, CUresult, (CUresult error, const char** name))                               \
  X(cuGetErrorString, CUresult, (CUresult error, const char** text))                             \
  X(cuDeviceGetCount, CUresult, (int* count))                                                    \
  X(cuDeviceGet, CUresult, (CUdevice * device, int ordinal))                                     \
  X(cuDeviceGetName, CUresult, (char* name, int len, CUdevice dev))                              \
  X(cuDeviceTotalMem_v2, CUresult, (size_t * bytes, CUdevice dev))                               \
  X(cuDeviceGetAttribute, CUresult, (int* value, CUdevice_attribute attrib, CUdevice dev))       \
  X(cuDevicePrimaryCtxRetain, CUresult, (CUcontext * ctx, CUdevice dev))                         \
  X(cuDevicePrimaryCtxRelease_v2, CUresult, (CUdevice dev))                                      \
  X(cuDevicePrimaryCtxGetState, CUresult, (CUdevice dev, unsigned int* flags, int* active))      \
  X(cuCtxSetCurrent, CUresult, (CUcontext ctx))                                                  \
  X(cuCtxGetCurrent, CUresult, (CUcontext * ctx))                                                \
  X(cuCtxSynchronize, CUresult, ())                                                              \
  X(cuMemAlloc_v2, CUresult, (CUdeviceptr * dptr, size_t bytes))                                 \
  X(cuMemFree_v2, CUresult, (CUdeviceptr dptr))                                                  \
  X(cuMemHostRegister_v2, CUresult, (void* p, size_t bytes, unsigned int flags))                 \
  X(cuMemHostUnregister, CUresult, (void* p))                                                    \
  X(cuMemcpyHtoD_v2, CUresult, (CUdeviceptr dst, const void* src, size_t bytes))                 \
  X(cuMemcpyDtoH_v2, CUresult, (void* dst, CUdeviceptr src, size_t bytes))                       \
  X(cuMemcpyHtoDAsync_v2, CUresult,                                                              \
    (CUdeviceptr dst, const void* src, size_t bytes, CUstream stream))                           \
  X(cuMemcpyDtoHAsync_v2, CUresult, (void* dst, CUdeviceptr src, size_t bytes, CUstream stream)) \
  X(cuStreamCreate, CUresult, (CUstream * stream, unsigned int flags))                           \
  X(cuStreamDestroy_v2, CUresult, (CUstream stream))                                             \
  X(cuStreamSynchronize, CUresult, (CUstream stream))                                            \
  X(cuStreamWaitEvent, CUresult, (CUstream stream, CUevent event, unsigned int flags))           \
  X(cuEventCreate, CUresult, (CUevent * event, unsigned int flags))                              \
  X(cuEventRecord, CUresult, (CUevent event, CUstream stream))                                   \
  X(cuEventQuery, CUresult, (CUevent event))                                                     \
  X(cuEventSynchronize, CUresult, (CUevent event))                                               \
  X(cuEventDestroy_v2, CUresult, (CUevent event))

// X(name, return type, parameter list). Every entry is a symbol libnvidia-ml.so.1 exports.
#define FORKGUARD_NVML_FUNCTIONS(X)                                                          \
  X(nvmlInit_v2, nvmlReturn_t, ())                                                           \
  X(nvmlShutdown, nvmlReturn_t, ())                                                          \
  X(nvmlErrorString, const char*, (nvmlReturn_t result))                                     \
  X(nvmlSystemGetDriverVersion, nvmlReturn_t, (char* version, unsigned int length))          \
  X(nvmlSystemGetCudaDriverVersion, nvmlReturn_t, (int* version))                            \
  X(nvmlDeviceGetCount_v2, nvmlReturn_t, (unsigned int* count))                              \
  X(nvmlDeviceGetHandleByIndex_v2, nvmlReturn_t, (unsigned int index, nvmlDevice_t* device)) \
  X(nvmlDeviceGetName, nvmlReturn_t, (nvmlDevice_t device, char* name, unsigned int length)) \
  X(nvmlDeviceGetUUID, nvmlReturn_t, (nvmlDevice_t device, char* uuid, unsigned int length)) \
  X(nvmlDeviceGetMinorNumber, nvmlReturn_t, (nvmlDevice_t device, unsigned int* minor))

#define FORKGUARD_DECLARE_PFN(name, ret, params) using PFN_##name = ret(*) params;
FORKGUARD_CUDA_DRIVER_FUNCTIONS(FORKGUARD_DECLARE_PFN)
FORKGUARD_NVML_FUNCTIONS(FORKGUARD_DECLARE_PFN)
#undef FORKGUARD_DECLARE_PFN

}  // namespace forkguard::cuda
