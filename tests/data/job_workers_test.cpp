// data/job_workers: the loader core forkguard.DataLoader's Python workers run in, with a C++ body
// here (forked workers: the same code path as the Python ones). Jobs round-robin in order,
// results in job order, a result larger than its slot, a worker whose pass ends, one that dies,
// a job that takes too long, a worker that cannot start, slots page-locked for a GPU; nothing
// left behind.
#include "data/job_workers.hpp"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <thread>

#include "forkguard/cuda/driver.hpp"
#include "forkguard/data/error.hpp"
#include "nothing_left.hpp"
#include "paths.hpp"
#include "process.hpp"

namespace fdd = forkguard::data::detail;
namespace ft = forkguard::testing;
using namespace std::chrono_literals;

namespace {

// Input: a command ("big N", "end", "resume", "die", "sleep MS", or any text to echo); output:
// its answer.
class Body : public fdd::JobBody {
 public:
  explicit Body(int worker) : worker_(worker) {}
  Result run(uint64_t job, fdd::JobSlot& slot, size_t input) override {
    std::string in(reinterpret_cast<const char*>(slot.data()), input);
    if (in == "end") ended_ = true;  // and every job after it ends too, as an exhausted iterator
    if (in == "resume") ended_ = false;
    if (ended_) return {.kind = fdd::JobKind::kEnd};
    if (in == "die") ::raise(SIGKILL);
    if (in.rfind("sleep ", 0) == 0) std::this_thread::sleep_for(std::stoi(in.substr(6)) * 1ms);
    if (in.rfind("big ", 0) == 0) {
      const size_t n = std::stoul(in.substr(4));
      slot.reserve(n);
      std::memset(slot.data(), 'a' + worker_, n);
      return {.bytes = n};
    }
    std::string out = std::to_string(worker_) + ":" + std::to_string(job) + ":" + in;
    slot.reserve(out.size());
    std::memcpy(slot.data(), out.data(), out.size());
    return {.bytes = out.size()};
  }

