#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>

#include "data/workers.hpp"
#include "forkguard/data/error.hpp"

namespace forkguard::data::detail {
namespace {

using namespace std::chrono_literals;

// How long stop(now) waits for a busy thread to finish its task before leaving it behind.
constexpr auto kStopGrace = 50ms;

// Everything a worker thread touches, owned jointly by the pool and its threads: a thread stuck
// in a task (a transform that never returns) can be left behind by stop(now), and whatever it
// still uses (the dataset, the transform, its slot, these queues) stays alive until it returns.
struct Shared {
  struct Queue {
    std::deque<Task> tasks;
    bool stop = false;
  };

  explicit Shared(const WorkerSetup& s)
      : setup(s), producer(*s.dataset, *s.transform, s.producer) {}

  WorkerSetup setup;
  Producer producer;
  std::mutex mutex;  // guards everything below but `cancel`
  std::condition_variable work;
  std::vector<Queue> queues;
  std::vector<int> busy;         // per worker: the slot of its task in progress, or -1
  std::vector<bool> left;        // per worker: left behind by stop(now), its slot held
  std::vector<bool> exited;      // per worker: its thread has returned
  std::condition_variable done;  // a thread exited
  std::condition_variable events_cv;
  std::deque<WorkerEvent> events;
  std::atomic<bool> cancel{false};  // stop(now): tasks end before their next sample

  void post(WorkerEvent e) {
    {
      std::lock_guard lock(mutex);
      events.push_back(std::move(e));
    }
    events_cv.notify_one();
  }
};

void run(const std::shared_ptr<Shared>& sh, int w, WorkerInit init) {
  const auto ws = static_cast<size_t>(w);
  struct Exit {  // whatever way the thread returns
    Shared& sh;
    size_t w;
    ~Exit() {
      {
        std::lock_guard lock(sh.mutex);
        sh.exited[w] = true;
      }
      sh.done.notify_all();
    }
  } on_exit{*sh, ws};
  const auto& setup = sh->setup;
  if (init != nullptr) {
    try {
      init(WorkerInfo{w, setup.workers,
                      sample_key(setup.producer.seed, setup.epoch, static_cast<uint64_t>(w), 1),
                      setup.epoch, WorkerKind::kThread});
    } catch (const std::exception& e) {
      WorkerEvent died;
      died.kind = WorkerEvent::Kind::kDied;
      died.worker = w;
      died.how = fmt::format("its init hook \"{}\" threw: {}", setup.worker_init, e.what());
      sh->post(std::move(died));
      return;
    }
  }
  while (true) {
    Task task;
    auto idle_from = Clock::now();
    {
      std::unique_lock lock(sh->mutex);
      auto& q = sh->queues[ws];
      sh->work.wait(lock, [&] { return q.stop || !q.tasks.empty(); });
      if (q.stop) return;
      task = std::move(q.tasks.front());
      q.tasks.pop_front();
      sh->busy[ws] = task.slot;
    }
    uint64_t idle = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - idle_from).count());
    const Mapping& memory = setup.pool->get(task.slot).memory;
    WorkerEvent e;
    e.worker = w;
    e.batch = task.batch;
    e.slot = task.slot;
    e.idle_ns = idle;
    try {
      e.result = sh->producer.run(task.epoch, task.indices, memory.data(),
                                  {.shared = task.shared,
                                   .fresh_fd = task.fresh ? memory.fd() : -1,
                                   .cancel = &sh->cancel});
    } catch (const std::exception& ex) {  // not a sample's fault (those are caught per sample)
      e.result.kind = TaskResult::Kind::kInternal;
      e.result.message = ex.what();
    }
    bool was_left = false;
    {
      std::lock_guard lock(sh->mutex);
      sh->busy[ws] = -1;
      was_left = sh->left[ws];
    }
    if (was_left) {  // nobody waits for this batch: give its slot back to the pool, and stop
      setup.pool->unhold(task.slot);
      return;
    }
    sh->post(std::move(e));
  }
}

class ThreadWorkers : public Workers {
 public:
  explicit ThreadWorkers(const WorkerSetup& setup) : sh_(std::make_shared<Shared>(setup)) {
    WorkerInit init = setup.worker_init.empty() ? nullptr : find_worker_init(setup.worker_init);
    const auto n = static_cast<size_t>(setup.workers);
    sh_->queues.resize(n);
    sh_->busy.assign(n, -1);
    sh_->left.assign(n, false);
    sh_->exited.assign(n, false);
    threads_.reserve(n);
    try {
      for (int w = 0; w < setup.workers; ++w) {
        threads_.emplace_back([sh = sh_, w, init] { run(sh, w, init); });
      }
    } catch (const std::system_error& e) {  // out of threads: stop the ones started, then say so
      const size_t started = threads_.size();
      stop();
      throw WorkerError(
          fmt::format("cannot start thread worker {} of {}: {}", started, setup.workers, e.what()),
          static_cast<int>(started), -1, {});
    }
  }

  ~ThreadWorkers() override { stop(); }

  void submit(int worker, Task task) override {
    {
      std::lock_guard lock(sh_->mutex);
      sh_->queues[static_cast<size_t>(worker)].tasks.push_back(std::move(task));
    }
    sh_->work.notify_all();
  }

  std::optional<WorkerEvent> wait(std::optional<Clock::time_point> deadline) override {
    std::unique_lock lock(sh_->mutex);
    auto ready = [&] { return !sh_->events.empty(); };
    if (deadline) {
      if (!sh_->events_cv.wait_until(lock, *deadline, ready)) return std::nullopt;
    } else {
      sh_->events_cv.wait(lock, ready);
    }
    WorkerEvent e = std::move(sh_->events.front());
    sh_->events.pop_front();
    return e;
  }

  // A thread cannot be killed. Gracefully, each finishes its task and returns. `now` (a timeout,
  // a failure, the loader's destruction): each abandons its task before its next sample; a thread
  // still in a sample after a short grace (a transform that hangs) is left behind, its slot held
  // out of the pool until the sample returns, so that nothing waits for it.
  void stop(bool now = false) override {
    {
      std::lock_guard lock(sh_->mutex);
      for (auto& q : sh_->queues) q.stop = true;
    }
    sh_->work.notify_all();
    if (now) {
      sh_->cancel.store(true, std::memory_order_relaxed);
      std::unique_lock lock(sh_->mutex);
      const auto until = Clock::now() + kStopGrace;
      for (size_t w = 0; w < threads_.size(); ++w) {
        sh_->done.wait_until(lock, until, [&] { return sh_->exited[w]; });
        if (!sh_->exited[w]) {  // in a task (its slot is held) or in the init hook
          if (sh_->busy[w] >= 0) sh_->setup.pool->hold(sh_->busy[w]);
          sh_->left[w] = true;
          threads_[w].detach();
        }
      }
    }
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
    threads_.clear();
  }

  pid_t pid(int) const override { return ::getpid(); }
  std::vector<pid_t> pids() const override { return {}; }

 private:
  std::shared_ptr<Shared> sh_;
  std::vector<std::thread> threads_;
};

}  // namespace

std::unique_ptr<Workers> start_thread_workers(const WorkerSetup& setup) {
  return std::make_unique<ThreadWorkers>(setup);
}

}  // namespace forkguard::data::detail
