// Process workers. Two ways to start one:
// - from the fork server (the zygote init() forked while the program was clean): the child is
//   CUDA-clean whatever this process did, and rebuilds the dataset and transform from their
//   registered descriptions;
// - by a guarded fork of this process (only while it is CUDA-clean): the child inherits the
//   objects as they are.
// Either way the child serves the same loop: slots arrive as memfds over SCM_RIGHTS, tasks as
// small messages, and each finished batch is answered with a small "done" message.
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>
#include <variant>

#include "data/worker_protocol.hpp"
#include "data/worker_sockets.hpp"
#include "data/workers.hpp"
#include "detail/deadline.hpp"
#include "detail/seqpacket.hpp"
#include "forkguard/data/error.hpp"
#include "forkguard/launch/exit_status.hpp"
#include "forkguard/launch/launcher.hpp"
#include "forkguard/probe/cuda_state.hpp"
#include "launch/child.hpp"
#include "launch/fork_server.hpp"

namespace forkguard::data::detail {
namespace {

using forkguard::detail::kMaxFds;
using forkguard::detail::recv_message;
using forkguard::detail::send_message;
using forkguard::detail::UniqueFd;
using launch::detail::ForkServer;

constexpr const char* kZygoteFunction = "forkguard.data.worker";
constexpr auto kExitGrace = std::chrono::seconds(2);

// A task's indices travel in its slot, not in the message (whose size is bounded by the socket's
// buffer: about 26 000 indices): the loader writes them before it sends the task.
void put_indices(const std::vector<size_t>& v, std::byte* slot, const SlotLayout& l) {
  std::memcpy(slot + l.indices_offset, v.data(), v.size() * sizeof(size_t));
}
std::vector<size_t> get_indices(size_t count, const std::byte* slot, const SlotLayout& l) {
  if (count > l.batch_size) throw DataError(fmt::format("a task of {} samples", count));
  std::vector<size_t> v(count);
  std::memcpy(v.data(), slot + l.indices_offset, count * sizeof(size_t));
  return v;
}

// ------------------------------------------------------------------ the worker's side
// Runs the init hook and checks the worker is still CUDA-clean; the reason it must stop, if any.
std::string prepare_worker(const WorkerSetup& setup, int id) {
  if (setup.worker_init.empty()) {
    if (auto state = cuda_state_if_unsafe()) {
      return fmt::format(
          "the worker started with CUDA state ({}): it was forked from a process "
          "that had initialized CUDA",
          *state);
    }
    return {};
  }
  try {
    WorkerInit init = find_worker_init(setup.worker_init);
    init(WorkerInfo{id, setup.workers,
                    sample_key(setup.producer.seed, setup.epoch, static_cast<uint64_t>(id), 1),
                    setup.epoch, WorkerKind::kProcess});
  } catch (const std::exception& e) {
    return fmt::format("its init hook \"{}\" threw: {}", setup.worker_init, e.what());
  }
  if (auto state = cuda_state_if_unsafe()) {
    return fmt::format(
        "its init hook \"{}\" initialized CUDA in the worker ({}). Workers must "
        "stay CPU-only: do GPU work in the main process",
        setup.worker_init, *state);
  }
  return {};
}

int serve(int sock, const Producer& producer) {
  std::map<int, Mapping> slots;
  auto idle_from = Clock::now();
  while (true) {
    std::vector<std::string> f;
    int fds[kMaxFds];
    if (!recv_message(sock, f, fds)) return 0;  // the loader closed our socket: stop
    WorkerRequest request;
    try {
      request = decode_worker_request(f);
    } catch (const DataError& e) {
      // Not from our loader: no batch to answer for, and nothing sensible to do but stop.
      std::fprintf(stderr, "forkguard: process worker %d: %s\n", static_cast<int>(::getpid()),
                   e.what());
      return 4;
    }
    const auto* slot_message = std::get_if<SlotMessage>(&request);
    if (slot_message && fds[0] >= 0) {
      slots.insert_or_assign(slot_message->slot, Mapping(fds[0], slot_message->bytes));
      continue;
    }
    for (int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
    const auto* task = std::get_if<TaskMessage>(&request);
    if (!task) continue;
    uint64_t idle = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - idle_from).count());
    auto it = slots.find(task->slot);
    TaskResult r;
    if (it == slots.end()) {
      r.kind = TaskResult::Kind::kInternal;
      r.message = fmt::format("slot {} was never sent to this worker", task->slot);
    } else {
      try {
        const auto& layout = producer.config().layout;
        r = producer.run(task->epoch, get_indices(task->count, it->second.data(), layout),
                         it->second.data(),
                         {.shared = task->shared, .fresh_fd = task->fresh ? it->second.fd() : -1});
      } catch (const std::exception& e) {  // not a sample's fault (those are caught per sample)
        r.kind = TaskResult::Kind::kInternal;
        r.message = e.what();
      }
    }
    if (!send_message(
            sock, encode(DoneReply{
                      .batch = task->batch, .slot = task->slot, .result = r, .idle_ns = idle}))) {
      // The loader is gone (EPIPE: stop quietly) or the report could not be sent.
      if (errno == EPIPE || errno == ECONNRESET) return 0;
      std::fprintf(stderr, "forkguard: process worker %d cannot report batch %llu: %s\n",
                   static_cast<int>(::getpid()), static_cast<unsigned long long>(task->batch),
                   std::strerror(errno));
      return 4;
    }
    idle_from = Clock::now();
    if (r.kind == TaskResult::Kind::kCuda) return 3;  // reported; a CUDA-tainted worker stops
  }
}

// The zygote function: a fork of the fork server, with the loader's socket as `sock`.
int worker_entry(int sock) {
  std::vector<std::string> f;
  int fds[kMaxFds];
  if (!recv_message(sock, f, fds)) return 2;
  UniqueFd description(fds[0]);
  for (int k = 1; k < kMaxFds; ++k) {
    if (fds[k] >= 0) ::close(fds[k]);
  }
  const SetupMessage* setup_message = nullptr;
  WorkerRequest request;
  try {
    request = decode_worker_request(f);
    setup_message = std::get_if<SetupMessage>(&request);
  } catch (const DataError& e) {
    std::fprintf(stderr, "forkguard: process worker %d: %s\n", static_cast<int>(::getpid()),
                 e.what());
  }
  if (setup_message == nullptr || !description) return 2;
  std::unique_ptr<Dataset> dataset;
  std::unique_ptr<Transform> transform;
  WorkerSetup setup;
  int id = 0;
  try {
    auto j = nlohmann::json::parse(read_setup(description.get(), setup_message->bytes));
    description.reset();
    dataset = make_dataset({j.at("dataset").at("type"), j.at("dataset").at("params")});
    transform = make_transform({j.at("transform").at("type"), j.at("transform").at("params")});
    setup.dataset = dataset.get();
    setup.transform = transform.get();
    setup.producer.seed = j.at("seed");
    setup.producer.bad_sample = static_cast<BadSample>(j.at("bad_sample").get<int>());
    setup.producer.max_substitutes = j.at("max_substitutes");
    setup.producer.layout =
        SlotLayout::make(j.at("batch_size"), j.at("sample_bytes"), j.at("key_bytes"));
    setup.producer.check_cuda = true;
    setup.workers = j.at("workers");
    setup.epoch = j.at("epoch");
    setup.worker_init = j.at("worker_init");
    id = setup_message->worker;
    if (transform->output().bytes() != setup.producer.layout.sample_bytes) {
      throw DataError(fmt::format(
          "the rebuilt transform \"{}\" makes {} bytes per sample, the "
          "loader's makes {}",
          transform->name(), transform->output().bytes(), setup.producer.layout.sample_bytes));
    }
  } catch (const std::exception& e) {
    send_message(sock,
                 encode(FailedReply{fmt::format("cannot rebuild the pipeline: {}", e.what())}));
    return 2;
  }
  ::prctl(PR_SET_NAME, fmt::format("fg-worker-{}", id).c_str());
  if (auto why = prepare_worker(setup, id); !why.empty()) {
    send_message(sock, encode(FailedReply{why}));
    return 3;
  }
  send_message(sock, encode(ReadyReply{}));
  return serve(sock, Producer(*setup.dataset, *setup.transform, setup.producer));
}

[[maybe_unused]] const bool g_registered =
    launch::detail::register_zygote_function(kZygoteFunction, &worker_entry);

std::string verdict_of_this_process();

// ------------------------------------------------------------------ the loader's side
class ProcessWorkers : public Workers {
 public:
  ProcessWorkers(const WorkerSetup& setup, bool via_server) : setup_(setup), via_(via_server) {
    procs_.resize(static_cast<size_t>(setup.workers));
    try {
      // Serialized once, into one memfd every worker reads: a dataset's description lists its
      // files.
      UniqueFd base;
      size_t base_size = 0;
      if (via_server) {
        std::string json;
        try {
          json = setup_json().dump();
        } catch (const nlohmann::json::exception& e) {  // e.g. a name that is not UTF-8
          throw DataError(fmt::format(
              "process workers from the fork server rebuild the dataset and transform from "
              "their descriptions, and this one cannot be sent ({}); use thread workers or "
              "ProcessStart::kFork",
              e.what()));
        }
        base = setup_memfd(json);
        base_size = json.size();
      }
      for (int w = 0; w < setup.workers; ++w) start(w, base.get(), base_size);
    } catch (...) {
      stop(true);
      throw;
    }
  }