 private:
  int worker_;
  bool ended_ = false;
};

fdd::JobOptions options(int workers) {
  return {.workers = workers,
          .prefetch = 2,
          .start = fdd::JobStart::kFork,
          .body = [](int w) { return std::make_unique<Body>(w); },
          .slot_bytes = 4096};
}

uint64_t submit(fdd::JobQueue& q, const std::string& in, int worker = -1) {
  auto next = q.next_slot(worker);
  next.memory->reserve(in.size());
  std::memcpy(next.memory->data(), in.data(), in.size());
  return q.submit(next, in.size());
}

std::string text(fdd::JobQueue& q, const fdd::JobResult& r) {
  return std::string(reinterpret_cast<const char*>(q.slot_data(r.slot)), r.bytes);
}

// Every test leaves no child and no fd behind.
class JobQueue : public ft::NothingLeft {};

TEST_F(JobQueue, JobsGoRoundRobinAndComeBackInOrder) {
  fdd::JobQueue q(options(3));
  q.await_started();
  std::vector<uint64_t> jobs;
  while (q.wants_job()) jobs.push_back(submit(q, "j" + std::to_string(jobs.size())));
  ASSERT_EQ(jobs.size(), 6u);  // prefetch 2 x 3 workers
  for (size_t k = 0; k < jobs.size(); ++k) {
    auto r = q.next(5s);
    ASSERT_TRUE(r);
    ASSERT_EQ(r->kind, fdd::JobResult::Kind::kResult);
    EXPECT_EQ(r->job, k);
    EXPECT_EQ(text(q, *r), fmt::format("{}:{}:j{}", k % 3, k, k));
    q.release(r->slot);
  }
  EXPECT_FALSE(q.next(1s));  // nothing in flight
}

TEST_F(JobQueue, AResultLargerThanItsSlotGrowsIt) {
  fdd::JobQueue q(options(1));
  q.await_started();
  for (size_t n : {100u, 1u << 20, 10u, 3u << 20}) {
    submit(q, "big " + std::to_string(n));
    auto r = q.next(5s);
    ASSERT_TRUE(r);
    ASSERT_EQ(r->bytes, n);
    auto s = text(q, *r);
    EXPECT_EQ(std::count(s.begin(), s.end(), 'a'), static_cast<long>(n));
    q.release(r->slot);
  }
  // An input larger than the slot (written by the loader) grows it too.
  std::string long_input(100000, 'x');
  submit(q, long_input);
  auto r = q.next(5s);
  ASSERT_TRUE(r);
  EXPECT_EQ(text(q, *r), "0:4:" + long_input);
  q.release(r->slot);
}

TEST_F(JobQueue, AWorkerWhosePassEndedTakesNoMoreJobsAndItsJobsAreSkipped) {
  fdd::JobQueue q(options(2));
  q.await_started();
  submit(q, "a");    // 0 -> worker 0
  submit(q, "end");  // 1 -> worker 1: its pass ends
  submit(q, "b");    // 2 -> worker 0
  submit(q, "c");    // 3 -> worker 1: skipped
  std::vector<std::string> got;
  while (auto r = q.next(5s)) {
    ASSERT_EQ(r->kind, fdd::JobResult::Kind::kResult);
    got.push_back(text(q, *r));
    q.release(r->slot);
  }
  EXPECT_EQ(got, (std::vector<std::string>{"0:0:a", "0:2:b"}));
  EXPECT_FALSE(q.active(1));
  ASSERT_TRUE(q.wants_job());
  submit(q, "d");  // to worker 0, the active one
  auto r = q.next(5s);
  ASSERT_TRUE(r);
  EXPECT_EQ(text(q, *r), "0:4:d");
  q.release(r->slot);
  q.reactivate();  // a new pass: both take jobs again, from worker 0
  EXPECT_TRUE(q.active(1));
  submit(q, "resume", 1);
  r = q.next(5s);
  ASSERT_TRUE(r);
  EXPECT_EQ(text(q, *r), "1:5:resume");
  q.release(r->slot);
  submit(q, "x");
  submit(q, "y");
  auto r1 = q.next(5s);
  auto r2 = q.next(5s);
  ASSERT_TRUE(r1 && r2);
  EXPECT_EQ(text(q, *r1), "0:6:x");
  EXPECT_EQ(text(q, *r2), "1:7:y");
  q.release(r1->slot);
  q.release(r2->slot);
}

TEST_F(JobQueue, AWorkerThatDiesIsReportedWithItsSignalAndTheJobsItHeld) {
  fdd::JobQueue q(options(2));
  q.await_started();
  const pid_t victim = q.pid(1);
  submit(q, "a");             // 0 -> worker 0
  submit(q, "sleep 100", 1);  // 1 -> worker 1
  submit(q, "die", 1);        // 2 -> worker 1
  auto r = q.next(5s);
  ASSERT_TRUE(r);
  EXPECT_EQ(text(q, *r), "0:0:a");
  q.release(r->slot);
  r = q.next(5s);
  ASSERT_TRUE(r);
  if (r->kind == fdd::JobResult::Kind::kResult) {  // job 1 may come back before the death
    q.release(r->slot);
    r = q.next(5s);
    ASSERT_TRUE(r);
  }
  ASSERT_EQ(r->kind, fdd::JobResult::Kind::kDied);
  EXPECT_EQ(r->worker, 1);
  EXPECT_EQ(r->pid, victim);
  EXPECT_EQ(r->status.signal, SIGKILL) << r->status.to_string();
  EXPECT_EQ(r->held.back(), 2u);
}

// A worker that dies while an earlier job of another worker is still running: that job and the
// dead worker's own finished one come first, in order, then the death, naming only the job it did
// not do (the death was reported at once, ahead of both: forkguard.DataLoader gave 2 of 5
// batches).
TEST_F(JobQueue, ADeathIsReportedInJobOrderAfterEveryEarlierResult) {
  fdd::JobQueue q(options(2));
  q.await_started();
  const pid_t victim = q.pid(1);
  submit(q, "sleep 400", 0);  // 0 -> worker 0, still running when worker 1 dies
  submit(q, "b", 1);          // 1 -> worker 1
  submit(q, "die", 1);        // 2 -> worker 1
  auto r = q.next(5s);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->kind, fdd::JobResult::Kind::kResult) << "the death came first";
  EXPECT_EQ(r->job, 0u);
  q.release(r->slot);
  r = q.next(5s);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->kind, fdd::JobResult::Kind::kResult);
  EXPECT_EQ(r->job, 1u);
  EXPECT_EQ(text(q, *r), "1:1:b");
  q.release(r->slot);
  r = q.next(5s);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->kind, fdd::JobResult::Kind::kDied);
  EXPECT_EQ(r->pid, victim);
  EXPECT_EQ(r->status.signal, SIGKILL) << r->status.to_string();
  EXPECT_EQ(r->held, std::vector<uint64_t>{2u});
}

// torch's DataLoader(in_order=False): a slow job does not hold back the results done after it;
// it comes when done, and a death is reported once the results done before it are delivered.
TEST_F(JobQueue, OutOfOrderTheFirstResultDoneComesFirst) {
  fdd::JobQueue q(options(2));
  q.await_started();
  const auto done_first = fdd::JobQueue::Order::kDone;
  submit(q, "sleep 400", 0);  // 0 -> worker 0
  submit(q, "b", 1);          // 1 -> worker 1
  submit(q, "c", 1);          // 2 -> worker 1
  std::vector<uint64_t> order;
  for (int k = 0; k < 3; ++k) {
    auto r = q.next(5s, done_first);
    ASSERT_TRUE(r);
    ASSERT_EQ(r->kind, fdd::JobResult::Kind::kResult);
    order.push_back(r->job);
    q.release(r->slot);
  }
  EXPECT_EQ(order, (std::vector<uint64_t>{1, 2, 0}));
  // Out of order, a worker holding its share of prefetch x workers (2 here) gets no more jobs
  // while another has room: torch's in_order=False does not queue behind a slow worker.
  submit(q, "sleep 300", 0);  // 3 -> worker 0
  auto to = [&q](const std::string& in) {
    auto next = q.next_slot(-1, fdd::JobQueue::Order::kDone);
    next.memory->reserve(in.size());
    std::memcpy(next.memory->data(), in.data(), in.size());
    q.submit(next, in.size());
    return next.worker;
  };
  EXPECT_EQ(to("d"), 1);
  EXPECT_EQ(to("e"), 0);  // worker 0 holds 1 of its 2
  EXPECT_EQ(to("f"), 1);  // worker 0 is full: not round-robin's turn, but the one with room
  for (int k = 0; k < 4; ++k) {
    auto r = q.next(5s, done_first);
    ASSERT_TRUE(r);
    q.release(r->slot);
  }
  const pid_t victim = q.pid(1);
  submit(q, "sleep 400", 0);  // 7 -> worker 0
  submit(q, "die", 1);        // 8 -> worker 1
  auto r = q.next(5s, done_first);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->kind, fdd::JobResult::Kind::kDied) << "a death waits for no slower job";
  EXPECT_EQ(r->pid, victim);
  EXPECT_EQ(r->held, std::vector<uint64_t>{8u});
  q.stop(true);
}

