#include "data/producer.hpp"

#include <fmt/format.h>
#include <link.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <span>

#include "detail/loaded_libraries.hpp"
#include "forkguard/data/error.hpp"
#include "forkguard/data/rng.hpp"
#include "forkguard/probe/cuda_state.hpp"

namespace forkguard::data::detail {
namespace {

using Clock = std::chrono::steady_clock;

uint64_t ns_since(Clock::time_point t) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t).count());
}

// dl_iterate_phdr's load counter: unchanged means no library was loaded since.
unsigned long long loads_so_far() {
  unsigned long long adds = 0;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        *static_cast<unsigned long long*>(data) = info->dlpi_adds;
        return 1;  // the first object carries the counters
      },
      &adds);
  return adds;
}

std::atomic<unsigned long long> g_clean_at{~0ull};  // load count at the last clean answer

}  // namespace

std::optional<std::string> cuda_state_if_unsafe() {
  const auto loads = loads_so_far();
  if (loads == g_clean_at.load(std::memory_order_relaxed)) return std::nullopt;
  auto state = probe::self_if_cuda_unsafe();
  if (!state) {
    // Clean without a driver mapped stays clean until something is loaded; with a driver mapped
    // (loaded, not initialized) every check has to look again.
    auto libs = forkguard::detail::loaded_libraries();
    if (std::none_of(libs.begin(), libs.end(), forkguard::detail::is_cuda_driver_library)) {
      g_clean_at.store(loads, std::memory_order_relaxed);
    }
    return std::nullopt;
  }
  std::string evidence;
  for (const auto& e : state->evidence) {
    if (e.kind != probe::EvidenceKind::kEnvironment) evidence += "; " + e.detail;
  }
  return fmt::format("{}{}", probe::to_string(state->verdict), evidence);
}

void Producer::check_cuda(const char* stage_kind, size_t index) const {
  if (!config_.check_cuda) return;
  auto state = cuda_state_if_unsafe();
  if (!state) return;
  std::string stage = std::strcmp(stage_kind, "transform") == 0
                          ? fmt::format("transform \"{}\"", transform_.name())
                          : std::string("the dataset's read()");
  throw CudaFound{fmt::format(
      "{} initialized CUDA in the worker while processing sample {} ({}): the worker is no "
      "longer fork-safe ({}). Workers must stay CPU-only: do GPU work in the main process "
      "(LoaderOptions::device copies batches to the GPU there)",
      stage, index, dataset_.key(index), *state)};
}

// Where a sample's image goes: straight into the slot, or through a private buffer and pwrite()
// (see Producer::run).
class Producer::ImageOutput {
 public:
  ImageOutput(std::byte* slot, const SlotLayout& l, int fresh_fd)
      : slot_(slot), bytes_(l.sample_bytes) {
    if (fresh_fd < 0) return;
    // A file-size limit applies to memfds too (EFBIG, and SIGXFSZ): direct writes then.
    rlimit fsize{};
    if (::getrlimit(RLIMIT_FSIZE, &fsize) == 0 && fsize.rlim_cur != RLIM_INFINITY &&
        fsize.rlim_cur < l.labels_offset) {
      return;
    }
    fd_ = fresh_fd;
    staging_.reset(new std::byte[bytes_]);  // not cleared: every byte is written before use
  }

  std::span<std::byte> at(size_t pos) {
    return {fd_ >= 0 ? staging_.get() : slot_ + pos * bytes_, bytes_};
  }

