#include "data/job_workers.hpp"

#include <fmt/format.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <variant>

#include "cuda/host_pinning.hpp"
#include "data/slot.hpp"
#include "data/worker_processes.hpp"
#include "data/worker_protocol.hpp"
#include "detail/fd.hpp"
#include "forkguard/data/error.hpp"
#include "forkguard/error.hpp"
#include "forkguard/launch/launcher.hpp"
#include "launch/child.hpp"
#include "launch/fork_server.hpp"

namespace forkguard::data::detail {
namespace {

using Clock = std::chrono::steady_clock;

// ------------------------------------------------------------------ the messages
// setup, slot, ready and failed are the process workers' own messages (data/worker_protocol.hpp);
// a job and its result are these.
struct JobMsg {
  static constexpr std::string_view kKind = "job";
  uint64_t job = 0;
  int slot = 0;
  uint64_t bytes = 0;
  template <class V, class M>
  static void fields(V& v, M& m) {
    v("job", m.job);
    v("slot", m.slot, at_least(0));
    v("bytes", m.bytes);
  }
};
struct ResultMsg {
  static constexpr std::string_view kKind = "result";
  uint64_t job = 0;
  int slot = 0;
  JobKind kind = JobKind::kOk;
  uint64_t bytes = 0;
  uint64_t slot_bytes = 0;
  std::string message{};
  template <class V, class M>
  static void fields(V& v, M& m) {
    v("job", m.job);
    v("slot", m.slot, at_least(0));
    v("kind", m.kind, Bounds<JobKind>{JobKind::kOk, JobKind::kCuda});
    v("bytes", m.bytes);
    v("slot_bytes", m.slot_bytes);
    v("message", m.message);
  }
};
using Request = std::variant<SetupMessage, SlotMessage, JobMsg>;
using Reply = std::variant<ReadyReply, FailedReply, ResultMsg>;

[[noreturn]] void raise(const std::string& message) {
  throw DataError(message);
}
template <class M>
bool send(int sock, const M& m, int fd = -1) {
  return send_message(sock, forkguard::detail::encode_message(m), fd >= 0 ? &fd : nullptr,
                      fd >= 0 ? 1 : 0);
}

// ------------------------------------------------------------------ the worker's side
// A slot too small for what is to be written is replaced by a larger memfd (its contents copied),
// which travels to the other side with the next message; neither side keeps a slot's fd open once
// the other has it (a loader whose user keeps 200 batches alive holds 200 mappings, not 200 fds).
Mapping grown(const Mapping& old, size_t bytes) {
  // Doubling: a batch that grows a little each time is not copied each time.
  auto m = create_shared(std::max(bytes, old.size() * 2), "forkguard-batch");
  std::memcpy(m.data(), old.data(), old.size());
  return m;
}

class WorkerSlot : public JobSlot {
 public:
  explicit WorkerSlot(Mapping m) : m_(std::move(m)) { m_.close_fd(); }
  std::byte* data() override { return m_.data(); }
  size_t size() const override { return m_.size(); }
  void reserve(size_t bytes) override {
    if (bytes > m_.size()) m_ = grown(m_, bytes);
  }
  // The fd of a slot grown here (for the reply), or -1; the caller closes it.
  int take_new_fd() { return m_.release_fd(); }

