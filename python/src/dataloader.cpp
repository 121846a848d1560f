// forkguard.DataLoader's native side: the loader core's JobQueue (src/data/job_workers.hpp) with
// Python workers. The workers are forks of this interpreter (start_child, with CPython's own fork
// hooks around it, as os.fork runs them) or children of the Python fork server
// (python/forkguard/_server.py, attached by PID and socket), which run the body the setup bytes
// describe. A result comes back as a SlotBuffer: the slot's bytes, writable, through the buffer
// protocol (torch.frombuffer and numpy.frombuffer view it without a copy); the slot goes back to
// its worker when the last view of it dies.
#include <Python.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <csignal>
#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include "data/job_workers.hpp"
#include "forkguard/data/error.hpp"
#include "launch/fork_server.hpp"

namespace py = pybind11;
namespace fdd = forkguard::data::detail;

namespace {

// The worker's slot as Python sees it while a job runs: input() and reserve(n).
class WorkerSlotView {
 public:
  WorkerSlotView(fdd::JobSlot& slot, size_t input) : slot_(&slot), input_(input) {}
  py::memoryview input() const {
    check();
    return py::memoryview::from_memory(slot_->data(), static_cast<ssize_t>(input_), true);
  }
  // A writable view of the slot's first `bytes` bytes (grown to hold them).
  py::memoryview reserve(size_t bytes) const {
    check();
    slot_->reserve(bytes);
    return py::memoryview::from_memory(slot_->data(), static_cast<ssize_t>(bytes), false);
  }
  void close() { slot_ = nullptr; }

 private:
  void check() const {
    if (slot_ == nullptr) throw py::value_error("this job's slot is no longer this job's");
  }
  fdd::JobSlot* slot_;
  size_t input_;
};

// fn(job, slot_view) -> (kind, bytes, message); close() when the worker ends.
class PyBody : public fdd::JobBody {
 public:
  explicit PyBody(py::object fn) : fn_(std::move(fn)) {}
  ~PyBody() override {
    py::gil_scoped_acquire gil;
    try {
      if (py::hasattr(fn_, "close")) fn_.attr("close")();
    } catch (const py::error_already_set& e) {
      PySys_WriteStderr("forkguard: a worker's close() failed: %s\n", e.what());
    }
    fn_ = py::object();
  }
  Result run(uint64_t job, fdd::JobSlot& slot, size_t input) override {
    py::gil_scoped_acquire gil;
    auto view = py::cast(WorkerSlotView(slot, input));
    Result r;
    try {
      auto t = fn_(job, view).cast<py::tuple>();
      r.kind = static_cast<fdd::JobKind>(t[0].cast<int>());
      r.bytes = t[1].cast<size_t>();
      r.message = t[2].cast<std::string>();
    } catch (const py::error_already_set& e) {
      // The body reports the user's errors itself: this is the body's own failure.
      r.kind = fdd::JobKind::kError;
      r.bytes = 0;
      r.message = e.what();
    }
    view.cast<WorkerSlotView&>().close();
    return r;
  }

 private:
  py::object fn_;
};

struct Queue;

// A result's bytes; the slot is its worker's again once this (and every view of it) is gone.
struct SlotBuffer {
  SlotBuffer(std::shared_ptr<fdd::JobQueue> q, int s, size_t n)
      : queue(std::move(q)), slot(s), bytes(n) {}
  SlotBuffer(const SlotBuffer&) = delete;  // one release per result
  SlotBuffer& operator=(const SlotBuffer&) = delete;
  ~SlotBuffer() { queue->release(slot); }
  std::shared_ptr<fdd::JobQueue> queue;
  int slot;
  size_t bytes;
};

struct Queue {
  std::shared_ptr<fdd::JobQueue> q;
  std::shared_ptr<forkguard::launch::detail::ForkServer> server;

