// The CUDA driver (libcuda.so.1), loaded at run time: no CUDA toolkit is needed to build forkguard.
//
//   const auto& drv = forkguard::cuda::Driver::load();   // dlopen; throws LoadError if absent
//   drv.check(drv.api().cuInit(0), "cuInit");            // throws DriverError on failure
//   if (const auto* mapped = forkguard::cuda::Driver::if_mapped()) { ... }  // never loads
//
// The library is `FORKGUARD_CUDA_DRIVER` when set, else `libcuda.so.1` from the loader's path.
// `if_mapped()` finds a driver this process already has mapped (by basename `libcuda.so*`, so the
// test driver counts) and binds to it with RTLD_NOLOAD: it never loads nor initializes anything,
// which is what the probe relies on.
//
// Thread-safety: load() and if_mapped() may be called from any thread; the Driver they return is
// immutable and lives until the process exits (the driver is never unloaded).
#pragma once

#include <string>
#include <string_view>

#include "forkguard/cuda/api.hpp"
#include "forkguard/error.hpp"

namespace forkguard::cuda {

// The symbolic name of a CUresult ("CUDA_ERROR_NOT_INITIALIZED"), or "CUresult(N)" if unknown.
std::string result_name(CUresult result);
// The driver's documented text for a CUresult ("initialization error").
std::string result_string(CUresult result);

// A driver call failed: "cuInit failed: CUDA_ERROR_NOT_INITIALIZED (3): initialization error".
class DriverError : public Error {
 public:
  DriverError(std::string call, CUresult result, std::string context = {});
  const std::string& call() const noexcept { return call_; }
  CUresult result() const noexcept { return result_; }

 private:
  std::string call_;
  CUresult result_;
};

// The driver or NVML library could not be loaded, or lacks a symbol; names the paths tried.
class LoadError : public Error {
 public:
  using Error::Error;
};

// The driver's function table. Every pointer is non-null: load() fails if a symbol is missing.
struct DriverApi {
#define FORKGUARD_DECLARE_MEMBER(name, ret, params) PFN_##name name = nullptr;
  FORKGUARD_CUDA_DRIVER_FUNCTIONS(FORKGUARD_DECLARE_MEMBER)
#undef FORKGUARD_DECLARE_MEMBER
};

class Driver {
 public:
  // Loads the driver on first use. Throws LoadError naming the library and dlerror().
  static const Driver& load();
  // The driver if this process already has it mapped, else nullptr. Never loads or initializes.
  static const Driver* if_mapped();

  const std::string& path() const noexcept { return path_; }
  const DriverApi& api() const noexcept { return api_; }

  // Throws DriverError(call, result) unless result is CUDA_SUCCESS.
  void check(CUresult result, const char* call) const;

  Driver(const Driver&) = delete;
  Driver& operator=(const Driver&) = delete;

 private:
  Driver(void* handle, std::string path);
  void* handle_;
  std::string path_;
  DriverApi api_;
};

// The library the loader would open: FORKGUARD_CUDA_DRIVER, else "libcuda.so.1".
std::string driver_library_name();

}  // namespace forkguard::cuda
