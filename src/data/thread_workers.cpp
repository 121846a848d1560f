#include <fmt/format.h>
#include <unistd.h>

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

class ThreadWorkers : public Workers {
 public:
  explicit ThreadWorkers(const WorkerSetup& setup)
      : setup_(setup), producer_(*setup.dataset, *setup.transform, setup.producer) {
    WorkerInit init = setup.worker_init.empty() ? nullptr : find_worker_init(setup.worker_init);
    queues_.resize(static_cast<size_t>(setup.workers));
    for (auto& q : queues_) q = std::make_unique<Queue>();
    threads_.reserve(static_cast<size_t>(setup.workers));
    try {
      for (int w = 0; w < setup.workers; ++w) {
        threads_.emplace_back([this, w, init] { run(w, init); });
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
    auto& q = *queues_[static_cast<size_t>(worker)];
    {
      std::lock_guard lock(q.mutex);
      q.tasks.push_back(std::move(task));
    }
    q.cv.notify_one();
  }

  std::optional<WorkerEvent> wait(std::optional<Clock::time_point> deadline) override {
    std::unique_lock lock(events_mutex_);
    auto ready = [&] { return !events_.empty(); };
    if (deadline) {
      if (!events_cv_.wait_until(lock, *deadline, ready)) return std::nullopt;
    } else {
      events_cv_.wait(lock, ready);
    }
    WorkerEvent e = std::move(events_.front());
    events_.pop_front();
    return e;
  }

  void stop(bool = false) override {  // a thread cannot be killed: it finishes its task
    for (auto& q : queues_) {
      {
        std::lock_guard lock(q->mutex);
        q->stop = true;
      }
      q->cv.notify_all();
    }
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
    threads_.clear();
  }

  pid_t pid(int) const override { return ::getpid(); }
  std::vector<pid_t> pids() const override { return {}; }

 private:
  struct Queue {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<Task> tasks;
    bool stop = false;
  };

  void post(WorkerEvent e) {
    {
      std::lock_guard lock(events_mutex_);
      events_.push_back(std::move(e));
    }
    events_cv_.notify_one();
  }

  void run(int w, WorkerInit init) {
    if (init != nullptr) {
      try {
        init(WorkerInfo{w, setup_.workers,
                        sample_key(setup_.producer.seed, setup_.epoch, static_cast<uint64_t>(w), 1),
                        setup_.epoch, WorkerKind::kThread});
      } catch (const std::exception& e) {
        WorkerEvent died;
        died.kind = WorkerEvent::Kind::kDied;
        died.worker = w;
        died.how = fmt::format("its init hook \"{}\" threw: {}", setup_.worker_init, e.what());
        post(std::move(died));
        return;
      }
    }
    auto& q = *queues_[static_cast<size_t>(w)];
    while (true) {
      Task task;
      auto idle_from = Clock::now();
      {
        std::unique_lock lock(q.mutex);
        q.cv.wait(lock, [&] { return q.stop || !q.tasks.empty(); });
        if (q.stop) return;
        task = std::move(q.tasks.front());
        q.tasks.pop_front();
      }
      uint64_t idle = static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - idle_from).count());
      std::byte* base = setup_.pool->get(task.slot).memory.data();
      WorkerEvent e;
      e.worker = w;
      e.batch = task.batch;
      e.slot = task.slot;
      e.idle_ns = idle;
      try {
        e.result = producer_.run(task.epoch, task.indices, base, task.first, task.shared);
      } catch (const std::exception& ex) {  // not a sample's fault (those are caught per sample)
        e.result.kind = TaskResult::Kind::kInternal;
        e.result.message = ex.what();
      }
      post(std::move(e));
    }
  }

  WorkerSetup setup_;
  Producer producer_;
  std::vector<std::unique_ptr<Queue>> queues_;
  std::vector<std::thread> threads_;
  std::mutex events_mutex_;
  std::condition_variable events_cv_;
  std::deque<WorkerEvent> events_;
};

}  // namespace

std::unique_ptr<Workers> start_thread_workers(const WorkerSetup& setup) {
  return std::make_unique<ThreadWorkers>(setup);
}

}  // namespace forkguard::data::detail
