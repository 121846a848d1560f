// Worker pools behind the loader: threads or processes. The loader hands each worker tasks (a
// batch's indices and the slot to fill) and waits for events: a finished task, or a worker that
// died. A pool never decides what to do about a failure; the loader does.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/producer.hpp"
#include "data/slot.hpp"
#include "forkguard/data/loader.hpp"

namespace forkguard::data::detail {

using Clock = std::chrono::steady_clock;

struct Task {
  uint64_t epoch = 0;
  size_t batch = 0;
  int slot = 0;
  std::vector<size_t> indices;  // the whole batch's, in position order
  // The batch is shared by several workers: `indices` is all of it, and each worker claims its
  // next position from the slot's counter (set to 0 by the loader) until none is left.
  bool shared = false;
  // No worker has written the slot's images yet: they go through its fd (Producer::run).
  bool fresh = false;
};

struct WorkerEvent {
  enum class Kind { kDone, kDied };
  Kind kind = Kind::kDone;
  int worker = 0;
  // kDone
  size_t batch = 0;
  int slot = 0;
  TaskResult result;
  uint64_t idle_ns = 0;  // the worker's wait for this task
  // kDied: "was killed by signal 9 (SIGKILL)", "exited with code 3", or the reason it stopped
  std::string how;
};

class Workers {
 public:
  virtual ~Workers() = default;
  virtual void submit(int worker, Task task) = 0;
  // Waits until every worker has built its pipeline (tasks may be submitted before: they wait in
  // the worker's queue); throws WorkerError naming each worker that could not start.
  virtual void await_started() {}
  // The next event; nullopt when `deadline` passed first.
  virtual std::optional<WorkerEvent> wait(std::optional<Clock::time_point> deadline) = 0;
  // Stops every worker and waits for them. Gracefully (each finishes its task and exits), or
  // `now`: process workers are killed at once (their tasks are being abandoned anyway).
  virtual void stop(bool now = false) = 0;
  virtual pid_t pid(int worker) const = 0;      // the process, or this process for threads
  virtual std::vector<pid_t> pids() const = 0;  // running worker processes
};

// Everything a worker needs, whatever its kind.
struct WorkerSetup {
  const Dataset* dataset = nullptr;
  const Transform* transform = nullptr;
  ProducerConfig producer{};
  int workers = 1;
  uint64_t epoch = 0;
  std::string worker_init;  // registered hook name
  std::shared_ptr<SlotPool> pool;
  std::chrono::milliseconds start_timeout{0};  // for a worker's start; 0: as long as it takes
  // Keeps the dataset and transform alive for a thread worker left behind in a task.
  std::shared_ptr<const void> keep_alive{};
};

WorkerInit find_worker_init(const std::string& name);  // throws DataError when unknown

std::unique_ptr<Workers> start_thread_workers(const WorkerSetup& setup);
// Throws DataError/WorkerError when a worker cannot start (init hook, CUDA, unknown types).
std::unique_ptr<Workers> start_process_workers(const WorkerSetup& setup, ProcessStart start);

}  // namespace forkguard::data::detail
