// What a Batch handle shares: the batch's memory (a host slot, or a device buffer), its
// metadata, and the way back to the pools. Destroyed when the last handle or DLPack tensor goes.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "data/device.hpp"
#include "data/slot.hpp"
#include "forkguard/data/batch.hpp"

namespace forkguard::data::detail {

struct BatchStorage {
  size_t count = 0;
  size_t number = 0;
  uint64_t epoch = 0;
  std::vector<size_t> indices;
  std::vector<SkippedSample> skipped;
  OutputSpec spec;
  SlotLayout layout;

  // Host batches: the slot itself.
  std::shared_ptr<SlotPool> pool;
  int slot = -1;
  // Device batches: the device buffer, and host copies of labels and keys (the slot is recycled
  // as soon as the copy completes).
  std::shared_ptr<DeviceStage> device;
  int buffer = -1;
  std::vector<int64_t> labels_copy;
  std::vector<char> keys_copy;
  // Batch::record_stream: other streams reading the buffer (a handle may be const).
  mutable std::mutex streams_mutex;
  mutable std::vector<uintptr_t> streams;

  void* images = nullptr;  // host pointer or CUdeviceptr
  const int64_t* labels = nullptr;
  const char* keys = nullptr;
  uintptr_t device_labels = 0;

  BatchStorage() = default;
  BatchStorage(const BatchStorage&) = delete;
  BatchStorage& operator=(const BatchStorage&) = delete;
  ~BatchStorage() {
    if (pool && slot >= 0) pool->release(slot);
    if (device && buffer >= 0) device->release(buffer, streams);
  }
};

}  // namespace forkguard::data::detail