  void await_started() override {
    const auto deadline = setup_.start_timeout.count() > 0
                              ? std::optional(Clock::now() + setup_.start_timeout)
                              : std::nullopt;
    std::string failures;
    for (int w = 0; w < setup_.workers; ++w) {
      std::string why = await_ready(w, deadline);
      if (!why.empty()) {
        failures +=
            (failures.empty() ? "" : "; ") +
            fmt::format("worker {} (PID {}): {}", w, procs_[static_cast<size_t>(w)].pid, why);
      }
    }
    if (!failures.empty()) {
      stop(true);
      throw WorkerError(fmt::format("process workers could not start: {}", failures), -1, -1, {});
    }
  }

  ~ProcessWorkers() override { stop(); }

  void submit(int worker, Task task) override {
    auto& p = procs_[static_cast<size_t>(worker)];
    if (!p.alive) return;  // its death is reported by wait()
    if (p.has_slot.size() <= static_cast<size_t>(task.slot)) {
      p.has_slot.resize(static_cast<size_t>(task.slot) + 1, false);
    }
    if (!p.has_slot[static_cast<size_t>(task.slot)]) {
      Slot& s = setup_.pool->get(task.slot);
      int fd = s.memory.fd();
      if (!send_message(p.sock.get(),
                        encode(SlotMessage{.slot = task.slot, .bytes = s.memory.size()}), &fd, 1) &&
          errno != EPIPE && errno != ECONNRESET) {
        throw WorkerError(fmt::format("cannot send slot {} to worker {} (PID {}): {}", task.slot,
                                      worker, p.pid, std::strerror(errno)),
                          worker, p.pid, task.indices);
      }
      p.has_slot[static_cast<size_t>(task.slot)] = true;
    }
    // The parts of a shared batch have the same indices: written once.
    const auto batch = std::make_tuple(task.epoch, task.batch, task.slot);
    if (!task.shared || batch != indices_written_) {
      put_indices(task.indices, setup_.pool->get(task.slot).memory.data(), setup_.producer.layout);
      indices_written_ = batch;
    }
    if (!send_message(p.sock.get(), encode(TaskMessage{.epoch = task.epoch,
                                                       .batch = task.batch,
                                                       .slot = task.slot,
                                                       .count = task.indices.size(),
                                                       .shared = task.shared,
                                                       .fresh = task.fresh}))) {
      // A dead worker (EPIPE, ECONNRESET) is reported by wait(); anything else would leave the
      // batch waiting for a task its worker never got.
      if (errno != EPIPE && errno != ECONNRESET) {
        throw WorkerError(
            fmt::format("cannot send batch {} ({} samples) to worker {} (PID {}): {}", task.batch,
                        task.indices.size(), worker, p.pid, std::strerror(errno)),
            worker, p.pid, task.indices);
      }
    }
  }

