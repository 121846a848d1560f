#include "data/slot.hpp"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "forkguard/error.hpp"

namespace forkguard::data::detail {
namespace {

size_t round_up(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

}  // namespace

SlotLayout SlotLayout::make(size_t batch_size, size_t sample_bytes, size_t key_bytes) {
  SlotLayout l;
  l.batch_size = batch_size;
  l.sample_bytes = sample_bytes;
  l.key_bytes = key_bytes;
  l.labels_offset = round_up(batch_size * sample_bytes, 64);
  l.keys_offset = round_up(l.labels_offset + batch_size * sizeof(int64_t), 64);
  l.claim_offset = round_up(l.keys_offset + batch_size * key_bytes, 64);
  l.indices_offset = l.claim_offset + 64;
  l.total = round_up(l.indices_offset + batch_size * sizeof(uint64_t),
                     static_cast<size_t>(::sysconf(_SC_PAGESIZE)));
  return l;
}

Mapping::Mapping(int fd, size_t bytes) : fd_(fd), size_(bytes) {
  // Not populated: the first write to a page allocates it (about 30 ms for a 38 MB batch of
  // float32 224x224 images on our machines), so that happens in the workers that fill the slot, in
  // parallel, instead of in the consumer before the first task can start.
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw SystemError(fmt::format("mmap of a {}-byte slot", bytes), errno);
  data_ = static_cast<std::byte*>(p);
}

Mapping::Mapping(Mapping&& o) noexcept
    : fd_(std::move(o.fd_)),
      data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)) {}

Mapping& Mapping::operator=(Mapping&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) ::munmap(data_, size_);
    fd_ = std::move(o.fd_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

Mapping::~Mapping() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

Mapping create_shared(size_t bytes, const char* name) {
  int fd = ::memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) throw SystemError("memfd_create", errno);
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int e = errno;
    ::close(fd);
    throw SystemError(fmt::format("ftruncate of a {}-byte memfd", bytes), e);
  }
  return Mapping(fd, bytes);
}

SlotPool::~SlotPool() {
  for (auto& s : slots_) {
    if (on_destroy_) on_destroy_(*s);
  }
}

Slot& SlotPool::acquire(int worker, const std::function<void(Slot&)>& on_create) {
  std::unique_lock lock(mutex_);
  if (static_cast<size_t>(worker) >= free_.size()) free_.resize(static_cast<size_t>(worker) + 1);
  auto& list = free_[static_cast<size_t>(worker)];
  if (!list.empty()) {
    int id = list.back();
    list.pop_back();
    return *slots_[static_cast<size_t>(id)];
  }
  lock.unlock();
  auto slot = std::make_unique<Slot>();
  slot->worker = worker;
  slot->memory = create_shared(layout_.total, "forkguard-batch");
  if (on_create) on_create(*slot);
  lock.lock();
  slot->id = static_cast<int>(slots_.size());
  slots_.push_back(std::move(slot));
  return *slots_.back();
}

void SlotPool::release(int id) {
  std::lock_guard lock(mutex_);
  const auto i = static_cast<size_t>(id);
  if (i < holds_.size() && holds_[i] > 0) {
    released_held_[i] = true;
    return;
  }
  free_[static_cast<size_t>(slots_[i]->worker)].push_back(id);
}

void SlotPool::hold(int id) {
  std::lock_guard lock(mutex_);
  const auto i = static_cast<size_t>(id);
  if (holds_.size() <= i) {
    holds_.resize(i + 1, 0);
    released_held_.resize(i + 1, false);
  }
  ++holds_[i];
}

void SlotPool::unhold(int id) {
  std::lock_guard lock(mutex_);
  const auto i = static_cast<size_t>(id);
  if (--holds_[i] == 0 && released_held_[i]) {
    released_held_[i] = false;
    free_[static_cast<size_t>(slots_[i]->worker)].push_back(id);
  }
}

Slot& SlotPool::get(int id) {
  std::lock_guard lock(mutex_);
  return *slots_[static_cast<size_t>(id)];
}

size_t SlotPool::count() const {
  std::lock_guard lock(mutex_);
  return slots_.size();
}

}  // namespace forkguard::data::detail