  // After the image at(pos) is made. Never fails: pwrite trouble (the memfd's memory limit, say)
  // falls back to the mapping, whose write faults would meet the same limit as they always did.
  void commit(size_t pos) {
    if (fd_ < 0) return;
    size_t done = 0;
    while (done < bytes_) {
      ssize_t w = ::pwrite(fd_, staging_.get() + done, bytes_ - done,
                           static_cast<off_t>(pos * bytes_ + done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        std::memcpy(slot_ + pos * bytes_ + done, staging_.get() + done, bytes_ - done);
        fd_ = -1;
        return;
      }
      done += static_cast<size_t>(w);
    }
  }

 private:
  std::byte* slot_;
  size_t bytes_;
  int fd_ = -1;
  std::unique_ptr<std::byte[]> staging_;
};

void Producer::one(uint64_t epoch, size_t index, size_t pos, std::byte* slot, ImageOutput& out,
                   TaskResult& r) const {
  const auto& l = config_.layout;
  auto t0 = Clock::now();
  Sample sample = dataset_.read(index);
  r.read_ns += ns_since(t0);
  check_cuda("read", index);
  if (sample.key.size() > l.key_bytes) {
    throw DataError(
        fmt::format("its key is {} bytes long, more than LoaderOptions::key_bytes "
                    "({})",
                    sample.key.size(), l.key_bytes));
  }
  Rng rng(config_.seed, epoch, index);
  auto t1 = Clock::now();
  transform_.apply(sample, out.at(pos), rng);
  r.transform_ns += ns_since(t1);
  check_cuda("transform", index);
  out.commit(pos);
  int64_t label = sample.label;
  std::memcpy(slot + l.labels_offset + pos * sizeof(int64_t), &label, sizeof label);
  char* key = reinterpret_cast<char*>(slot + l.keys_offset + pos * l.key_bytes);
  std::memcpy(key, sample.key.data(), sample.key.size());
  std::memset(key + sample.key.size(), 0, l.key_bytes - sample.key.size());
}

TaskResult Producer::run(uint64_t epoch, const std::vector<size_t>& indices, std::byte* slot,
                         const How& how) const {
  TaskResult r;
  const size_t n = dataset_.size();
  const bool shared = how.shared;
  ImageOutput out(slot, config_.layout, how.fresh_fd);

  try {
    // Shared: claims one position at a time, so the workers finish together however the samples'
    // costs fall (the counter lives in the slot, visible to threads and processes alike).
    std::atomic_ref<uint32_t> claim(
        *reinterpret_cast<uint32_t*>(slot + config_.layout.claim_offset));
    for (size_t pos = shared ? claim.fetch_add(1, std::memory_order_relaxed) : 0;
         pos < indices.size();
         pos = shared ? claim.fetch_add(1, std::memory_order_relaxed) : pos + 1) {
      if (how.cancel != nullptr && how.cancel->load(std::memory_order_relaxed)) {
        r.kind = TaskResult::Kind::kCancelled;
        r.message = "abandoned: the workers are stopping";
        return r;
      }
      const size_t index = indices[pos];
      try {
        one(epoch, index, pos, slot, out, r);
        continue;
      } catch (const CudaFound&) {
        throw;
      } catch (const std::exception& e) {
        std::string why = e.what();
        if (config_.bad_sample == BadSample::kError) {
          r.kind = TaskResult::Kind::kData;
          r.index = index;
          r.position = pos;
          r.key = dataset_.key(index);
          r.message = fmt::format("sample {} ({}): {}", index, r.key, why);
          return r;
        }
        // skip: a deterministic substitute, a pure function of (seed, epoch, index, attempt).
        bool replaced = false;
        for (size_t attempt = 0; attempt < config_.max_substitutes && !replaced && n > 1;
             ++attempt) {
          const auto sub =
              static_cast<size_t>(substitute_index(config_.seed, epoch, index, attempt, n));
          try {
            one(epoch, sub, pos, slot, out, r);
            r.skipped.push_back({pos, index, dataset_.key(index), why, sub});
            replaced = true;
          } catch (const CudaFound&) {
            throw;
          } catch (const std::exception&) {
            // this substitute is bad too: try the next one
          }
        }
        if (!replaced) {
          r.kind = TaskResult::Kind::kData;
          r.index = index;
          r.position = pos;
          r.key = dataset_.key(index);
          r.message = fmt::format("sample {} ({}): {}; and no readable substitute in {} tries",
                                  index, r.key, why, config_.max_substitutes);
          return r;
        }
      }
    }
  } catch (const CudaFound& found) {
    r.kind = TaskResult::Kind::kCuda;
    r.message = found.message;
  }
  return r;
}

}  // namespace forkguard::data::detail