  std::optional<WorkerEvent> wait(std::optional<Clock::time_point> deadline) override {
    while (true) {
      std::vector<pollfd> fds;
      std::vector<int> who;
      const size_t n = procs_.size();
      for (size_t k = 0; k < n; ++k) {
        size_t w = (next_ + k) % n;  // rotate, so that no worker starves the others
        if (procs_[w].alive) {
          fds.push_back({procs_[w].sock.get(), POLLIN, 0});
          who.push_back(static_cast<int>(w));
        }
      }
      if (fds.empty()) return std::nullopt;
      int r = ::poll(fds.data(), fds.size(), forkguard::detail::poll_ms(deadline));
      if (r < 0 && errno == EINTR) continue;
      if (r == 0) return std::nullopt;
      for (size_t k = 0; k < fds.size(); ++k) {
        if (fds[k].revents == 0) continue;
        int w = who[k];
        next_ = static_cast<size_t>(w) + 1;
        std::vector<std::string> f;
        int got[kMaxFds];
        if (recv_message(fds[k].fd, f, got, MSG_DONTWAIT)) {
          for (int fd : got) {
            if (fd >= 0) ::close(fd);
          }
          // Only "done" is expected here; a malformed one is the loader's DataError.
          const WorkerReply reply = decode_worker_reply(f);
          if (const auto* done = std::get_if<DoneReply>(&reply)) return done->event(w);
          continue;
        }
        if (errno == EAGAIN) continue;
        return died(w);
      }
    }
  }

