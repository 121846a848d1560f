// Process workers. Two ways to start one:
// - from the fork server (the zygote init() forked while the program was clean): the child is
//   CUDA-clean whatever this process did, and rebuilds the dataset and transform from their
//   registered descriptions;
// - by a guarded fork of this process (only while it is CUDA-clean): the child inherits the
//   objects as they are.
// Either way the child serves the same loop: slots arrive as memfds over SCM_RIGHTS, tasks as
// small messages, and each finished batch is answered with a small "done" message.
#include <fmt/format.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>
#include <variant>

#include "data/worker_processes.hpp"
#include "data/worker_protocol.hpp"
#include "data/workers.hpp"
#include "forkguard/data/error.hpp"
#include "forkguard/launch/exit_status.hpp"
#include "forkguard/launch/launcher.hpp"
#include "forkguard/probe/cuda_state.hpp"
#include "launch/child.hpp"
#include "launch/fork_server.hpp"

namespace forkguard::data::detail {
namespace {

using launch::detail::ForkServer;

constexpr const char* kZygoteFunction = "forkguard.data.worker";

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
  auto received = receive_setup(sock);
  if (!received) return 2;
  UniqueFd description = std::move(received->memfd);
  const SetupMessage* setup_message = nullptr;
  WorkerRequest request;
  try {
    request = decode_worker_request(received->fields);
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
// The processes are a WorkerProcesses pool; what is the image loader's is here: the setup, the
// slots each worker has mapped, tasks and their "done" replies.
class ProcessWorkers : public Workers {
 public:
  ProcessWorkers(const WorkerSetup& setup, bool via_server)
      : setup_(setup),
        procs_(setup.workers, via_server ? ForkServer::get() : nullptr),
        has_slot_(static_cast<size_t>(setup.workers)) {
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
      for (int w = 0; w < setup.workers; ++w) {
        if (via_server) {
          start_call(w, base.get(), base_size);
        } else {
          guarded_fork(w);
        }
      }
    } catch (...) {
      stop(true);
      throw;
    }
  }

  void await_started() override {
    const std::string failures = procs_.await_all_ready<WorkerReply>(
        setup_.start_timeout, "process worker reply",
        {.not_running = "it is not running",
         .timeout = fmt::format(
             "it was not ready within {} ms (LoaderOptions::start_timeout): rebuilding its "
             "dataset or transform, or its init hook, did not return",
             setup_.start_timeout.count()),
         .other = "it answered its setup with a \"done\" message",
         .closed = [this](int w) {
           return fmt::format("it {} before it was ready", procs_.how(w));
         }});
    if (!failures.empty()) {
      stop(true);
      throw WorkerError(fmt::format("process workers could not start: {}", failures), -1, -1, {});
    }
  }

  ~ProcessWorkers() override { stop(); }

  void submit(int worker, Task task) override {
    if (!procs_.alive(worker)) return;  // its death is reported by wait()
    const int sock = procs_.socket(worker);
    const pid_t pid = procs_.pid(worker);
    auto& has_slot = has_slot_[static_cast<size_t>(worker)];
    if (has_slot.size() <= static_cast<size_t>(task.slot)) {
      has_slot.resize(static_cast<size_t>(task.slot) + 1, false);
    }
    if (!has_slot[static_cast<size_t>(task.slot)]) {
      Slot& s = setup_.pool->get(task.slot);
      int fd = s.memory.fd();
      if (!send_message(sock, encode(SlotMessage{.slot = task.slot, .bytes = s.memory.size()}), &fd,
                        1) &&
          errno != EPIPE && errno != ECONNRESET) {
        throw WorkerError(fmt::format("cannot send slot {} to worker {} (PID {}): {}", task.slot,
                                      worker, pid, std::strerror(errno)),
                          worker, pid, task.indices);
      }
      has_slot[static_cast<size_t>(task.slot)] = true;
    }
    // The parts of a shared batch have the same indices: written once.
    const auto batch = std::make_tuple(task.epoch, task.batch, task.slot);
    if (!task.shared || batch != indices_written_) {
      put_indices(task.indices, setup_.pool->get(task.slot).memory.data(), setup_.producer.layout);
      indices_written_ = batch;
    }
    if (!send_message(sock, encode(TaskMessage{.epoch = task.epoch,
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
                        task.indices.size(), worker, pid, std::strerror(errno)),
            worker, pid, task.indices);
      }
    }
  }

  std::optional<WorkerEvent> wait(std::optional<Clock::time_point> deadline) override {
    while (true) {
      // Rotated, so that no worker starves the others.
      auto r = procs_.receive(deadline, next_);
      using Kind = WorkerProcesses::Received::Kind;
      if (r.kind == Kind::kNone || r.kind == Kind::kTimeout) return std::nullopt;
      next_ = static_cast<size_t>(r.worker) + 1;
      if (r.kind == Kind::kEnded) {
        WorkerEvent e;
        e.kind = WorkerEvent::Kind::kDied;
        e.worker = r.worker;
        e.how = procs_.how(r.worker);
        return e;
      }
      // Only "done" is expected here; a malformed one is the loader's DataError.
      const WorkerReply reply = decode_worker_reply(r.fields);
      if (const auto* done = std::get_if<DoneReply>(&reply)) return done->event(r.worker);
    }
  }

  void stop(bool now = false) override { procs_.stop(now); }

  pid_t pid(int worker) const override { return procs_.pid(worker); }
  std::vector<pid_t> pids() const override { return procs_.alive_pids(); }

 private:
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

  void start_call(int w, int setup_fd, size_t setup_size) {
    procs_.start_call(w, kZygoteFunction);
    if (const int e = procs_.send_setup(w, setup_size, setup_fd)) {
      // Its socket is closed by stop(): the worker sees EOF and exits.
      throw DataError(fmt::format("cannot send process worker {} its setup ({} bytes): {}", w,
                                  setup_size, std::strerror(e)));
    }
  }

  void guarded_fork(int w) {
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
    procs_.start_fork(w,
                      {.close_other_fds = false,
                       .name = name.c_str(),
                       .what = fmt::format("process worker {}", w)},
                      [&, w](int child_sock) {
                        // The worker: a copy of a CUDA-clean process, which may allocate. Only
                        // the init hook's own effect is probed here (what the hook did, after
                        // it ran).
                        if (why.empty() && !setup_.worker_init.empty()) {
                          why = prepare_worker(setup_, w);
                        }
                        if (!why.empty()) {
                          send_message(child_sock, encode(FailedReply{why}));
                          return 3;
                        }
                        send_message(child_sock, encode(ReadyReply{}));
                        return serve(child_sock, producer);
                      });
  }

  WorkerSetup setup_;
  WorkerProcesses procs_;
  std::vector<std::vector<bool>> has_slot_;  // by worker: the slots it has mapped
  std::tuple<uint64_t, size_t, int> indices_written_{~0ull, 0, -1};  // (epoch, batch, slot)
  size_t next_ = 0;
};

std::string verdict_of_this_process() {
  auto state = probe::self_if_cuda_unsafe();  // the workers run no OpenMP region
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
