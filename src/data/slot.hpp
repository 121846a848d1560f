// Shared-memory slots: one batch each, in a memfd (never a name in /dev/shm anyone could open),
// mapped by the loader and by whichever process worker receives its fd over SCM_RIGHTS.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "detail/fd.hpp"

namespace forkguard::data::detail {

// Where a batch's parts lie in its slot. Images first (page-aligned, for pinning), then labels
// (int64 per sample), then keys (key_bytes per sample, NUL-padded), then the claim counter, then
// the indices of the samples to fill (a task message carries only their count: any batch size
// fits).
struct SlotLayout {
  size_t batch_size = 0;
  size_t sample_bytes = 0;
  size_t key_bytes = 0;
  size_t labels_offset = 0;
  size_t keys_offset = 0;
  size_t claim_offset = 0;    // a uint32 counter: the next position of a batch split over workers
  size_t indices_offset = 0;  // the batch's sample indices (uint64 each), for process workers
  size_t total = 0;           // page multiple

  static SlotLayout make(size_t batch_size, size_t sample_bytes, size_t key_bytes);
};

// A mapping of a memfd: RAII over the fd and the mapping.
class Mapping {
 public:
  Mapping() = default;
  // Maps `fd` (taking ownership) read-write and shared.
  Mapping(int fd, size_t bytes);
  Mapping(Mapping&& o) noexcept;
  Mapping& operator=(Mapping&& o) noexcept;
  ~Mapping();
  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  int fd() const { return fd_.get(); }
  // Closes the fd; the mapping stays (a process holding many slots holds no fd for them).
  void close_fd() { fd_.reset(); }
  // The fd, now the caller's (-1 when closed); the mapping stays.
  int release_fd() { return fd_.release(); }

 private:
  forkguard::detail::UniqueFd fd_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// A new memfd of `bytes`, mapped here (pages allocated on first touch).
Mapping create_shared(size_t bytes, const char* name);

struct Slot {
  int id = 0;
  int worker = 0;  // the worker whose slots it belongs to
  Mapping memory;
  bool pinned = false;
  bool written = false;  // a task has filled it before (the loader's thread only)
};

// Every slot of a loader; shared with the batches so a batch outliving the loader keeps its
// memory. release() may be called from any thread.
class SlotPool {
 public:
  explicit SlotPool(SlotLayout layout) : layout_(layout) {}
  ~SlotPool();
  const SlotLayout& layout() const { return layout_; }

  // A free slot of `worker`, or a new one; `on_create` runs for new slots (pinning).
  Slot& acquire(int worker, const std::function<void(Slot&)>& on_create);
  void release(int id);
  // A held slot is not reused, even once released, until it is unheld (a thread worker left
  // behind in a task still writes into it).
  void hold(int id);
  void unhold(int id);
  Slot& get(int id);
  size_t count() const;
  // Runs before a slot is unmapped (unpinning); set by the device stage.
  void set_on_destroy(std::function<void(Slot&)> fn) { on_destroy_ = std::move(fn); }

 private:
  SlotLayout layout_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<std::vector<int>> free_;  // per worker
  std::vector<int> holds_;              // per slot
  std::vector<bool> released_held_;     // per slot: released while held
  std::function<void(Slot&)> on_destroy_;
};

}  // namespace forkguard::data::detail