  void stop(bool now = false) override {
    for (auto& p : procs_) {
      if (!p.alive) continue;
      p.sock.reset();  // EOF: the worker finishes its task and exits
      if (now) kill(p);
    }
    for (auto& p : procs_) {
      if (p.alive) {
        p.alive = false;
        if (!collect(p, kExitGrace)) {
          kill(p);
          collect(p, std::chrono::seconds(30));
        }
      }
      p.sock.reset();
    }
  }

  pid_t pid(int worker) const override { return procs_[static_cast<size_t>(worker)].pid; }
  std::vector<pid_t> pids() const override {
    std::vector<pid_t> out;
    for (const auto& p : procs_) {
      if (p.alive) out.push_back(p.pid);
    }
    return out;
  }

 private:
  struct Proc {
    pid_t pid = -1;
    WorkerSocket sock;
    launch::detail::Child child;               // a guarded fork's: ours until reaped
    launch::detail::ServerChild server_child;  // the fork server's child: its handle
    bool alive = false;
    std::vector<bool> has_slot;
    launch::ExitStatus status;  // once collected
    bool collected = false;
    std::string lost;  // collected: its fork server ended, and it with it (no status comes)
  };

  nlohmann::json setup_json() const {
    auto d = setup_.dataset->describe();
    auto t = setup_.transform->describe();
    const auto& l = setup_.producer.layout;
    return {{"dataset", {{"type", d->type}, {"params", d->params}}},
            {"transform", {{"type", t->type}, {"params", t->params}}},
            {"seed", setup_.producer.seed},
            {"bad_sample", static_cast<int>(setup_.producer.bad_sample)},
            {"max_substitutes", setup_.producer.max_substitutes},
            {"batch_size", l.batch_size},
            {"sample_bytes", l.sample_bytes},
            {"key_bytes", l.key_bytes},
            {"workers", setup_.workers},
            {"epoch", setup_.epoch},
            {"worker_init", setup_.worker_init}};
  }

