#include "data/device.hpp"

#include <fmt/format.h>

namespace forkguard::data::detail {

DeviceStage::DeviceStage(int ordinal, size_t buffers, const SlotLayout& layout)
    : driver_(cuda::Driver::load()), ordinal_(ordinal), layout_(layout) {
  const auto& api = driver_.api();
  driver_.check(api.cuInit(0), "cuInit");
  int count = 0;
  driver_.check(api.cuDeviceGetCount(&count), "cuDeviceGetCount");
  if (ordinal < 0 || ordinal >= count) {
    throw Error(fmt::format("loader device hand-off: CUDA device {} does not exist ({} visible)",
                            ordinal, count));
  }
  driver_.check(api.cuDeviceGet(&device_, ordinal), "cuDeviceGet");
  driver_.check(api.cuDevicePrimaryCtxRetain(&context_, device_), "cuDevicePrimaryCtxRetain");
  bind();
  driver_.check(api.cuStreamCreate(&stream_, 0x1 /* CU_STREAM_NON_BLOCKING */), "cuStreamCreate");
  std::lock_guard lock(mutex_);
  for (size_t i = 0; i < buffers; ++i) create_buffer();
}

DeviceStage::~DeviceStage() {
  const auto& api = driver_.api();
  api.cuCtxSetCurrent(context_);  // unchecked: a destructor has no one to report to
  api.cuStreamSynchronize(stream_);
  for (auto& b : buffers_) {
    api.cuEventDestroy_v2(b->event);
    for (CUevent e : b->after_users) api.cuEventDestroy_v2(e);
    api.cuMemFree_v2(b->images);
    api.cuMemFree_v2(b->labels);
  }
  api.cuStreamDestroy_v2(stream_);
  api.cuDevicePrimaryCtxRelease_v2(device_);
}

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
  driver_.check(api.cuEventCreate(&b->event, 0x2 /* CU_EVENT_DISABLE_TIMING */), "cuEventCreate");
  buffers_.push_back(std::move(b));
  return static_cast<int>(buffers_.size()) - 1;
}

void DeviceStage::pin(Slot& slot) {
  bind();
  driver_.check(driver_.api().cuMemHostRegister_v2(slot.memory.data(), slot.memory.size(), 0),
                "cuMemHostRegister_v2");
  slot.pinned = true;
}

void DeviceStage::unpin(Slot& slot) noexcept {
  if (!slot.pinned) return;
  if (driver_.api().cuCtxSetCurrent(context_) == CUDA_SUCCESS) {
    driver_.api().cuMemHostUnregister(slot.memory.data());
  }
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
  if (!users.empty()) {
    // Any thread may release (a tensor's deleter): the context is made current here. Whatever
    // fails, the buffer must not be reused while the users may still read it: the fallback is to
    // wait for their streams on the host, here.
    const auto& api = driver_.api();
    const bool bound = api.cuCtxSetCurrent(context_) == CUDA_SUCCESS;
    for (uintptr_t u : users) {
      auto stream = reinterpret_cast<CUstream>(u);
      if (bound && b.pending == b.after_users.size()) {
        CUevent e = nullptr;
        if (api.cuEventCreate(&e, 0x2 /* CU_EVENT_DISABLE_TIMING */) == CUDA_SUCCESS) {
          try {
            b.after_users.push_back(e);
          } catch (...) {
            api.cuEventDestroy_v2(e);
          }
        }
      }
      if (bound && b.pending < b.after_users.size() &&
          api.cuEventRecord(b.after_users[b.pending], stream) == CUDA_SUCCESS) {
        ++b.pending;
      } else {
        api.cuStreamSynchronize(stream);
      }
    }
  }
  b.free = true;
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
