#include "forkguard/cuda/driver.hpp"

#include <dlfcn.h>
#include <fmt/format.h>
#include <link.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "detail/loaded_libraries.hpp"

namespace forkguard::cuda {
namespace {

std::mutex g_mutex;
const Driver* g_driver = nullptr;  // set once, never freed: the driver is never unloaded

}  // namespace

std::string driver_library_name() {
  const char* env = std::getenv("FORKGUARD_CUDA_DRIVER");
  return env != nullptr && *env != '\0' ? env : "libcuda.so.1";
}

Driver::Driver(void* handle, std::string path) : handle_(handle), path_(std::move(path)) {
  std::string missing;
#define FORKGUARD_RESOLVE(name, ret, params)                         \
  api_.name = reinterpret_cast<PFN_##name>(::dlsym(handle_, #name)); \
  if (api_.name == nullptr) missing += (missing.empty() ? "" : ", ") + std::string(#name);
  FORKGUARD_CUDA_DRIVER_FUNCTIONS(FORKGUARD_RESOLVE)
#undef FORKGUARD_RESOLVE
  if (!missing.empty()) {
    throw LoadError(fmt::format("CUDA driver {} lacks required symbols: {}", path_, missing));
  }
}

const Driver& Driver::load() {
  std::lock_guard lock(g_mutex);
  if (g_driver != nullptr) return *g_driver;
  const std::string name = driver_library_name();
  ::dlerror();
  void* handle = ::dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    const char* err = ::dlerror();
    throw LoadError(
        fmt::format("cannot load the CUDA driver {}: {} (set FORKGUARD_CUDA_DRIVER to its path)",
                    name, err != nullptr ? err : "unknown dlopen error"));
  }
  std::string path = detail::loaded_path_of(handle).value_or(name);
  g_driver = new Driver(handle, std::move(path));
  return *g_driver;
}

const Driver* Driver::if_mapped() {
  std::lock_guard lock(g_mutex);
  if (g_driver != nullptr) return g_driver;
  for (const auto& lib : detail::loaded_libraries()) {
    if (!detail::is_cuda_driver_library(lib)) continue;
    // RTLD_NOLOAD: bind to the copy already in memory; loads nothing and runs no initializer.
    void* handle = ::dlopen(lib.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (handle == nullptr) continue;
    try {
      g_driver = new Driver(handle, lib);
    } catch (const LoadError&) {
      continue;  // a library named like the driver that is not one (a stub, a shim): not ours
    }
    return g_driver;
  }
  return nullptr;
}

void Driver::check(CUresult result, const char* call) const {
  if (result != CUDA_SUCCESS) throw DriverError(call, result);
}

}  // namespace forkguard::cuda
