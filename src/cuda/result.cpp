#include <fmt/format.h>

#include <string>

#include "forkguard/cuda/driver.hpp"

namespace forkguard::cuda {
namespace {

struct ResultInfo {
  CUresult value;
  const char* name;
  const char* text;
};

// Texts as cuGetErrorString documents them; kept here so a poisoned process (where every driver
// call, cuGetErrorString included, may fail) still gets a readable message.
constexpr ResultInfo kResults[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_STUB_LIBRARY, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
     "context already current"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
     "pointer does not correspond to a registered memory region"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

const ResultInfo* find(CUresult r) {
  for (const auto& info : kResults) {
    if (info.value == r) return &info;
  }
  return nullptr;
}

}  // namespace

std::string result_name(CUresult result) {
  if (const auto* info = find(result)) return info->name;
  return fmt::format("CUresult({})", static_cast<int>(result));
}

std::string result_string(CUresult result) {
  if (const auto* info = find(result)) return info->text;
  // Not in our table: ask the driver if it is already here (cuGetErrorString initializes nothing).
  if (const auto* drv = Driver::if_mapped()) {
    const char* text = nullptr;
    if (drv->api().cuGetErrorString(result, &text) == CUDA_SUCCESS && text != nullptr) return text;
  }
  return "unrecognized error code";
}

DriverError::DriverError(std::string call, CUresult result, std::string context)
    : Error(fmt::format("{} failed: {} ({}): {}{}", call, result_name(result),
                        static_cast<int>(result), result_string(result),
                        context.empty() ? std::string() : " (" + context + ")")),
      call_(std::move(call)),
      result_(result) {}

}  // namespace forkguard::cuda
