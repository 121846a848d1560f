// The data loader: CPU-only workers fill shared-memory slots with batches; the main process
// delivers them in order, optionally after a pinned copy to the GPU.
//
//   int main(int argc, char** argv) {
//     forkguard::init(argc, argv);      // starts the fork server process workers come from
//     auto ds = std::make_shared<forkguard::data::SyntheticDataset>(
//         forkguard::data::SyntheticOptions{.size = 10000, .sample_bytes = 3 * 32 * 32});
//     auto tf = std::make_shared<forkguard::data::CopyTransform>(
//         forkguard::data::OutputSpec{.shape = {3, 32, 32}});
//     forkguard::data::Loader loader(ds, tf, {.batch_size = 64, .workers = 4,
//                                             .worker_kind = forkguard::data::WorkerKind::kProcess,
//                                             .shuffle = true, .seed = 1});
//     for (int epoch = 0; epoch < 3; ++epoch) {
//       while (auto batch = loader.next()) train(*batch);   // nullopt ends the epoch
//     }
//   }
//
// Workers: threads (default: nothing to fork), or processes for isolation. Process workers come
// from the fork server (CUDA-clean even when this process already uses the GPU; the dataset and
// transform are rebuilt there from describe()), or, while this process is still CUDA-clean, by a
// guarded fork that inherits the objects. Workers write into memfd slots whose fds travel over
// SCM_RIGHTS; only small completion messages come back.
//
// Determinism: the batches depend only on (dataset, transform, seed, epoch, batch size, sampler),
// never on the number or kind of workers.
//
// Thread-safety: one consumer thread calls next(); Batch handles and DLPack tensors may be
// released from any thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "forkguard/data/batch.hpp"
#include "forkguard/data/dataset.hpp"
#include "forkguard/data/error.hpp"
#include "forkguard/data/sampler.hpp"
#include "forkguard/data/transform.hpp"

namespace forkguard::data {

enum class WorkerKind { kThread, kProcess };
// How process workers start. kAuto: the fork server when init() started one and the dataset and
// transform describe() themselves, else a guarded fork.
enum class ProcessStart { kAuto, kForkServer, kFork };
enum class BadSample { kError, kSkip };
// BadSample::kSkip: how many substitutes (substitute_index in rng.hpp) are tried by default before
// a sample is given up on; forkguard.DataLoader's too (forkguard._native.MAX_SUBSTITUTES).
inline constexpr size_t kDefaultMaxSubstitutes = 16;
enum class Delivery { kInOrder, kAsReady };

// Given to the worker init hook, once per worker.
struct WorkerInfo {
  int id = 0;          // 0..workers-1
  int workers = 1;     // how many
  uint64_t seed = 0;   // a seed for this worker: sample_key(options.seed, epoch, id, 1)
  uint64_t epoch = 0;  // the epoch the worker started in
  WorkerKind kind = WorkerKind::kThread;
};
using WorkerInit = void (*)(const WorkerInfo& info);
// Registers a worker init hook by name (PyTorch's worker_init_fn), usable by every worker kind.
// A name registered twice keeps its first hook: the second call returns false and says so on
// stderr, naming both places.
bool register_worker_init(const std::string& name, WorkerInit fn,
                          const char* file = __builtin_FILE(), int line = __builtin_LINE());

struct DeviceOptions {
  bool enabled = false;  // copy batches to the GPU in the main process
  int ordinal = 0;       // the CUDA device (an index into CUDA_VISIBLE_DEVICES)
  size_t buffers = 2;    // device buffers kept ready (double-buffered); more when batches are held
};

// More workers than this is a mistake (a negative count converted, a typo), refused by name.
constexpr size_t kMaxWorkers = 1024;

struct LoaderOptions {
  size_t batch_size = 64;  // samples per batch
  size_t workers = 0;      // 0: the consumer's thread does the work; at most kMaxWorkers
  WorkerKind worker_kind = WorkerKind::kThread;      // threads or processes
  ProcessStart process_start = ProcessStart::kAuto;  // where process workers come from
  size_t prefetch = 2;                               // batches in flight per worker
  bool split_first_batch = true;   // an epoch's first batch is made by every worker, in parts
  bool persistent_workers = true;  // keep workers across epochs
  Delivery delivery = Delivery::kInOrder;  // in order, or as each batch is ready
  std::chrono::milliseconds timeout{0};    // per batch; 0: wait as long as it takes
  // For process workers to start (rebuild the dataset and transform, run the init hook); 0: as
  // long as it takes.
  std::chrono::milliseconds start_timeout{std::chrono::seconds(60)};
  BadSample bad_sample = BadSample::kError;  // raise, or substitute and record
  // skip: tries before giving up on a sample
  size_t max_substitutes = kDefaultMaxSubstitutes;
  uint64_t seed = 0;                         // all randomness derives from it
  bool shuffle = false;                      // RandomSampler(seed) instead of sequential
  bool distributed = false;                  // shard by RANK/WORLD_SIZE (DistributedSampler)
  bool drop_last = false;                    // drop a short last batch
  std::shared_ptr<const Sampler> sampler{};  // overrides shuffle/distributed when set
  std::string worker_init{};                 // a registered hook's name; empty: none
  DeviceOptions device{};                    // GPU hand-off
  size_t key_bytes = 256;                    // room for each key in the slot
  // Where skip notices go (once per skipped index); default: stderr.
  std::function<void(const std::string&)> log{};
};

struct LoaderStats {
  double read_seconds = 0;           // in Dataset::read, summed over workers
  double transform_seconds = 0;      // in Transform::apply, summed over workers
  double slot_wait_seconds = 0;      // workers idle, every slot full (summed over workers)
  double consumer_wait_seconds = 0;  // the consumer blocked in next()
  double copy_seconds = 0;           // enqueueing device copies
  uint64_t batches = 0;              // delivered
  uint64_t samples = 0;              // delivered
  uint64_t skipped = 0;              // replaced under the skip policy
  uint64_t worker_starts = 0;        // workers started
  uint64_t worker_restarts = 0;      // of those, starts after the first set
  size_t slots = 0;                  // shared-memory slots allocated
  size_t slot_bytes = 0;             // bytes per slot
};

namespace detail {
class LoaderImpl;
}

class Loader {
 public:
  Loader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<const Transform> transform,
         LoaderOptions options = {});
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // The next batch of the current epoch; nullopt once the epoch is over (the next call starts
  // the following epoch). Throws DataError (a bad sample: the epoch goes on after it),
  // WorkerError (a worker died or failed: the epoch is over, the next call starts the following
  // one with fresh workers; set_epoch() to replay it), TimeoutError (the same).
  std::optional<Batch> next();
  // The number of the epoch the next call to next() starts (or is in); set it to replay one.
  // Setting it mid-epoch abandons the rest of the current epoch.
  void set_epoch(uint64_t epoch);
  uint64_t epoch() const;
  // Whether an epoch is under way: next() started it and it has neither ended, nor been
  // abandoned (a worker error, a timeout, set_epoch()).
  bool in_epoch() const;

  size_t size() const;  // batches per epoch
  size_t dataset_size() const;
  const OutputSpec& output_spec() const;
  LoaderStats stats() const;
  std::vector<pid_t> worker_pids() const;  // process workers now running (empty for threads)

 private:
  std::unique_ptr<detail::LoaderImpl> impl_;
};

}  // namespace forkguard::data