  Queue(int workers, size_t prefetch, const std::string& start, py::object make_body,
        std::optional<int> server_pid, std::optional<int> server_sock, std::string function,
        py::bytes setup, double start_timeout, size_t slot_bytes, std::string name,
        std::vector<int> close_in_child, int pin_device) {
    fdd::JobOptions o;
    o.workers = workers;
    o.prefetch = prefetch;
    o.slot_bytes = slot_bytes;
    o.pin_device = pin_device;
    o.name = std::move(name);
    o.start_timeout = std::chrono::milliseconds(static_cast<long long>(start_timeout * 1000));
    if (start == "server") {
      if (!server_pid || !server_sock) throw py::value_error("a server start needs the server");
      server = forkguard::launch::detail::ForkServer::attach(*server_pid, *server_sock);
      o.start = fdd::JobStart::kServer;
      o.server = server.get();
      o.server_function = std::move(function);
      o.setup = std::string(setup);
    } else if (start == "fork") {
      o.start = fdd::JobStart::kFork;
      make_body_ = std::move(make_body);  // called in the workers only
      o.body = [make = &make_body_](int w) -> std::unique_ptr<fdd::JobBody> {
        try {
          return std::make_unique<PyBody>((*make)(w));
        } catch (py::error_already_set& e) {
          throw forkguard::data::DataError(e.what());
        }
      };
      o.before_fork = [] { PyOS_BeforeFork(); };
      o.after_fork_parent = [] { PyOS_AfterFork_Parent(); };
      o.after_fork_child = [] { PyOS_AfterFork_Child(); };
      o.close_in_child = close_in_child;
      if (auto* zygote = forkguard::launch::detail::ForkServer::get()) {
        o.close_in_child.push_back(zygote->fd());
      }
    } else {
      throw py::value_error("start must be \"fork\" or \"server\"");
    }
    q = std::make_shared<fdd::JobQueue>(std::move(o));
  }
  ~Queue() {
    if (q) {
      py::gil_scoped_release nogil;
      q->stop(false);
      q->detach_server();  // batches still alive keep the queue, not the server
    }
  }

  void await_started() {
    py::gil_scoped_release nogil;
    q->await_started();
  }

  // Writes `data` into the next job's slot and submits it; (job, worker).
  // torch's in_order as the queue's order of delivery (and of handing out jobs).
  static fdd::JobQueue::Order order(bool in_order) {
    return in_order ? fdd::JobQueue::Order::kJobs : fdd::JobQueue::Order::kDone;
  }

  py::tuple submit(py::buffer data, int worker, bool in_order) {
    auto info = data.request();
    auto next = q->next_slot(worker, order(in_order));
    const auto n = static_cast<size_t>(info.size * info.itemsize);
    next.memory->reserve(n);
    std::memcpy(next.memory->data(), info.ptr, n);
    return py::make_tuple(q->submit(next, n), next.worker);
  }

  py::object next(std::optional<double> timeout, bool in_order) {
    std::optional<fdd::JobResult> r;
    {
      py::gil_scoped_release nogil;
      std::optional<std::chrono::milliseconds> t;
      if (timeout) t = std::chrono::milliseconds(static_cast<long long>(*timeout * 1000));
      r = q->next(t, order(in_order));
    }
    if (!r) return py::none();
    switch (r->kind) {
      case fdd::JobResult::Kind::kResult: {
        auto buf = std::make_shared<SlotBuffer>(q, r->slot, r->bytes);
        return py::make_tuple("result", r->job, r->worker, r->pid, static_cast<int>(r->job_kind),
                              py::cast(buf), py::bytes(r->message));
      }
      case fdd::JobResult::Kind::kTimeout:
        return py::make_tuple("timeout", r->job, r->worker, r->pid);
      case fdd::JobResult::Kind::kDied: break;
    }
    const auto& s = r->status;
    const bool signaled = s.kind == forkguard::launch::ExitStatus::Kind::kSignaled;
    return py::make_tuple("died", r->worker, r->pid, signaled ? s.signal : 0,
                          s.kind == forkguard::launch::ExitStatus::Kind::kExited ? s.code : -1,
                          s.to_string(), r->held);
  }

