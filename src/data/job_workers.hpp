// The loader core for workers whose work is opaque bytes: forkguard.DataLoader's Python workers
// (the user's Dataset and collate_fn). The core starts the workers through the process layer (a
// fork of this process by launch::detail::start_child, or a call to a fork server), schedules
// jobs round-robin over the workers still active with a bounded number in flight, moves each
// job's input and result through a memfd slot of the worker's (grown when a result outgrows it;
// nothing in /dev/shm), delivers results in job order, and supervises: a worker that dies is
// reported, in that order, at its first job not done (every result before it is delivered first),
// with its PID, its exit status and the jobs it held; a job not done in time names its worker.
//
//   JobQueue q({.workers = 2, .prefetch = 2, .start = JobStart::kFork, .body = make_body});
//   q.await_started();
//   while (q.wants_job()) { auto s = q.next_slot(); write input into s; q.submit(s, n); }
//   while (auto r = q.next(timeout)) { ... read r->bytes of slot r->slot ...; q.release(r->slot); }
//
// Messages (SOCK_SEQPACKET, detail/message_fields.hpp):
//   loader -> worker   setup BYTES WORKER + memfd (fork-server workers: the body, e.g. pickled)
//                      slot SLOT BYTES + memfd
//                      job JOB SLOT BYTES          (the input is the slot's first BYTES bytes)
//   worker -> loader   ready | failed MESSAGE      (once)
//                      result JOB SLOT KIND BYTES SLOT_BYTES MESSAGE
//                                                  (the output replaces the input; SLOT_BYTES:
//                                                   the memfd's size now, when the worker grew it)
// A worker ends with EOF on its socket (its loader closed it or died).
//
// Thread-safety: one thread drives a queue; release() may be called from any thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "detail/message_fields.hpp"
#include "forkguard/launch/exit_status.hpp"

namespace forkguard::launch::detail {
class ForkServer;
}

namespace forkguard::data::detail {

enum class JobKind {
  kOk,     // the output is the job's result
  kError,  // the output describes an error the job raised (delivered like a result)
  kEnd,    // the worker has nothing more to give (an exhausted iterator): no more jobs for it
  kCuda,   // the output is a result, and the worker found CUDA state in itself afterwards
};

// A worker's writable view of its slot, handed to JobBody::run.
class JobSlot {
 public:
  virtual ~JobSlot() = default;
  virtual std::byte* data() = 0;
  virtual size_t size() const = 0;
  // Grows the slot to at least `bytes` (its memfd and this mapping); data() may move.
  virtual void reserve(size_t bytes) = 0;
};

// What a worker runs: built in the worker process, once.
class JobBody {
 public:
  virtual ~JobBody() = default;
  struct Result {
    JobKind kind = JobKind::kOk;
    size_t bytes = 0;       // output written at the slot's start
    std::string message{};  // optional text (kCuda: what was found)
  };
  // The job's input is slot.data()[0, input_bytes); the output replaces it.
  virtual Result run(uint64_t job, JobSlot& slot, size_t input_bytes) = 0;
};

// The worker side: serves jobs on `sock` until EOF. Returns the worker's exit code.
int serve_jobs(int sock, JobBody& body);
// The worker side for a fork-server worker: receives the setup (its bytes and the worker id),
// builds the body with `make` (an exception is reported as "failed" with its text), says ready
// and serves. Returns the exit code.
int serve_jobs_after_setup(
    int sock,
    const std::function<std::unique_ptr<JobBody>(std::string_view setup, int worker)>& make);

enum class JobStart {
  kFork,    // start_child: a copy of this process, running `body`
  kServer,  // `server` forks it and runs its function `server_function` on its socket
};

struct JobOptions {
  int workers = 1;
  size_t prefetch = 2;  // jobs in flight per active worker
  JobStart start = JobStart::kFork;
  // kFork: builds worker w's body in the child (right after the fork, before "ready"); throws to
  // say why it cannot (the text becomes the start failure). The child's exit code is what
  // serve_jobs returns.
  std::function<std::unique_ptr<JobBody>(int worker)> body{};
  // kFork: called around the fork in the parent (before; after) and first thing in the child.
  std::function<void()> before_fork{}, after_fork_parent{};
  void (*after_fork_child)() = nullptr;
  // kFork: more fds of this process a worker must not hold (the Python fork server's socket: a
  // server sees EOF only once every holder closed it). Every worker pool's sockets and the C++
  // fork server's are closed in it anyway (data/worker_sockets.hpp).
  std::vector<int> close_in_child{};
  // kServer:
  launch::detail::ForkServer* server = nullptr;
  std::string server_function{};
  std::string setup{};                         // the bytes every worker receives in its setup memfd
  std::chrono::milliseconds start_timeout{0};  // for "ready"; 0: as long as it takes
  size_t slot_bytes = 1 << 20;                 // a new slot's size
  // >= 0: every slot is page-locked in this process for that visible CUDA device, once, when it
  // is mapped here (cuMemHostRegister, portable), and unregistered before it is unmapped; the
  // driver is loaded and initialized here at the first slot (after the workers started).
  int pin_device = -1;
  std::string name = "fg-job-worker";  // process name prefix (ps): name-W
};

struct JobResult {
  enum class Kind { kResult, kDied, kTimeout };
  Kind kind = Kind::kResult;
  uint64_t job = 0;
  int worker = 0;
  pid_t pid = 0;
  // kResult
  JobKind job_kind = JobKind::kOk;
  int slot = -1;
  size_t bytes = 0;
  std::string message{};
  // kDied: its exit status, and the jobs it held and did not do, in order
  launch::ExitStatus status{};
  std::vector<uint64_t> held{};
};

class JobQueue {
 public:
  explicit JobQueue(JobOptions options);  // starts the workers; throws WorkerError, SpawnError
  ~JobQueue();                            // stop(false)
  JobQueue(const JobQueue&) = delete;
  JobQueue& operator=(const JobQueue&) = delete;

