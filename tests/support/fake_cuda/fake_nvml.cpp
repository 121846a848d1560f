// The test driver's libnvidia-ml.so.1: FAKE_CUDA_DEVICES GPUs with the fake UUIDs.
// nvmlInit opens nvidiactl and nvidiaN (as real NVML does) and never touches CUDA state.
#include <unistd.h>

#include <cstdio>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "fake_common.hpp"
#include "forkguard/cuda/api.hpp"

using namespace forkguard::cuda;  // NOLINT: the C API's names, as in nvml.h

struct nvmlDevice_st {
  int index = 0;
};

namespace {

std::mutex g_mutex;
int g_refs = 0;
std::vector<int> g_fds;
nvmlDevice_st g_devices[64];

nvmlReturn_t done(const char* fn, nvmlReturn_t r) {
  fake_cuda::log_call(fn, r);
  return r;
}

bool initialized() {
  std::lock_guard lock(g_mutex);
  return g_refs > 0;
}

nvmlReturn_t copy_string(const char* fn, const std::string& s, char* out, unsigned length) {
  if (out == nullptr) return done(fn, NVML_ERROR_INVALID_ARGUMENT);
  if (s.size() + 1 > length) return done(fn, NVML_ERROR_INSUFFICIENT_SIZE);
  std::snprintf(out, length, "%s", s.c_str());
  return done(fn, NVML_SUCCESS);
}

}  // namespace

extern "C" {

nvmlReturn_t nvmlInit_v2() {
  std::lock_guard lock(g_mutex);
  if (g_refs++ == 0) {
    g_fds.push_back(fake_cuda::open_device("nvidiactl"));
    for (int i = 0; i < fake_cuda::device_count(); ++i) {
      g_devices[i].index = i;
      g_fds.push_back(fake_cuda::open_device(("nvidia" + std::to_string(i)).c_str()));
    }
  }
  return done("nvmlInit_v2", NVML_SUCCESS);
}

nvmlReturn_t nvmlShutdown() {
  std::lock_guard lock(g_mutex);
  if (g_refs == 0) return done("nvmlShutdown", NVML_ERROR_UNINITIALIZED);
  if (--g_refs == 0) {
    for (int fd : g_fds) {
      if (fd >= 0) ::close(fd);
    }
    g_fds.clear();
  }
  return done("nvmlShutdown", NVML_SUCCESS);
}

const char* nvmlErrorString(nvmlReturn_t result) {
  switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    default: return "Unknown Error";
  }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char* version, unsigned int length) {
  if (!initialized()) return done("nvmlSystemGetDriverVersion", NVML_ERROR_UNINITIALIZED);
  return copy_string("nvmlSystemGetDriverVersion", "999.99-fake", version, length);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int* version) {
  if (!initialized()) return done("nvmlSystemGetCudaDriverVersion", NVML_ERROR_UNINITIALIZED);
  if (version == nullptr)
    return done("nvmlSystemGetCudaDriverVersion", NVML_ERROR_INVALID_ARGUMENT);
  *version = 12080;
  return done("nvmlSystemGetCudaDriverVersion", NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int* count) {
  if (!initialized()) return done("nvmlDeviceGetCount_v2", NVML_ERROR_UNINITIALIZED);
  if (count == nullptr) return done("nvmlDeviceGetCount_v2", NVML_ERROR_INVALID_ARGUMENT);
  *count = static_cast<unsigned>(fake_cuda::device_count());
  return done("nvmlDeviceGetCount_v2", NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t* device) {
  if (!initialized()) return done("nvmlDeviceGetHandleByIndex_v2", NVML_ERROR_UNINITIALIZED);
  if (device == nullptr || index >= static_cast<unsigned>(fake_cuda::device_count())) {
    return done("nvmlDeviceGetHandleByIndex_v2", NVML_ERROR_INVALID_ARGUMENT);
  }
  *device = &g_devices[index];
  return done("nvmlDeviceGetHandleByIndex_v2", NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char* name, unsigned int length) {
  if (!initialized()) return done("nvmlDeviceGetName", NVML_ERROR_UNINITIALIZED);
  if (device == nullptr) return done("nvmlDeviceGetName", NVML_ERROR_INVALID_ARGUMENT);
  return copy_string("nvmlDeviceGetName", "Fake CUDA Device " + std::to_string(device->index), name,
                     length);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char* uuid, unsigned int length) {
  if (!initialized()) return done("nvmlDeviceGetUUID", NVML_ERROR_UNINITIALIZED);
  if (device == nullptr) return done("nvmlDeviceGetUUID", NVML_ERROR_INVALID_ARGUMENT);
  return copy_string("nvmlDeviceGetUUID", fake_cuda::uuid_of(device->index), uuid, length);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int* minor) {
  if (!initialized()) return done("nvmlDeviceGetMinorNumber", NVML_ERROR_UNINITIALIZED);
  if (device == nullptr || minor == nullptr) {
    return done("nvmlDeviceGetMinorNumber", NVML_ERROR_INVALID_ARGUMENT);
  }
  *minor = static_cast<unsigned>(device->index);
  return done("nvmlDeviceGetMinorNumber", NVML_SUCCESS);
}

}  // extern "C"

#define FAKE_CHECK_SIGNATURE(name, ret, params) \
  static_assert(std::is_same_v<decltype(&::name), PFN_##name>, #name);
FORKGUARD_NVML_FUNCTIONS(FAKE_CHECK_SIGNATURE)
