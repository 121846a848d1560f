#include "cuda/host_pinning.hpp"

#include <fmt/format.h>

namespace forkguard::cuda {
namespace {
constexpr unsigned kHostRegisterPortable = 0x01;  // CU_MEMHOSTREGISTER_PORTABLE
}  // namespace

// The primary context current on this thread for one call; the thread's own restored after.
class HostPinning::Current {
 public:
  Current(const DriverApi& api, CUcontext ctx) : api_(api) {
    if (api_.cuCtxGetCurrent(&before_) != CUDA_SUCCESS) before_ = nullptr;
    ok_ = api_.cuCtxSetCurrent(ctx) == CUDA_SUCCESS;
  }
  ~Current() {
    if (ok_) api_.cuCtxSetCurrent(before_);
  }
  Current(const Current&) = delete;
  Current& operator=(const Current&) = delete;
  bool ok() const { return ok_; }

 private:
  const DriverApi& api_;
  CUcontext before_ = nullptr;
  bool ok_ = false;
};

HostPinning::HostPinning(int ordinal) : driver_(Driver::load()) {
  const auto& api = driver_.api();
  driver_.check(api.cuInit(0), "cuInit");
  int count = 0;
  driver_.check(api.cuDeviceGetCount(&count), "cuDeviceGetCount");
  if (ordinal < 0 || ordinal >= count) {
    throw Error(fmt::format("CUDA device {} does not exist ({} visible)", ordinal, count));
  }
  driver_.check(api.cuDeviceGet(&device_, ordinal), "cuDeviceGet");
  driver_.check(api.cuDevicePrimaryCtxRetain(&context_, device_), "cuDevicePrimaryCtxRetain");
}

HostPinning::~HostPinning() {
  driver_.api().cuDevicePrimaryCtxRelease_v2(device_);
}

void HostPinning::pin(void* p, size_t bytes) {
  const auto& api = driver_.api();
  Current current(api, context_);
  if (!current.ok()) driver_.check(api.cuCtxSetCurrent(context_), "cuCtxSetCurrent");
  driver_.check(api.cuMemHostRegister_v2(p, bytes, kHostRegisterPortable), "cuMemHostRegister_v2");
}

void HostPinning::unpin(void* p) noexcept {
  Current current(driver_.api(), context_);
  if (current.ok()) driver_.api().cuMemHostUnregister(p);  // unchecked: no one to report to
}

}  // namespace forkguard::cuda
