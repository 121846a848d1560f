// data/worker_sockets: the worker pools of one process (the DataLoader's job queues and the image
// loader's process workers) fork copies of it, and a worker that holds another worker's
// loader-side socket keeps that worker from seeing EOF when its loader stops it (it is killed
// after the 2 s grace instead). Pools started from two threads, a pool forking while another stops,
// and the two kinds of pool side by side: no worker holds a socket its loader's process has open,
// each stops at once with exit code 0, and nothing is left behind.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "data/job_workers.hpp"
#include "data/workers.hpp"
#include "forkguard/data/dataset.hpp"
#include "forkguard/data/transform.hpp"
#include "nothing_left.hpp"
#include "process.hpp"

namespace fd = forkguard::data;
namespace fdd = forkguard::data::detail;
namespace ft = forkguard::testing;
using namespace std::chrono_literals;

namespace {

class Echo : public fdd::JobBody {
 public:
  Result run(uint64_t, fdd::JobSlot&, size_t input) override { return {.bytes = input}; }
};

fdd::JobOptions queue_options(int workers) {
  return {.workers = workers,
          .start = fdd::JobStart::kFork,
          .body = [](int) { return std::make_unique<Echo>(); },
          .slot_bytes = 4096};
}

// The sockets (by inode, "socket:[N]") process `pid` has open.
std::set<std::string> sockets_of(pid_t pid) {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", pid), ec)) {
    std::string target = std::filesystem::read_symlink(e.path(), ec).string();
    if (!ec && target.rfind("socket:", 0) == 0) out.insert(target);
  }
  return out;
}

// A worker's own socket is its end of a pair whose other end its loader holds: any socket it
// shares with this process is some loader's end (its own loader's or another's).
void expect_no_worker_holds_a_loader_socket(const std::vector<pid_t>& workers) {
  const auto ours = sockets_of(::getpid());
  for (pid_t pid : workers) {
    const auto theirs = sockets_of(pid);
    std::vector<std::string> shared;
    std::set_intersection(ours.begin(), ours.end(), theirs.begin(), theirs.end(),
                          std::back_inserter(shared));
    EXPECT_EQ(shared, std::vector<std::string>{})
        << "worker " << pid << " holds sockets of its loader's process";
  }
}

template <class Pool>
void expect_stops_at_once(Pool& pool, const char* what) {
  const auto t0 = std::chrono::steady_clock::now();
  pool.stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s)
      << what << " waited for its workers' EOF (the 2 s grace, then SIGKILL)";
}

void expect_exited_cleanly(fdd::JobQueue& q, int workers) {
  for (int w = 0; w < workers; ++w) {
    auto s = q.exit_status(w, 0ms);
    ASSERT_TRUE(s);
    EXPECT_EQ(s->to_string(), "exited with code 0");
  }
}

// The image loader's process workers, forked from this process.
struct ImageWorkers {
  fd::SyntheticDataset dataset{{.size = 16, .sample_bytes = 64}};
  fd::CopyTransform transform{{{64}, fd::DType::kUInt8, fd::Layout::kAny}};
  std::unique_ptr<fdd::Workers> workers;

  explicit ImageWorkers(int n) {
    fdd::WorkerSetup setup;
    setup.dataset = &dataset;
    setup.transform = &transform;
    setup.producer.layout = fdd::SlotLayout::make(4, 64, 16);
    setup.workers = n;
    setup.pool = std::make_shared<fdd::SlotPool>(setup.producer.layout);
    workers = fdd::start_process_workers(setup, fd::ProcessStart::kFork);
    workers->await_started();
  }
  void stop() { workers->stop(); }
};

// Every test leaves no child and no fd behind.
class WorkerSockets : public ft::NothingLeft {};

// One thread's queue forks its first worker while another thread starts a queue. The fork is
// preceded by before_fork (in Python, PyOS_BeforeFork runs the interpreter's at-fork handlers,
// during which other threads run): what the worker must not hold is what is open at the fork.
TEST_F(WorkerSockets, AQueueForkedWhileAnotherThreadStartsOneHoldsNoneOfItsSockets) {
  std::mutex m;
  std::condition_variable cv;
  bool go = false, started = false, first = true;
  std::unique_ptr<fdd::JobQueue> b;
  std::thread other([&] {
    {
      std::unique_lock lock(m);
      cv.wait(lock, [&] { return go; });
    }
    auto q = std::make_unique<fdd::JobQueue>(queue_options(2));
    q->await_started();
    std::lock_guard lock(m);
    b = std::move(q);
    started = true;
    cv.notify_all();
  });
  auto o = queue_options(2);
  o.before_fork = [&] {
    std::unique_lock lock(m);
    if (!std::exchange(first, false)) return;
    go = true;
    cv.notify_all();
    cv.wait(lock, [&] { return started; });
    lock.unlock();
    // Its work is done: joined before the fork, so a worker copies no thread of this test's
    // (ThreadSanitizer reports such a copy as a leak when the worker exits, and fails it).
    other.join();
  };
  fdd::JobQueue a(std::move(o));
  a.await_started();
  if (other.joinable()) other.join();
  ASSERT_TRUE(b);

  auto pids = a.pids();
  for (pid_t pid : b->pids()) pids.push_back(pid);
  expect_no_worker_holds_a_loader_socket(pids);
  expect_stops_at_once(*b, "the second thread's queue");
  expect_exited_cleanly(*b, 2);
  expect_stops_at_once(a, "the first thread's queue");
  expect_exited_cleanly(a, 2);
}

// A queue forks while another thread stops a queue: the worker closes only what is open at its
// fork, never a number the stopped queue gave back and this fork took again (its own report pipe:
// it exited with code 127 before it was ready).
TEST_F(WorkerSockets, AQueueForkedWhileAnotherStopsStartsItsWorkers) {
  auto b = std::make_unique<fdd::JobQueue>(queue_options(2));
  b->await_started();
  auto o = queue_options(2);
  bool first = true;
  o.before_fork = [&] {
    if (std::exchange(first, false)) std::thread([&] { b.reset(); }).join();
  };
  fdd::JobQueue a(std::move(o));
  EXPECT_NO_THROW(a.await_started());
  expect_no_worker_holds_a_loader_socket(a.pids());
  expect_stops_at_once(a, "the queue");
  expect_exited_cleanly(a, 2);
}

TEST_F(WorkerSockets, AnImageLoadersWorkersHoldNoneOfADataLoadersSockets) {
  fdd::JobQueue q(queue_options(2));
  q.await_started();
  ImageWorkers images(2);
  auto pids = q.pids();
  for (pid_t pid : images.workers->pids()) pids.push_back(pid);
  expect_no_worker_holds_a_loader_socket(pids);
  expect_stops_at_once(q, "the DataLoader's queue");
  expect_exited_cleanly(q, 2);
  expect_stops_at_once(images, "the image loader's workers");
}

TEST_F(WorkerSockets, ADataLoadersWorkersHoldNoneOfAnImageLoadersSockets) {
  ImageWorkers images(2);
  fdd::JobQueue q(queue_options(2));
  q.await_started();
  auto pids = q.pids();
  for (pid_t pid : images.workers->pids()) pids.push_back(pid);
  expect_no_worker_holds_a_loader_socket(pids);
  expect_stops_at_once(images, "the image loader's workers");
  expect_stops_at_once(q, "the DataLoader's queue");
  expect_exited_cleanly(q, 2);
}

}  // namespace