 private:
  Mapping m_;
};

}  // namespace

int serve_jobs(int sock, JobBody& body) {
  std::map<int, WorkerSlot> slots;
  while (true) {
    std::vector<std::string> f;
    int fds[kMaxFds];
    if (!recv_message(sock, f, fds)) return 0;  // EOF: the loader is done with us
    Request request;
    try {
      request = forkguard::detail::decode_one_of<Request>(f, "job worker request", &raise);
    } catch (const DataError& e) {
      std::fprintf(stderr, "forkguard: worker %d: %s\n", static_cast<int>(::getpid()), e.what());
      return 4;
    }
    if (const auto* s = std::get_if<SlotMessage>(&request); s && fds[0] >= 0) {
      slots.insert_or_assign(s->slot, WorkerSlot(Mapping(fds[0], s->bytes)));
      continue;
    }
    for (int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
    const auto* job = std::get_if<JobMsg>(&request);
    if (!job) continue;
    ResultMsg reply{.job = job->job, .slot = job->slot};
    auto it = slots.find(job->slot);
    if (it == slots.end() || job->bytes > it->second.size()) {
      std::fprintf(stderr, "forkguard: worker %d: job %llu names slot %d, which it does not have\n",
                   static_cast<int>(::getpid()), static_cast<unsigned long long>(job->job),
                   job->slot);
      return 4;
    }
    auto r = body.run(job->job, it->second, job->bytes);
    reply.kind = r.kind;
    reply.bytes = r.bytes;
    reply.slot_bytes = it->second.size();
    reply.message = std::move(r.message);
    UniqueFd new_fd(it->second.take_new_fd());
    if (!send(sock, reply, new_fd.get())) return errno == EPIPE || errno == ECONNRESET ? 0 : 4;
  }
}

int serve_jobs_after_setup(
    int sock,
    const std::function<std::unique_ptr<JobBody>(std::string_view setup, int worker)>& make) {
  auto received = receive_setup(sock);
  if (!received) return 2;
  UniqueFd memfd = std::move(received->memfd);
  std::unique_ptr<JobBody> body;
  try {
    auto setup = forkguard::detail::decode_message<SetupMessage>(received->fields,
                                                                 "job worker request", &raise);
    if (!memfd) throw DataError("the setup came without its memfd");
    std::string bytes = read_setup(memfd.get(), setup.bytes);
    memfd.reset();
    ::prctl(PR_SET_NAME, fmt::format("fg-worker-{}", setup.worker).c_str());
    body = make(bytes, setup.worker);
  } catch (const std::exception& e) {
    send(sock, FailedReply{e.what()});
    return 3;
  }
  send(sock, ReadyReply{});
  return serve_jobs(sock, *body);
}

// ------------------------------------------------------------------ the loader's side
class JobQueue::Impl : public JobSlot {
 public:
  explicit Impl(JobOptions o)
      : o_(checked(std::move(o))),
        procs_(o_.workers, o_.start == JobStart::kServer ? o_.server : nullptr),
        workers_(static_cast<size_t>(o_.workers)) {
    UniqueFd setup;
    if (o_.start == JobStart::kServer) setup = setup_memfd(o_.setup);
    try {
      for (int w = 0; w < o_.workers; ++w) start(w, setup.get());
    } catch (...) {
      stop(true);
      throw;
    }
  }

  ~Impl() override {
    stop(false);
    for (auto& s : slots_) unpin(*s);
  }

  // JobSlot over the slot next_slot() handed out (the loader writes a job's input through it).
  std::byte* data() override { return slots_[static_cast<size_t>(current_)]->memory.data(); }
  size_t size() const override { return slots_[static_cast<size_t>(current_)]->memory.size(); }
  void reserve(size_t bytes) override {
    auto& s = *slots_[static_cast<size_t>(current_)];
    if (bytes <= s.memory.size()) return;
    map(s, grown(s.memory, bytes));
    s.sent_bytes = 0;  // the worker gets the new one with the job
  }

  void await_started() {
    const std::string failures = procs_.await_all_ready<Reply>(
        o_.start_timeout, "job worker reply",
        {.not_running = "it was stopped",
         .timeout = fmt::format("it did not say ready within {} ms", o_.start_timeout.count()),
         .other = "it answered before it was ready",
         .closed = [this](int w) {
           const auto& status = procs_.status(w);
           return status ? status->to_string() : std::string("it closed its socket");
         }});
    if (!failures.empty()) {
      stop(true);
      throw WorkerError(fmt::format("workers could not start: {}", failures), -1, -1, {});
    }
  }

  bool wants_job() const {
    const size_t active = taking_jobs();
    return active > 0 && jobs_.size() < o_.prefetch * active;
  }

  JobQueue::Next next_slot(int worker, JobQueue::Order order) {
    if (worker < 0 && order == JobQueue::Order::kDone) worker = worker_with_room();
    if (worker < 0) {
      for (size_t k = 0; k < workers_.size(); ++k) {
        size_t w = (rr_ + k) % workers_.size();
        if (takes_jobs(w)) {
          worker = static_cast<int>(w);
          break;
        }
      }
      if (worker < 0) throw DataError("no active worker to give a job to");
    }
    rr_ = static_cast<size_t>(worker) + 1;
    int id = acquire(worker);
    current_ = id;
    return {worker, id, this};
  }

  // The next active worker in round-robin order holding fewer undelivered jobs than its share
  // of prefetch x workers, or -1.
  int worker_with_room() const {
    const size_t active = taking_jobs();
    std::vector<size_t> held(workers_.size(), 0);
    for (const auto& [job, j] : jobs_) ++held[static_cast<size_t>(j.worker)];
    if (active == 0) return -1;
    const size_t share = o_.prefetch * workers_.size() / active;
    for (size_t k = 0; k < workers_.size(); ++k) {
      const size_t w = (rr_ + k) % workers_.size();
      if (takes_jobs(w) && held[w] < share) return static_cast<int>(w);
    }
    return -1;
  }

  uint64_t submit(const JobQueue::Next& next, size_t input_bytes) {
    const int sock = procs_.socket(next.worker);
    const pid_t pid = procs_.pid(next.worker);
    auto& s = *slots_[static_cast<size_t>(next.slot)];
    const uint64_t job = next_job_++;
    jobs_[job] = Job{.worker = next.worker, .slot = next.slot};
    if (!procs_.alive(next.worker)) return job;  // its death is reported by next()
    if (s.sent_bytes == 0) {                     // new, or grown here: the worker maps it (instead)
      if (!send(sock, SlotMessage{.slot = next.slot, .bytes = s.memory.size()}, s.memory.fd())) {
        if (errno != EPIPE && errno != ECONNRESET) {
          throw WorkerError(fmt::format("cannot send worker {} (PID {}) a slot: {}", next.worker,
                                        pid, std::strerror(errno)),
                            next.worker, pid, {});
        }
        return job;
      }
      s.memory.close_fd();
      s.sent_bytes = s.memory.size();
    }
    if (!send(sock, JobMsg{.job = job, .slot = next.slot, .bytes = input_bytes}) &&
        errno != EPIPE && errno != ECONNRESET) {
      throw WorkerError(fmt::format("cannot send job {} to worker {} (PID {}): {}", job,
                                    next.worker, pid, std::strerror(errno)),
                        next.worker, pid, {});
    }
    return job;
  }

  std::optional<JobResult> next(std::optional<std::chrono::milliseconds> timeout,
                                JobQueue::Order order) {
    const auto deadline = timeout ? std::optional(Clock::now() + *timeout) : std::nullopt;
    while (true) {
      Now now = order == JobQueue::Order::kJobs ? deliverable_in_order() : deliverable_done();
      if (now.what == Now::kNothingInFlight) return std::nullopt;
      if (now.what == Now::kResult) return std::move(now.result);
      auto& [job, j] = *jobs_.begin();
      auto polled = poll_one(deadline);
      if (polled.timeout) {
        return JobResult{.kind = JobResult::Kind::kTimeout,
                         .job = job,
                         .worker = j.worker,
                         .pid = procs_.pid(j.worker)};
      }
      if (polled.died) deaths_.emplace(polled.died->worker, std::move(*polled.died));
    }
  }

  // What next() can deliver without waiting.
  struct Now {
    enum { kWait, kNothingInFlight, kResult } what = kWait;
    JobResult result{};
  };

  // In job order.
  Now deliverable_in_order() {
    // Jobs of workers that ended their pass are skipped (torch's DataLoader does the same);
    // their slots stay the worker's until it answers them.
    // A worker's death is reported where the delivery order reaches its first job not done:
    // every batch before that one comes first, whichever worker made it.
    while (!jobs_.empty()) {
      auto it = jobs_.begin();
      const int w = it->second.worker;
      if (it->second.done || workers_[static_cast<size_t>(w)].active) break;
      if (auto d = deaths_.find(w); d != deaths_.end()) return {Now::kResult, report_death(d)};
      skipped_[it->first] = it->second;
      jobs_.erase(it);
    }
    if (jobs_.empty()) {
      if (!deaths_.empty()) return {Now::kResult, report_death(deaths_.begin())};  // held none
      return {Now::kNothingInFlight};
    }
    if (jobs_.begin()->second.done) {
      JobResult r = std::move(jobs_.begin()->second.result);
      jobs_.erase(jobs_.begin());
      return {Now::kResult, std::move(r)};
    }
    return {};
  }

  // The same out of order (torch's in_order=False): the first job done, wherever it is; a death
  // once no result done is left to deliver before it.
  Now deliverable_done() {
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      const int w = it->second.worker;
      if (!it->second.done && !workers_[static_cast<size_t>(w)].active && !deaths_.contains(w)) {
        skipped_[it->first] = it->second;
        it = jobs_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = jobs_.begin(); it != jobs_.end(); ++it) {
      if (it->second.done) {
        JobResult r = std::move(it->second.result);
        jobs_.erase(it);
        return {Now::kResult, std::move(r)};
      }
    }
    if (!deaths_.empty()) return {Now::kResult, report_death(deaths_.begin())};
    if (jobs_.empty()) return {Now::kNothingInFlight};
    return {};
  }

  JobResult report_death(std::map<int, JobResult>::iterator d) {
    JobResult r = std::move(d->second);
    deaths_.erase(d);
    for (const auto& [job, j] : jobs_) {
      if (j.worker == r.worker && !j.done) r.held.push_back(job);
    }
    return r;
  }

  void release(int slot) {
    std::lock_guard lock(release_mutex_);
    released_.push_back(slot);
  }

  const std::byte* slot_data(int slot) const {
    return slots_[static_cast<size_t>(slot)]->memory.data();
  }

  void reactivate() {
    for (size_t w = 0; w < workers_.size(); ++w) {
      workers_[w].active = procs_.alive(static_cast<int>(w));
    }
    rr_ = 0;  // a new pass starts at worker 0, as torch's does
  }
  bool active(int w) const { return workers_[static_cast<size_t>(w)].active; }

  void stop(bool now) {
    for (auto& w : workers_) w.active = false;
    procs_.stop(now);
  }

  void detach_server() {
    o_.server = nullptr;
    procs_.detach_server();
  }

  std::vector<pid_t> pids() const { return procs_.pids_without_status(); }
  pid_t pid(int w) const { return procs_.pid(w); }

  void signal(int w, int sig) {
    if (w < 0 || w >= procs_.size()) {
      throw DataError(fmt::format("there is no worker {} (of {})", w, procs_.size()));
    }
    procs_.signal(w, sig);
  }

  std::optional<launch::ExitStatus> exit_status(int w, std::chrono::milliseconds timeout) {
    procs_.collect(w, timeout);
    return procs_.status(w);
  }

 private:
  // What the queue keeps of a worker besides its process.
  struct Worker {
    bool active = true;     // takes jobs (not after kEnd)
    std::vector<int> free;  // its slots not in use
  };
  struct SlotState {
    int worker = 0;
    Mapping memory;
    size_t sent_bytes = 0;  // the size the worker maps (0: not sent)
    bool pinned = false;
  };

  // The slot's memory from now on (the old mapping unpinned before it goes); pinned if asked.
  void map(SlotState& s, Mapping m) {
    unpin(s);
    s.memory = std::move(m);
    if (o_.pin_device < 0) return;
    try {
      if (!pinning_) pinning_.emplace(o_.pin_device);
      pinning_->pin(s.memory.data(), s.memory.size());
    } catch (const Error& e) {
      throw Error(
          fmt::format("pin_memory: cannot page-lock a batch slot of worker {} ({} bytes) "
                      "for CUDA device {}: {}",
                      s.worker, s.memory.size(), o_.pin_device, e.what()));
    }
    s.pinned = true;
  }
  void unpin(SlotState& s) noexcept {
    if (!s.pinned) return;
    pinning_->unpin(s.memory.data());
    s.pinned = false;
  }
  struct Job {
    int worker = 0;
    int slot = 0;
    bool done = false;
    JobResult result{};
  };

  void start(int w, int setup_fd) {
    if (o_.start == JobStart::kServer) {
      procs_.start_call(w, o_.server_function);
      if (const int e = procs_.send_setup(w, o_.setup.size(), setup_fd)) {
        throw WorkerError(fmt::format("cannot send worker {} its setup: {}", w, std::strerror(e)),
                          w, procs_.pid(w), {});
      }
      return;
    }
    // Prepared before the fork: its name.
    const std::string name = fmt::format("{}-{}", o_.name, w);
    procs_.start_fork(
        w,
        {.close_other_fds = false,
         .close_fds = o_.close_in_child,
         .name = name.c_str(),
         .stop = {.signal = 0},
         .what = fmt::format("worker {}", w)},
        [this, w](int sock) { return forked(sock, w); }, o_.before_fork, o_.after_fork_parent);
  }

  // A forked worker's life, in a copy of this process: it may allocate (it runs the caller's
  // code next).
  int forked(int sock, int w) const {
    if (o_.after_fork_child) o_.after_fork_child();
    std::unique_ptr<JobBody> body;
    try {
      body = o_.body(w);
    } catch (const std::exception& e) {
      send(sock, FailedReply{e.what()});
      return 3;
    }
    send(sock, ReadyReply{});
    return serve_jobs(sock, *body);
  }

  int acquire(int worker) {
    {
      std::lock_guard lock(release_mutex_);
      for (int id : released_) give_back(id);
      released_.clear();
    }
    auto& free = workers_[static_cast<size_t>(worker)].free;
    if (!free.empty()) {
      int id = free.back();
      free.pop_back();
      return id;
    }
    auto s = std::make_unique<SlotState>();
    s->worker = worker;
    map(*s, create_shared(o_.slot_bytes, "forkguard-batch"));
    slots_.push_back(std::move(s));
    return static_cast<int>(slots_.size()) - 1;
  }
  void give_back(int id) {
    workers_[static_cast<size_t>(slots_[static_cast<size_t>(id)]->worker)].free.push_back(id);
  }

  // Reads one message, or notices one death, or the deadline passing first.
  struct Polled {
    bool timeout = false;
    std::optional<JobResult> died{};
  };
  Polled poll_one(std::optional<Clock::time_point> deadline) {
    while (true) {
      auto r = procs_.receive(deadline);
      using Kind = WorkerProcesses::Received::Kind;
      if (r.kind == Kind::kTimeout) return {.timeout = true};
      if (r.kind == Kind::kNone) throw DataError("jobs in flight, and no worker alive to do them");
      const int w = r.worker;
      if (r.kind == Kind::kEnded) return {.died = died(w)};
      // r.fd: a slot the worker replaced by a larger one
      auto reply = forkguard::detail::decode_one_of<Reply>(r.fields, "job worker reply", &raise);
      const auto* res = std::get_if<ResultMsg>(&reply);
      if (res && res->slot < static_cast<int>(slots_.size()) &&
          slots_[static_cast<size_t>(res->slot)]->worker == w && r.fd) {
        auto& s = *slots_[static_cast<size_t>(res->slot)];
        map(s, Mapping(r.fd.release(), res->slot_bytes));
        s.memory.close_fd();
        s.sent_bytes = s.memory.size();
      }
      if (res) {
        if (auto sk = skipped_.find(res->job);
            sk != skipped_.end() && sk->second.worker == w && sk->second.slot == res->slot) {
          give_back(res->slot);  // a job skipped at the end of its worker's pass
          skipped_.erase(sk);
          continue;
        }
      }
      auto it = res ? jobs_.find(res->job) : jobs_.end();
      if (it == jobs_.end() || it->second.worker != w || it->second.slot != res->slot) {
        throw DataError(
            fmt::format("worker {} (PID {}) answered a job it was not given", w, procs_.pid(w)));
      }
      auto& s = *slots_[static_cast<size_t>(res->slot)];
      if (res->bytes > s.memory.size()) {
        throw DataError(fmt::format("worker {} (PID {}): a {}-byte result in a {}-byte slot", w,
                                    procs_.pid(w), res->bytes, s.memory.size()));
      }
      if (res->kind == JobKind::kEnd) {
        workers_[static_cast<size_t>(w)].active =
            false;  // next() skips the jobs it had after this one
        give_back(res->slot);
        jobs_.erase(it);
        return {};
      }
      it->second.done = true;
      it->second.result = JobResult{.kind = JobResult::Kind::kResult,
                                    .job = res->job,
                                    .worker = w,
                                    .pid = procs_.pid(w),
                                    .job_kind = res->kind,
                                    .slot = res->slot,
                                    .bytes = res->bytes,
                                    .message = res->message};
      return {};
    }
  }

  JobResult died(int w) {
    workers_[static_cast<size_t>(w)].active = false;
    JobResult r{.kind = JobResult::Kind::kDied, .worker = w, .pid = procs_.pid(w)};
    if (const auto& status = procs_.status(w)) r.status = *status;
    if (!procs_.lost(w).empty()) r.message = procs_.lost(w);
    return r;  // the jobs it held: when it is reported (report_death)
  }

  bool takes_jobs(size_t w) const {
    return workers_[w].active && procs_.alive(static_cast<int>(w));
  }
  size_t taking_jobs() const {  // how many workers take jobs
    size_t n = 0;
    for (size_t w = 0; w < workers_.size(); ++w) n += takes_jobs(w) ? 1 : 0;
    return n;
  }

  static JobOptions checked(JobOptions o) {
    if (o.workers < 1) throw DataError(fmt::format("{} workers", o.workers));
    if (o.prefetch < 1) throw DataError("prefetch must be at least 1");
    return o;
  }

  JobOptions o_;
  WorkerProcesses procs_;
  std::vector<Worker> workers_;
  std::optional<cuda::HostPinning> pinning_;  // pin_device >= 0: made at the first slot
  std::vector<std::unique_ptr<SlotState>> slots_;
  std::map<uint64_t, Job> jobs_;     // submitted, not yet delivered, in job order
  std::map<uint64_t, Job> skipped_;  // skipped, not yet answered
  std::map<int, JobResult> deaths_;  // by worker: noticed, not yet reported
  uint64_t next_job_ = 0;
  size_t rr_ = 0;
  int current_ = 0;
  std::mutex release_mutex_;
  std::vector<int> released_;  // slots given back by any thread, not yet returned to a worker
};

JobQueue::JobQueue(JobOptions options) : impl_(std::make_shared<Impl>(std::move(options))) {}
JobQueue::~JobQueue() = default;
void JobQueue::await_started() {
  impl_->await_started();
}
bool JobQueue::wants_job() const {
  return impl_->wants_job();
}
JobQueue::Next JobQueue::next_slot(int worker, Order order) {
  return impl_->next_slot(worker, order);
}
uint64_t JobQueue::submit(const Next& next, size_t input_bytes) {
  return impl_->submit(next, input_bytes);
}
std::optional<JobResult> JobQueue::next(std::optional<std::chrono::milliseconds> timeout,
                                        Order order) {
  return impl_->next(timeout, order);
}
void JobQueue::release(int slot) {
  impl_->release(slot);
}
const std::byte* JobQueue::slot_data(int slot) const {
  return impl_->slot_data(slot);
}
void JobQueue::reactivate() {
  impl_->reactivate();
}
bool JobQueue::active(int worker) const {
  return impl_->active(worker);
}
void JobQueue::stop(bool now) {
  impl_->stop(now);
}
void JobQueue::detach_server() {
  impl_->detach_server();
}
std::vector<pid_t> JobQueue::pids() const {
  return impl_->pids();
}
pid_t JobQueue::pid(int worker) const {
  return impl_->pid(worker);
}
void JobQueue::signal(int worker, int sig) {
  impl_->signal(worker, sig);
}
std::optional<launch::ExitStatus> JobQueue::exit_status(int worker,
                                                        std::chrono::milliseconds timeout) {
  return impl_->exit_status(worker, timeout);
}

}  // namespace forkguard::data::detail
