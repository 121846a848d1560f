#include "data/device.hpp"

namespace forkguard::data::detail {

DeviceStage::DeviceStage(int ordinal, size_t buffers, const SlotLayout& layout)
    : pinning_(ordinal),
      driver_(pinning_.driver()),
      ordinal_(ordinal),
      layout_(layout),
      context_(pinning_.context()) {
  bind();
  driver_.check(driver_.api().cuStreamCreate(&stream_, kCuStreamNonBlocking), "cuStreamCreate");
  std::lock_guard lock(mutex_);
  for (size_t i = 0; i < buffers; ++i) create_buffer();
}

DeviceStage::~DeviceStage() {
  const auto& api = driver_.api();
  api.cuCtxSetCurrent(context_);  // unchecked: a destructor has no one to report to
  api.cuStreamSynchronize(stream_);
  for (auto& b : buffers_) {
    // Work on the users' streams (Batch::record_stream) may still read the buffer.
    for (size_t k = 0; k < b->pending; ++k) api.cuEventSynchronize(b->after_users[k]);
    api.cuEventDestroy_v2(b->event);
    for (CUevent e : b->after_users) api.cuEventDestroy_v2(e);
    api.cuMemFree_v2(b->images);
    api.cuMemFree_v2(b->labels);
  }
  api.cuStreamDestroy_v2(stream_);
}  // pinning_ releases the primary context

void DeviceStage::bind() const {
  driver_.check(driver_.api().cuCtxSetCurrent(context_), "cuCtxSetCurrent");
}

int DeviceStage::create_buffer() {
  const auto& api = driver_.api();
  auto b = std::make_unique<Buffer>();
  driver_.check(api.cuMemAlloc_v2(&b->images, layout_.batch_size * layout_.sample_bytes),
                "cuMemAlloc_v2");
  driver_.check(api.cuMemAlloc_v2(&b->labels, layout_.batch_size * sizeof(int64_t)),
                "cuMemAlloc_v2");
  driver_.check(api.cuEventCreate(&b->event, kCuEventDisableTiming), "cuEventCreate");
  buffers_.push_back(std::move(b));
  return static_cast<int>(buffers_.size()) - 1;
}

void DeviceStage::pin(Slot& slot) {
  pinning_.pin(slot.memory.data(), slot.memory.size());
  slot.pinned = true;
}

void DeviceStage::unpin(Slot& slot) noexcept {
  if (!slot.pinned) return;
  pinning_.unpin(slot.memory.data());
  slot.pinned = false;
}

int DeviceStage::acquire(bool grow) {
  std::lock_guard lock(mutex_);
  for (size_t i = 0; i < buffers_.size(); ++i) {
    if (buffers_[i]->free) {
      buffers_[i]->free = false;
      return static_cast<int>(i);
    }
  }
  if (!grow) return -1;
  bind();
  int id = create_buffer();
  buffers_[static_cast<size_t>(id)]->free = false;
  return id;
}

void DeviceStage::release(int buffer, const std::vector<uintptr_t>& users) noexcept {
  std::lock_guard lock(mutex_);
  Buffer& b = *buffers_[static_cast<size_t>(buffer)];
  b.pending = 0;
  // A buffer whose users could be neither recorded nor waited for may still be read: it never
  // returns to the pool (a device buffer lost, rather than a batch's bytes overwritten).
  if (!users.empty() && !guard(b, users)) return;
  b.free = true;
}

bool DeviceStage::guard(Buffer& b, const std::vector<uintptr_t>& users) noexcept {
  // Any thread may release (a tensor's deleter): this context is made current for the calls,
  // and the thread's own is restored after.
  const auto& api = driver_.api();
  CUcontext previous = nullptr;
  const bool had = api.cuCtxGetCurrent(&previous) == CUDA_SUCCESS;
  if (api.cuCtxSetCurrent(context_) != CUDA_SUCCESS) return false;
  bool ok = true;
  for (uintptr_t u : users) {
    if (u == kPerThreadStream) {
      // The releasing thread's per-thread stream is not the user's: wait for the whole context.
      ok = api.cuCtxSynchronize() == CUDA_SUCCESS && ok;
      continue;
    }
    auto stream = reinterpret_cast<CUstream>(u);
    if (b.pending == b.after_users.size()) {
      CUevent e = nullptr;
      if (api.cuEventCreate(&e, kCuEventDisableTiming) == CUDA_SUCCESS) {
        try {
          b.after_users.push_back(e);
        } catch (...) {
          api.cuEventDestroy_v2(e);
        }
      }
    }
    if (b.pending < b.after_users.size() &&
        api.cuEventRecord(b.after_users[b.pending], stream) == CUDA_SUCCESS) {
      ++b.pending;
    } else if (api.cuStreamSynchronize(stream) != CUDA_SUCCESS &&
               api.cuCtxSynchronize() != CUDA_SUCCESS) {
      ok = false;
    }
  }
  if (had) api.cuCtxSetCurrent(previous);
  return ok;
}

void DeviceStage::copy(const Slot& slot, int buffer, size_t count) {
  const auto& api = driver_.api();
  Buffer* b;
  {
    std::lock_guard lock(mutex_);
    b = buffers_[static_cast<size_t>(buffer)].get();
  }
  bind();
  // Work on other streams that read the buffer's previous batch (Batch::record_stream) comes
  // first.
  for (; b->pending > 0; --b->pending) {
    driver_.check(api.cuStreamWaitEvent(stream_, b->after_users[b->pending - 1], 0),
                  "cuStreamWaitEvent");
  }
  driver_.check(api.cuMemcpyHtoDAsync_v2(b->images, slot.memory.data(),
                                         count * layout_.sample_bytes, stream_),
                "cuMemcpyHtoDAsync_v2");
  driver_.check(api.cuMemcpyHtoDAsync_v2(b->labels, slot.memory.data() + layout_.labels_offset,
                                         count * sizeof(int64_t), stream_),
                "cuMemcpyHtoDAsync_v2");
  driver_.check(api.cuEventRecord(b->event, stream_), "cuEventRecord");
}

bool DeviceStage::complete(int buffer) {
  CUevent ev;
  {
    std::lock_guard lock(mutex_);
    ev = buffers_[static_cast<size_t>(buffer)]->event;
  }
  bind();
  CUresult r = driver_.api().cuEventQuery(ev);
  if (r == CUDA_ERROR_NOT_READY) return false;
  driver_.check(r, "cuEventQuery");
  return true;
}

void DeviceStage::wait(int buffer) {
  CUevent ev;
  {
    std::lock_guard lock(mutex_);
    ev = buffers_[static_cast<size_t>(buffer)]->event;
  }
  bind();
  driver_.check(driver_.api().cuEventSynchronize(ev), "cuEventSynchronize");
}

CUdeviceptr DeviceStage::images(int buffer) const {
  std::lock_guard lock(mutex_);
  return buffers_[static_cast<size_t>(buffer)]->images;
}

CUdeviceptr DeviceStage::labels(int buffer) const {
  std::lock_guard lock(mutex_);
  return buffers_[static_cast<size_t>(buffer)]->labels;
}

size_t DeviceStage::buffers() const {
  std::lock_guard lock(mutex_);
  return buffers_.size();
}

}  // namespace forkguard::data::detail
