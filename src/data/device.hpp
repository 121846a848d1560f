// The GPU hand-off, in the main process only: slots pinned once (cuMemHostRegister), batches
// copied with cuMemcpyHtoDAsync on the loader's stream into device buffers, each copy followed by
// an event that says when its slot may be reused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "cuda/host_pinning.hpp"
#include "data/slot.hpp"
#include "forkguard/cuda/driver.hpp"

namespace forkguard::data::detail {

using namespace forkguard::cuda;  // NOLINT: the driver API's C names (CUstream, ...)

inline constexpr uintptr_t kPerThreadStream = 0x2;  // CU_STREAM_PER_THREAD

class DeviceStage {
 public:
  // Loads the driver, initializes it and retains the device's primary context. Throws
  // cuda::LoadError / cuda::DriverError naming the call, Error for a device that does not exist.
  DeviceStage(int ordinal, size_t buffers, const SlotLayout& layout);
  ~DeviceStage();
  DeviceStage(const DeviceStage&) = delete;
  DeviceStage& operator=(const DeviceStage&) = delete;

  void pin(Slot& slot);
  void unpin(Slot& slot) noexcept;

  // A free device buffer, a new one when `grow` (the consumer holds the others), or -1.
  int acquire(bool grow);
  // Any thread. `users`: streams whose work (enqueued so far) reads the buffer: an event is
  // recorded on each, and the buffer's next copy waits for them on the device. The user streams
  // must still exist (PyTorch's rule for record_stream too).
  void release(int buffer, const std::vector<uintptr_t>& users = {}) noexcept;
  // Enqueues the copy of the slot's first `count` samples and labels into `buffer`, then records
  // the buffer's event.
  void copy(const Slot& slot, int buffer, size_t count);
  bool complete(int buffer);  // the buffer's last copy has finished (cuEventQuery)
  void wait(int buffer);      // cuEventSynchronize

  CUdeviceptr images(int buffer) const;
  CUdeviceptr labels(int buffer) const;
  uintptr_t stream() const { return reinterpret_cast<uintptr_t>(stream_); }
  int ordinal() const { return ordinal_; }
  size_t buffers() const;

 private:
  struct Buffer {
    CUdeviceptr images = 0;
    CUdeviceptr labels = 0;
    CUevent event = nullptr;
    bool free = true;
    std::vector<CUevent> after_users;  // recorded at release on the users' streams
    size_t pending = 0;                // how many of them the next copy waits for
  };
  void bind() const;
  int create_buffer();  // mutex_ held
  // Records an event on each user's stream for the buffer's next copy to wait for; where that
  // fails, waits for the stream (or the context) on the host. False when even that failed.
  bool guard(Buffer& b, const std::vector<uintptr_t>& users) noexcept;  // mutex_ held

  cuda::HostPinning pinning_;  // first: the driver and the primary context, retained
  const cuda::Driver& driver_;
  int ordinal_;
  SlotLayout layout_;
  CUcontext context_ = nullptr;
  CUstream stream_ = nullptr;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
};

}  // namespace forkguard::data::detail
