// Host memory page-locked for the GPU in this process (cuMemHostRegister, portable to every
// context): a copy from it to a device is a DMA without a staging copy, and PyTorch's
// Tensor.is_pinned() says True for a tensor viewing it. The device's primary context is retained
// while the object lives; each call makes it current for its duration only, leaving the calling
// thread's own current context as it was (PyTorch's, say).
#pragma once

#include <cstddef>

#include "forkguard/cuda/driver.hpp"

namespace forkguard::cuda {

class HostPinning {
 public:
  // Loads and initializes the driver (in this process) and retains the primary context of the
  // visible device `ordinal`. Throws LoadError / DriverError naming the call, or Error for a
  // device that does not exist.
  explicit HostPinning(int ordinal);
  ~HostPinning();  // every pin() must have been undone
  HostPinning(const HostPinning&) = delete;
  HostPinning& operator=(const HostPinning&) = delete;

  // Throws DriverError naming cuMemHostRegister_v2.
  void pin(void* p, size_t bytes);
  void unpin(void* p) noexcept;  // before the memory is unmapped

  const Driver& driver() const { return driver_; }
  CUcontext context() const { return context_; }  // the device's primary context

 private:
  class Current;
  const Driver& driver_;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
};

}  // namespace forkguard::cuda
