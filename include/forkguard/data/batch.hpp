// A batch delivered by the Loader: the samples' outputs, labels and keys, on the host (in the
// shared-memory slot the workers wrote) or on the GPU (after the loader's pinned copy).
//
//   while (auto batch = loader.next()) {
//     DLManagedTensor* images = batch->images_dlpack();   // torch.from_dlpack takes it, no copy
//     const int64_t* labels = batch->labels();            // host view (labels also on the host)
//     for (const auto& s : batch->skipped()) log(s.index, s.reason);
//   }
//
// A Batch is a cheap handle (copies share the memory). The memory stays valid while a Batch
// handle or an exported DLPack tensor lives; when the last one goes (the tensor's deleter runs),
// the slot returns to the loader for reuse. Device batches: the copy was enqueued on stream();
// work on another stream must wait for it (synchronize() waits on the host), and work that may
// still run after the batch is released must be named with record_stream().
//
// Thread-safety: handles and tensors may be released from any thread; one handle is not to be
// used from two threads at once.
#pragma once

#include <dlpack/dlpack.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "forkguard/data/transform.hpp"

namespace forkguard::data {

namespace detail {
struct BatchStorage;
}

// A sample the `skip` policy replaced.
struct SkippedSample {
  size_t position = 0;    // its place in the batch
  size_t index = 0;       // the dataset index that failed
  std::string key;        // its key (Dataset::key)
  std::string reason;     // what failed
  size_t substitute = 0;  // the dataset index whose output took its place
  bool operator==(const SkippedSample&) const = default;
};

enum class Placement { kHost, kDevice };

class Batch {
 public:
  Batch() = default;
  explicit Batch(std::shared_ptr<detail::BatchStorage> storage) : s_(std::move(storage)) {}

  size_t size() const;    // samples in this batch
  size_t number() const;  // its position in the epoch (0-based)
  uint64_t epoch() const;
  const std::vector<size_t>& indices() const;  // the dataset indices, in batch order
  const std::vector<SkippedSample>& skipped() const;
  const OutputSpec& spec() const;  // per-sample output

  Placement placement() const;
  int device() const;        // the CUDA ordinal for kDevice, -1 on the host
  uintptr_t stream() const;  // the CUstream the copy was enqueued on; 0 on the host
  void synchronize() const;  // waits until the device copy is complete (no-op on the host)
  // Work enqueued on `stream` (a CUstream of this device's primary context, or CU_STREAM_LEGACY)
  // reads this device batch, as PyTorch's Tensor.record_stream says: when the batch is released,
  // the loader records an event on `stream`, and its next copy into this device memory waits for
  // it (cuStreamWaitEvent), so work still queued there reads this batch's bytes, not the next's.
  // The stream must outlive the batch. CU_STREAM_PER_THREAD names a thread's stream that the
  // releasing thread cannot reach: the release then waits for the whole context on the host.
  // If no event can be recorded, the release waits for the stream on the host; if even that
  // fails, the device buffer is never reused. No-op on the host.
  void record_stream(uintptr_t stream) const;

  // Images: [size, spec.shape...] of spec.dtype; a host pointer or a CUdeviceptr.
  void* images_data() const;
  size_t images_bytes() const;
  // Labels, always readable on the host (also on the device for kDevice batches).
  const int64_t* labels() const;
  std::string_view key(size_t i) const;

  // New DLPack tensors over this batch's memory; the caller owns them (call ->deleter). Keys are
  // a uint8 [size, key_bytes] tensor of NUL-padded strings, on the host.
  DLManagedTensor* images_dlpack() const;
  DLManagedTensor* labels_dlpack() const;
  DLManagedTensor* keys_dlpack() const;

  explicit operator bool() const { return s_ != nullptr; }

 private:
  const detail::BatchStorage& s() const;
  std::shared_ptr<detail::BatchStorage> s_;
};

}  // namespace forkguard::data