  void start(int w, int setup_fd, size_t setup_size) {
    auto [mine, theirs] = make_worker_sockets();
    auto& p = procs_[static_cast<size_t>(w)];
    if (via_) {
      auto started = ForkServer::get()->start_call(kZygoteFunction, theirs.get());
      p.pid = started.pid();
      p.server_child = std::move(started);
      theirs.reset();
      if (!send_message(mine.get(), encode(SetupMessage{.bytes = setup_size, .worker = w}),
                        &setup_fd, 1)) {
        const int e = errno;
        p.sock = std::move(mine);  // closed by stop(): the worker sees EOF and exits
        p.alive = true;
        throw DataError(fmt::format("cannot send process worker {} its setup ({} bytes): {}", w,
                                    setup_size, std::strerror(e)));
      }
    } else {
      p.child = guarded_fork(w, theirs.get());
      p.pid = p.child.pid();
      theirs.reset();
    }
    p.sock = std::move(mine);
    p.alive = true;
  }

  launch::detail::Child guarded_fork(int w, int child_sock) {
    // Everything is prepared here, before the fork: its name, its producer, and the check that
    // this process may fork (the worker is a copy of it).
    const std::string name = fmt::format("fg-worker-{}", w);
    Producer producer(*setup_.dataset, *setup_.transform, setup_.producer);
    std::string why;
    if (setup_.worker_init.empty()) {
      if (auto dirty = verdict_of_this_process(); !dirty.empty()) {
        why = fmt::format(
            "the worker started with CUDA state ({}): it was forked from a process that had "
            "initialized CUDA",
            dirty);
      }
    }
    // Its own process group: a terminal's Ctrl-C stops the loader, which then stops its workers.
    // It keeps what this process has open (the dataset's files), all but the sockets of every
    // worker pool of this process (start_worker).
    return start_worker({.main =
                             [&, w, child_sock] {
                               // The worker: a copy of a CUDA-clean process, which may allocate.
                               // Only the init hook's own effect is probed here (what the hook
                               // did, after it ran).
                               if (why.empty() && !setup_.worker_init.empty()) {
                                 why = prepare_worker(setup_, w);
                               }
                               if (!why.empty()) {
                                 send_message(child_sock, encode(FailedReply{why}));
                                 return 3;
                               }
                               send_message(child_sock, encode(ReadyReply{}));
                               return serve(child_sock, producer);
                             },
                         .close_other_fds = false,
                         .name = name.c_str(),
                         .what = fmt::format("process worker {}", w)},
                        child_sock);
  }

  std::string await_ready(int w, std::optional<Clock::time_point> deadline) {
    auto& p = procs_[static_cast<size_t>(w)];
    if (!p.alive) return "it is not running";
    std::vector<std::string> f;
    int fds[kMaxFds];
    if (deadline) {
      pollfd q{p.sock.get(), POLLIN, 0};
      int r;
      do {
        r = ::poll(&q, 1, forkguard::detail::poll_ms(deadline));
      } while (r < 0 && errno == EINTR);
      if (r == 0) {
        return fmt::format(
            "it was not ready within {} ms (LoaderOptions::start_timeout): rebuilding its "
            "dataset or transform, or its init hook, did not return",
            setup_.start_timeout.count());
      }
    }
    if (!recv_message(p.sock.get(), f, fds)) {
      p.alive = false;
      collect(p, kExitGrace);
      return fmt::format("it {} before it was ready", how(p));
    }
    try {
      const WorkerReply reply = decode_worker_reply(f);
      if (std::holds_alternative<ReadyReply>(reply)) return {};
      if (const auto* failed = std::get_if<FailedReply>(&reply)) return failed->message;
      return "it answered its setup with a \"done\" message";
    } catch (const DataError& e) {
      return e.what();
    }
  }