 private:
  py::object make_body_;  // kFork: builds a worker's body, in the worker
};

}  // namespace

void bind_dataloader(py::module_& m) {
  py::class_<WorkerSlotView>(m, "_WorkerSlot")
      .def("input", &WorkerSlotView::input)
      .def("reserve", &WorkerSlotView::reserve, py::arg("bytes"));

  py::class_<SlotBuffer, std::shared_ptr<SlotBuffer>>(m, "_SlotBuffer", py::buffer_protocol())
      .def_buffer([](SlotBuffer& b) {
        auto* data = const_cast<std::byte*>(b.queue->slot_data(b.slot));
        return py::buffer_info(data, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<ssize_t>(b.bytes)}, {1}, false);
      })
      .def("__len__", [](const SlotBuffer& b) { return b.bytes; });

  py::class_<Queue>(m, "_JobQueue")
      .def(py::init<int, size_t, const std::string&, py::object, std::optional<int>,
                    std::optional<int>, std::string, py::bytes, double, size_t, std::string,
                    std::vector<int>, int>(),
           py::arg("workers"), py::arg("prefetch"), py::arg("start"), py::arg("make_body"),
           py::arg("server_pid"), py::arg("server_sock"), py::arg("function"), py::arg("setup"),
           py::arg("start_timeout"), py::arg("slot_bytes"), py::arg("name"),
           py::arg("close_in_child") = std::vector<int>{}, py::arg("pin_device") = -1)
      .def("await_started", &Queue::await_started)
      .def("wants_job", [](const Queue& s) { return s.q->wants_job(); })
      .def("submit", &Queue::submit, py::arg("data"), py::arg("worker") = -1,
           py::arg("in_order") = true)
      .def("next", &Queue::next, py::arg("timeout") = py::none(), py::arg("in_order") = true)
      .def("reactivate", [](Queue& s) { s.q->reactivate(); })
      .def("pid", [](const Queue& s, int w) { return s.q->pid(w); })
      .def("pids", [](const Queue& s) { return s.q->pids(); })
      .def(
          "exit_status",
          [](Queue& s, int w, double timeout) -> py::object {
            std::optional<forkguard::launch::ExitStatus> st;
            {
              py::gil_scoped_release nogil;
              st = s.q->exit_status(
                  w, std::chrono::milliseconds(static_cast<long long>(timeout * 1000)));
            }
            if (!st) return py::none();
            const bool sig = st->kind == forkguard::launch::ExitStatus::Kind::kSignaled;
            return py::make_tuple(
                sig ? st->signal : 0,
                st->kind == forkguard::launch::ExitStatus::Kind::kExited ? st->code : -1,
                st->to_string());
          },
          py::arg("worker"), py::arg("timeout") = 0.0)
      .def(
          "stop",
          [](Queue& s, bool now) {
            py::gil_scoped_release nogil;
            s.q->stop(now);
            // The server's socket duplicate goes with the workers: the server sees EOF (and
            // exits) as soon as its owner closes its own end.
            s.q->detach_server();
            s.server.reset();
          },
          py::arg("now") = false);

  m.def(
      "_serve_jobs_after_setup",
      [](int sock, py::object make) {
        // In a worker the Python fork server started: the setup builds the body.
        return fdd::serve_jobs_after_setup(
            sock, [&make](std::string_view setup, int worker) -> std::unique_ptr<fdd::JobBody> {
              try {
                return std::make_unique<PyBody>(
                    make(py::bytes(setup.data(), setup.size()), worker));
              } catch (py::error_already_set& e) {
                throw forkguard::data::DataError(e.what());
              }
            });
      },
      py::arg("sock"), py::arg("make"));
}
