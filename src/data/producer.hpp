// The worker side of the loader: fills one batch into its slot. Shared by every worker kind (the
// consumer's thread, worker threads, process workers), so the bytes cannot depend on the kind.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "data/slot.hpp"
#include "forkguard/data/batch.hpp"
#include "forkguard/data/dataset.hpp"
#include "forkguard/data/loader.hpp"
#include "forkguard/data/transform.hpp"

namespace forkguard::data::detail {

struct ProducerConfig {
  uint64_t seed = 0;
  BadSample bad_sample = BadSample::kError;
  size_t max_substitutes = kDefaultMaxSubstitutes;
  SlotLayout layout{};
  bool check_cuda = false;  // process workers: stop when this process gains CUDA state
};

struct TaskResult {
  // kData: a bad sample (the batch is lost, the epoch goes on); kInternal: the task failed outside
  // any sample (the worker is stopped, as for a death); kCuda: the worker gained CUDA state.
  // kCancelled: abandoned between samples (the pool is stopping).
  enum class Kind { kOk, kData, kInternal, kCuda, kCancelled };
  Kind kind = Kind::kOk;
  std::string message;  // what failed, naming the sample where there is one
  size_t index = 0;     // the failing sample
  size_t position = 0;  // and its position in the batch
  std::string key;
  std::vector<SkippedSample> skipped;
  uint64_t read_ns = 0;
  uint64_t transform_ns = 0;
  bool operator==(const TaskResult&) const = default;
};

// Thrown inside the producer when a stage left CUDA state in a process worker: never taken as a
// bad sample.
struct CudaFound {
  std::string message;
};

// nullopt when this process holds no fork-unsafe CUDA state; else a description of the state.
// Cheap (no /proc read) while no library has been loaded since the last clean answer.
std::optional<std::string> cuda_state_if_unsafe();

class Producer {
 public:
  Producer(const Dataset& dataset, const Transform& transform, ProducerConfig config)
      : dataset_(dataset), transform_(transform), config_(config) {}

  struct How {
    // The batch is shared: fill the positions claimed from the slot's counter (other workers
    // claim the rest), not every one.
    bool shared = false;
    // >= 0: the slot's memfd, whose image pages nobody has written yet. The images are then made
    // in a private buffer and written with pwrite(), which allocates the pages without mapping
    // them here: a fresh shared page costs about 1 us that way against 3 us by a write fault (on
    // a VM), and the first batch of a loader writes 9400 of them.
    int fresh_fd = -1;
    // Set: the task is abandoned before its next sample (kCancelled).
    const std::atomic<bool>* cancel = nullptr;
  };

  // Fills batch position k of `slot` with sample indices[k], for every k (or those it claims).
  TaskResult run(uint64_t epoch, const std::vector<size_t>& indices, std::byte* slot,
                 const How& how) const;
  const ProducerConfig& config() const { return config_; }

 private:
  // One sample into its place; throws on a bad sample.
  class ImageOutput;
  void one(uint64_t epoch, size_t index, size_t pos, std::byte* slot, ImageOutput& out,
           TaskResult& r) const;
  void check_cuda(const char* stage_kind, size_t index) const;

  const Dataset& dataset_;
  const Transform& transform_;
  ProducerConfig config_;
};

}  // namespace forkguard::data::detail