  WorkerEvent died(int w) {
    auto& p = procs_[static_cast<size_t>(w)];
    p.alive = false;
    p.sock.reset();
    if (!collect(p, kExitGrace)) {  // it closed its socket yet lives on: make sure it is gone
      kill(p);
      collect(p, std::chrono::seconds(30));
    }
    WorkerEvent e;
    e.kind = WorkerEvent::Kind::kDied;
    e.worker = w;
    e.how = how(p);
    return e;
  }

  std::string how(const Proc& p) const {
    if (!p.collected) return "stopped (exit status unknown)";
    if (!p.lost.empty()) return "died with its fork server: " + p.lost;
    return p.status.to_string();
  }

  // Through a handle that names it even once its PID is reused: its Child (to its process group),
  // or the fork server's child's pidfd (none: it had exited by the time the reply was read).
  void kill(Proc& p) {
    if (p.child) {
      p.child.signal(SIGKILL);
    } else {
      p.server_child.signal(SIGKILL);
    }
  }

  // Waits for the worker's exit status: from the fork server, or by reaping our own child.
  bool collect(Proc& p, std::chrono::milliseconds timeout) {
    if (p.collected || p.pid <= 0) return true;
    if (via_) {
      try {
        if (auto status = ForkServer::get()->wait_exit(p.pid, timeout)) {
          p.status = launch::ExitStatus::from_wait_status(*status);
          p.collected = true;
        }
      } catch (const forkguard::launch::SpawnError&) {
        p.lost = ForkServer::get()->ended();  // its children die with it (PR_SET_PDEATHSIG)
        p.collected = true;
      }
      return p.collected;
    }
    auto status = p.child.wait_for(timeout);
    if (!status) return false;
    // Not started: it could not be reaped (not ours any more); its status stays unknown.
    if (status->kind != launch::ExitStatus::Kind::kNotStarted) {
      p.status = *status;
      p.collected = true;
    }
    return true;
  }

  WorkerSetup setup_;
  bool via_;
  std::vector<Proc> procs_;
  std::tuple<uint64_t, size_t, int> indices_written_{~0ull, 0, -1};  // (epoch, batch, slot)
  size_t next_ = 0;
};

std::string verdict_of_this_process() {
  auto state = probe::self_if_fork_unsafe();
  if (!state) return {};
  std::string evidence;
  for (const auto& e : state->evidence) {
    if (e.kind != probe::EvidenceKind::kEnvironment) evidence += "; " + e.detail;
  }
  return fmt::format("{}{}", probe::to_string(state->verdict), evidence);
}

}  // namespace

std::unique_ptr<Workers> start_process_workers(const WorkerSetup& setup, ProcessStart start) {
  const bool server = ForkServer::get() != nullptr;
  const bool describable =
      setup.dataset->describe().has_value() && setup.transform->describe().has_value();
  bool via_server = false;
  switch (start) {
    case ProcessStart::kForkServer:
      if (!server) {
        throw DataError(
            "process workers from the fork server: there is none; call forkguard::init(argc, "
            "argv) first in main()");
      }
      if (!describable) {
        throw DataError(
            "process workers from the fork server rebuild the dataset and transform from "
            "describe(); this dataset or transform returns nullopt (register a factory and "
            "describe() it, or use ProcessStart::kFork while the process is CUDA-clean)");
      }
      via_server = true;
      break;
    case ProcessStart::kAuto: via_server = server && describable; break;
    case ProcessStart::kFork: break;
  }
  if (!via_server) {
    if (auto dirty = verdict_of_this_process(); !dirty.empty()) {
      throw DataError(fmt::format(
          "refusing to fork process workers: this process (PID {}) holds CUDA state ({}), and "
          "forked workers would fail at their first CUDA call. Start them from the fork server "
          "(C++: call forkguard::init() first in main() and give the dataset and transform a "
          "describe(); Python: import forkguard before anything initializes CUDA, without "
          "FORKGUARD_NO_FORK_SERVER), or use thread workers",
          ::getpid(), dirty));
    }
  }
  return std::make_unique<ProcessWorkers>(setup, via_server);
}

}  // namespace forkguard::data::detail