TEST_F(JobQueue, AJobNotDoneInTimeNamesItsWorker) {
  fdd::JobQueue q(options(2));
  q.await_started();
  submit(q, "sleep 2000");
  auto t0 = std::chrono::steady_clock::now();
  auto r = q.next(200ms);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->kind, fdd::JobResult::Kind::kTimeout);
  EXPECT_EQ(r->job, 0u);
  EXPECT_EQ(r->worker, 0);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 200ms);
  q.stop(true);  // killed at once, not after its job
}

TEST_F(JobQueue, AWorkerThatCannotStartIsNamed) {
  auto o = options(2);
  o.body = [](int w) -> std::unique_ptr<fdd::JobBody> {
    if (w == 1) throw forkguard::data::DataError("no dataset for worker 1");
    return std::make_unique<Body>(w);
  };
  fdd::JobQueue q(o);
  try {
    q.await_started();
    FAIL();
  } catch (const forkguard::data::WorkerError& e) {
    EXPECT_NE(std::string(e.what()).find("worker 1 (PID "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("no dataset for worker 1"), std::string::npos);
  }
}

TEST_F(JobQueue, StoppedWorkersExitCleanlyAndAnotherQueueSeesEofToo) {
  // Workers of a second queue are forked while the first one's exist: they must not hold its
  // sockets, or its workers would see EOF only at SIGKILL.
  auto a = std::make_unique<fdd::JobQueue>(options(2));
  a->await_started();
  fdd::JobQueue b(options(2));
  b.await_started();
  auto t0 = std::chrono::steady_clock::now();
  a->stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  for (int w = 0; w < 2; ++w) {
    auto s = a->exit_status(w, 0ms);
    ASSERT_TRUE(s);
    EXPECT_EQ(s->to_string(), "exited with code 0");
  }
  a.reset();
  b.stop();
}

// What the driver says of host memory: CU_POINTER_ATTRIBUTE_MEMORY_TYPE is CU_MEMORYTYPE_HOST.
bool page_locked(const void* p) {
  void* lib = ::dlopen(ft::kFakeCuda.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return false;
  using Fn = int (*)(void*, int, unsigned long long);
  auto fn = reinterpret_cast<Fn>(::dlsym(lib, "cuPointerGetAttribute"));
  unsigned kind = 0;
  const bool locked =
      fn != nullptr && fn(&kind, 2, reinterpret_cast<uintptr_t>(p)) == 0 && kind == 1;
  ::dlclose(lib);
  return locked;
}

TEST_F(JobQueue, PinnedSlotsArePageLockedOnceAndUnregisteredBeforeTheyGo) {
  ::setenv("FORKGUARD_CUDA_DRIVER", ft::kFakeCuda.c_str(), 1);
  const auto& d = forkguard::cuda::Driver::load();
  ASSERT_EQ(d.api().cuInit(0), forkguard::cuda::CUDA_SUCCESS);
  fds_ = ft::open_fds();  // the driver's own (its device files) stay, as the real driver's do
  auto o = options(1);
  o.pin_device = 0;
  const void* last = nullptr;
  {
    fdd::JobQueue q(o);
    q.await_started();
    // 4 KiB, then a result that grows the slot (the worker's new memfd, pinned in its stead)
    for (size_t n : {100u, 1u << 20, 10u}) {
      submit(q, "big " + std::to_string(n));
      auto r = q.next(5s);
      ASSERT_TRUE(r);
      ASSERT_EQ(r->bytes, n);
      EXPECT_TRUE(page_locked(q.slot_data(r->slot))) << n;
      EXPECT_TRUE(page_locked(q.slot_data(r->slot) + n - 1)) << n;
      last = q.slot_data(r->slot);
      q.release(r->slot);
    }
    // The thread's own current context is left as it was (none here).
    forkguard::cuda::CUcontext current = nullptr;
    ASSERT_EQ(d.api().cuCtxGetCurrent(&current), forkguard::cuda::CUDA_SUCCESS);
    EXPECT_EQ(current, nullptr);
  }
  EXPECT_FALSE(page_locked(last));  // unregistered with the queue
}

}  // namespace