  // Waits until every worker said ready; throws WorkerError naming each that could not start
  // (the others are stopped).
  void await_started();

  // Another job may be submitted: fewer than prefetch x active workers are in flight.
  bool wants_job() const;
  // The slot for the next job: of the next active worker in round-robin order, or of `worker`
  // (the round-robin order then goes on after it). Write the input at its start (grow it with
  // reserve), then submit(). Order::kDone (results delivered out of order): the next active
  // worker in that order that holds fewer undelivered jobs than its share of prefetch x workers
  // (torch's DataLoader(in_order=False) gives a slow worker no more), else the next active one.
  struct Next {
    int worker = -1;
    int slot = -1;
    JobSlot* memory = nullptr;
  };
  enum class Order { kJobs, kDone };
  Next next_slot(int worker = -1, Order order = Order::kJobs);
  uint64_t submit(const Next& next, size_t input_bytes);  // the job's number (0, 1, ...)

  // The next job's result in job order (jobs of workers that ended are skipped); nullopt when no
  // job is in flight. kTimeout: `timeout` passed first (the job waits on); kDied: a worker died
  // (the queue is then stopped). Out of order (torch's DataLoader(in_order=False)): the first
  // result done, whichever job it is, and a death once every result done before it is delivered.
  std::optional<JobResult> next(std::optional<std::chrono::milliseconds> timeout,
                                Order order = Order::kJobs);
  // The result's slot back to its worker. Any thread; the last holder of a result calls it.
  void release(int slot);
  // The slot's memory as the loader maps it (valid until release()).
  const std::byte* slot_data(int slot) const;

  // Makes every live worker active again (a new pass over an iterable: after kEnd).
  void reactivate();
  bool active(int worker) const;
  // Stops the workers: EOF on their sockets, then SIGKILL after the grace (`now`: at once).
  void stop(bool now = false);
  // kServer, after stop(): the queue no longer uses the server (its owner may close it).
  void detach_server();
  std::vector<pid_t> pids() const;  // started, not yet collected
  pid_t pid(int worker) const;
  // Sends `sig` to the worker through its handle: its Child (kFork), or the pidfd its fork server
  // opened before it could reap it (kServer). Nothing once it has exited: never a process that
  // has its PID by then. Throws DataError for a worker the queue does not have.
  void signal(int worker, int sig);
  // The worker's exit status once it ended (waits up to `timeout` for it); nullopt while alive.
  std::optional<launch::ExitStatus> exit_status(int worker, std::chrono::milliseconds timeout);

 private:
  class Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace forkguard::data::detail
