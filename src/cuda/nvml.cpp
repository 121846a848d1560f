#include "forkguard/cuda/nvml.hpp"

#include <dirent.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string_view>

#include "detail/decimal.hpp"
#include "forkguard/cuda/api.hpp"

namespace forkguard::cuda {
namespace {

struct NvmlApi {
#define FORKGUARD_DECLARE_MEMBER(name, ret, params) PFN_##name name = nullptr;
  FORKGUARD_NVML_FUNCTIONS(FORKGUARD_DECLARE_MEMBER)
#undef FORKGUARD_DECLARE_MEMBER
};

std::string nvml_error(const NvmlApi& api, nvmlReturn_t r) {
  const char* s = api.nvmlErrorString != nullptr ? api.nvmlErrorString(r) : nullptr;
  return fmt::format("{} ({})", s != nullptr ? s : "unknown NVML error", static_cast<int>(r));
}

// Fills inv from NVML; returns false (with a note) if NVML is unusable.
bool from_nvml(GpuInventory& inv) {
  const std::string name = nvml_library_name();
  ::dlerror();
  // NVML is kept loaded: unloading it while another component holds it is not safe.
  void* handle = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = ::dlerror();
    inv.notes.push_back(fmt::format("NVML not used: {}", err != nullptr ? err : name));
    return false;
  }
  NvmlApi api;
  std::string missing;
#define FORKGUARD_RESOLVE(fn, ret, params)                   \
  api.fn = reinterpret_cast<PFN_##fn>(::dlsym(handle, #fn)); \
  if (api.fn == nullptr) missing += (missing.empty() ? "" : ", ") + std::string(#fn);
  FORKGUARD_NVML_FUNCTIONS(FORKGUARD_RESOLVE)
#undef FORKGUARD_RESOLVE
  if (!missing.empty()) {
    inv.notes.push_back(fmt::format("NVML not used: {} lacks {}", name, missing));
    return false;
  }
  if (auto r = api.nvmlInit_v2(); r != NVML_SUCCESS) {
    inv.notes.push_back(fmt::format("NVML not used: nvmlInit failed: {}", nvml_error(api, r)));
    return false;
  }
  char buf[kNvmlDriverVersionBufferSize] = {};
  if (api.nvmlSystemGetDriverVersion(buf, sizeof buf) == NVML_SUCCESS) inv.driver_version = buf;
  int cuda_version = 0;
  if (api.nvmlSystemGetCudaDriverVersion(&cuda_version) == NVML_SUCCESS) {
    inv.cuda_driver_version = cuda_version;
  }
  unsigned count = 0;
  if (auto r = api.nvmlDeviceGetCount_v2(&count); r != NVML_SUCCESS) {
    inv.notes.push_back(fmt::format("nvmlDeviceGetCount failed: {}", nvml_error(api, r)));
    api.nvmlShutdown();
    return false;
  }
  for (unsigned i = 0; i < count; ++i) {
    nvmlDevice_t dev = nullptr;
    GpuInfo gpu;
    gpu.index = static_cast<int>(i);
    if (auto r = api.nvmlDeviceGetHandleByIndex_v2(i, &dev); r != NVML_SUCCESS) {
      inv.notes.push_back(
          fmt::format("GPU {}: nvmlDeviceGetHandleByIndex failed: {}", i, nvml_error(api, r)));
      inv.gpus.push_back(gpu);
      continue;
    }
    char name_buf[kNvmlDeviceNameBufferSize] = {};
    if (api.nvmlDeviceGetName(dev, name_buf, sizeof name_buf) == NVML_SUCCESS) gpu.name = name_buf;
    char uuid_buf[kNvmlDeviceUuidBufferSize] = {};
    if (api.nvmlDeviceGetUUID(dev, uuid_buf, sizeof uuid_buf) == NVML_SUCCESS) gpu.uuid = uuid_buf;
    unsigned minor = 0;
    if (api.nvmlDeviceGetMinorNumber(dev, &minor) == NVML_SUCCESS)
      gpu.minor = static_cast<int>(minor);
    inv.gpus.push_back(std::move(gpu));
  }
  api.nvmlShutdown();
  std::string path = name;
  if (Dl_info info{};
      ::dladdr(reinterpret_cast<void*>(api.nvmlInit_v2), &info) != 0 && info.dli_fname != nullptr) {
    path = info.dli_fname;
  }
  inv.source = fmt::format("nvml ({})", path);
  return true;
}

std::string trim(std::string_view s) {
  auto b = s.find_first_not_of(" \t");
  auto e = s.find_last_not_of(" \t\r\n");
  return b == std::string_view::npos ? std::string() : std::string(s.substr(b, e - b + 1));
}

// /proc/driver/nvidia/gpus/<pci>/information: "Model: ...", "Device Minor: N", "GPU UUID: GPU-...".
bool from_procfs(GpuInventory& inv) {
  constexpr const char* kDir = "/proc/driver/nvidia/gpus";
  DIR* dir = ::opendir(kDir);
  if (dir == nullptr) {
    inv.notes.push_back(fmt::format("{}: not present (no NVIDIA kernel driver)", kDir));
    return false;
  }
  std::vector<std::string> pci;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') pci.emplace_back(e->d_name);
  }
  ::closedir(dir);
  std::sort(pci.begin(), pci.end());  // PCI bus order, as CUDA_DEVICE_ORDER=PCI_BUS_ID and NVML
  for (size_t i = 0; i < pci.size(); ++i) {
    GpuInfo gpu;
    gpu.index = static_cast<int>(i);
    std::ifstream in(fmt::format("{}/{}/information", kDir, pci[i]));
    std::string line;
    while (std::getline(in, line)) {
      auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      auto key = trim(std::string_view(line).substr(0, colon));
      auto value = trim(std::string_view(line).substr(colon + 1));
      if (key == "Model") gpu.name = value;
      if (key == "GPU UUID") gpu.uuid = value;
      if (key == "Device Minor")
        gpu.minor = forkguard::detail::parse_decimal<int>(value).value_or(-1);
    }
    inv.gpus.push_back(std::move(gpu));
  }
  std::ifstream version("/proc/driver/nvidia/version");
  std::string line;
  if (std::getline(version, line)) {
    // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ..."
    auto pos = line.find("Kernel Module");
    if (pos != std::string::npos) {
      auto rest = trim(std::string_view(line).substr(pos + 13));
      inv.driver_version = rest.substr(0, rest.find(' '));
    }
  }
  inv.source = kDir;
  return true;
}

}  // namespace

std::string nvml_library_name() {
  const char* env = std::getenv("FORKGUARD_NVML_LIBRARY");
  return env != nullptr && *env != '\0' ? env : "libnvidia-ml.so.1";
}

GpuInventory discover_gpus() {
  GpuInventory inv;
  if (from_nvml(inv) || from_procfs(inv)) return inv;
  inv.source = "none";
  return inv;
}

}  // namespace forkguard::cuda
