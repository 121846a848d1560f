// forkguard.DataLoader's native side: the loader core's JobQueue (src/data/job_workers.hpp) with
// Python workers. The workers are forks of this interpreter (start_child, with CPython's own fork
// hooks around it, as os.fork runs them) or children of the Python fork server
// (python/forkguard/_server.py, attached by PID and socket), which run the body the setup bytes
// describe. A result comes back as a SlotBuffer: the slot's bytes, writable, through the buffer
// protocol (torch.frombuffer and numpy.frombuffer view it without a copy); the slot goes back to
// its worker when the last view of it dies. Everything crosses by name: _JobQueue's keywords are
// JobOptions' fields, next() answers a _JobResult, a worker's body returns a _JobBodyResult, and
// the core's enums are bound (_JobKind, _JobStart, _JobResult.Kind), never mirrored in Python.
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
#include "forkguard/data/loader.hpp"
#include "forkguard/data/rng.hpp"
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

// fn(job, slot_view) -> _JobBodyResult (JobBody::Result); close() when the worker ends.
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
      r = fn_(job, view).cast<Result>();
    } catch (const py::error_already_set& e) {
      // The body reports the user's errors itself: this is the body's own failure.
      r = {.kind = fdd::JobKind::kError, .message = e.what()};
    } catch (const py::cast_error& e) {
      r = {.kind = fdd::JobKind::kError,
           .message = std::string("the worker's body returned no _JobBodyResult: ") + e.what()};
    }
    view.cast<WorkerSlotView&>().close();
    return r;
  }

 private:
  py::object fn_;
};

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

// One answer of _JobQueue.next(): the core's JobResult, with a kResult's bytes as a SlotBuffer
// (made once: it gives the slot back when the last reference to it dies).
struct QueueResult {
  fdd::JobResult r;
  std::shared_ptr<SlotBuffer> buffer{};  // kResult only
};

struct Queue {
  std::shared_ptr<fdd::JobQueue> q;
  std::shared_ptr<forkguard::launch::detail::ForkServer> server;

  // `o` as the caller named it; kFork: `make_body` builds a worker's body (called in the
  // workers only); kServer: the Python fork server, attached by PID and socket.
  Queue(fdd::JobOptions o, py::object make_body, std::optional<int> server_pid,
        std::optional<int> server_sock) {
    switch (o.start) {
      case fdd::JobStart::kServer:
        if (!server_pid || !server_sock) throw py::value_error("a server start needs the server");
        server = forkguard::launch::detail::ForkServer::attach(*server_pid, *server_sock);
        o.server = server.get();
        break;
      case fdd::JobStart::kFork:
        make_body_ = std::move(make_body);
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
        if (auto* zygote = forkguard::launch::detail::ForkServer::get()) {
          o.close_in_child.push_back(zygote->fd());
        }
        break;
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

  // torch's in_order as the queue's order of delivery (and of handing out jobs).
  static fdd::JobQueue::Order order(bool in_order) {
    return in_order ? fdd::JobQueue::Order::kJobs : fdd::JobQueue::Order::kDone;
  }

  // Writes `data` into the next job's slot and submits it; the job's number.
  uint64_t submit(py::buffer data, int worker, bool in_order) {
    auto info = data.request();
    auto next = q->next_slot(worker, order(in_order));
    const auto n = static_cast<size_t>(info.size * info.itemsize);
    next.memory->reserve(n);
    std::memcpy(next.memory->data(), info.ptr, n);
    return q->submit(next, n);
  }

  std::optional<QueueResult> next(std::optional<double> timeout, bool in_order) {
    std::optional<fdd::JobResult> r;
    {
      py::gil_scoped_release nogil;
      std::optional<std::chrono::milliseconds> t;
      if (timeout) t = std::chrono::milliseconds(static_cast<long long>(*timeout * 1000));
      r = q->next(t, order(in_order));
    }
    if (!r) return std::nullopt;
    QueueResult out{.r = std::move(*r)};
    if (out.r.kind == fdd::JobResult::Kind::kResult) {
      out.buffer = std::make_shared<SlotBuffer>(q, out.r.slot, out.r.bytes);
    }
    return out;
  }

 private:
  py::object make_body_;  // kFork: builds a worker's body, in the worker
};

}  // namespace

void bind_dataloader(py::module_& m) {
  using forkguard::launch::ExitStatus;
  namespace fd = forkguard::data;

  // DataLoader(seed=, bad_sample="skip") draws from the C++ loader's functions, not copies of
  // them: the same seed gives the same per-sample seeds and the same substitutes in both.
  m.def(
      "sample_key",
      [](uint64_t seed, uint64_t epoch, uint64_t index, uint64_t stream) {
        return fd::sample_key(seed, epoch, index, stream);
      },
      py::arg("seed"), py::arg("epoch"), py::arg("index"), py::arg("stream") = 0,
      "The 64-bit key of (seed, epoch, index, stream): with stream 0, a sample's seed "
      "(forkguard/data/rng.hpp).");
  m.def("substitute_index", &fd::substitute_index, py::arg("seed"), py::arg("epoch"),
        py::arg("index"), py::arg("attempt"), py::arg("size"),
        "bad_sample='skip': the attempt-th sample (from 0) that replaces the failed sample "
        "`index` of a dataset of `size` samples; never `index` itself when size > 1 "
        "(forkguard/data/rng.hpp).");
  m.attr("MAX_SUBSTITUTES") = fd::kDefaultMaxSubstitutes;

  py::enum_<fdd::JobKind>(m, "_JobKind")
      .value("OK", fdd::JobKind::kOk)
      .value("ERROR", fdd::JobKind::kError)
      .value("END", fdd::JobKind::kEnd)
      .value("CUDA", fdd::JobKind::kCuda);

  py::enum_<fdd::JobStart>(m, "_JobStart")
      .value("FORK", fdd::JobStart::kFork)
      .value("SERVER", fdd::JobStart::kServer);

  // What a worker's body returns for a job (JobBody::Result).
  const fdd::JobBody::Result body_result;
  py::class_<fdd::JobBody::Result>(m, "_JobBodyResult")
      .def(py::init([](fdd::JobKind kind, size_t bytes, std::string message) {
             return fdd::JobBody::Result{.kind = kind, .bytes = bytes, .message = message};
           }),
           py::kw_only(), py::arg("kind") = body_result.kind, py::arg("bytes") = body_result.bytes,
           py::arg("message") = body_result.message)
      .def_readonly("kind", &fdd::JobBody::Result::kind)
      .def_readonly("bytes", &fdd::JobBody::Result::bytes)
      .def_readonly("message", &fdd::JobBody::Result::message);

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

  // How a worker ended (launch::ExitStatus).
  py::class_<ExitStatus>(m, "_ExitStatus")
      .def_property_readonly("signal",
                             [](const ExitStatus& s) {  // the signal that killed it, else 0
                               return s.kind == ExitStatus::Kind::kSignaled ? s.signal : 0;
                             })
      .def_property_readonly("code",
                             [](const ExitStatus& s) {  // its exit code, else -1
                               return s.kind == ExitStatus::Kind::kExited ? s.code : -1;
                             })
      .def_readonly("core_dumped", &ExitStatus::core_dumped)
      .def("__str__", &ExitStatus::to_string)
      .def("__repr__", [](const ExitStatus& s) { return "<_ExitStatus: " + s.to_string() + ">"; });

  py::class_<QueueResult> result(m, "_JobResult");
  py::enum_<fdd::JobResult::Kind>(result, "Kind")
      .value("RESULT", fdd::JobResult::Kind::kResult)
      .value("DIED", fdd::JobResult::Kind::kDied)
      .value("TIMEOUT", fdd::JobResult::Kind::kTimeout)
      .export_values();
  result.def_property_readonly("kind", [](const QueueResult& x) { return x.r.kind; })
      .def_property_readonly("job", [](const QueueResult& x) { return x.r.job; })
      .def_property_readonly("worker", [](const QueueResult& x) { return x.r.worker; })
      .def_property_readonly("pid", [](const QueueResult& x) { return x.r.pid; })
      // RESULT: the job's kind, its bytes (a _SlotBuffer) and its message (bytes)
      .def_property_readonly("job_kind", [](const QueueResult& x) { return x.r.job_kind; })
      .def_property_readonly("buffer", [](const QueueResult& x) { return x.buffer; })
      .def_property_readonly("message", [](const QueueResult& x) { return py::bytes(x.r.message); })
      // DIED: its exit status, and the jobs it held and did not do, in order
      .def_property_readonly("status",
                             [](const QueueResult& x) -> std::optional<ExitStatus> {
                               if (x.r.kind != fdd::JobResult::Kind::kDied) return std::nullopt;
                               return x.r.status;
                             })
      .def_property_readonly("held", [](const QueueResult& x) { return x.r.held; });

  // The constructor's keywords are JobOptions' fields, with its defaults (the fork hooks and the
  // server itself are this binding's).
  const fdd::JobOptions options;
  py::class_<Queue>(m, "_JobQueue")
      .def(py::init([](int workers, size_t prefetch, fdd::JobStart start, py::object body,
                       std::vector<int> close_in_child, std::optional<int> server_pid,
                       std::optional<int> server_sock, std::string server_function, py::bytes setup,
                       double start_timeout, size_t slot_bytes, int pin_device, std::string name) {
             return std::make_unique<Queue>(
                 fdd::JobOptions{
                     .workers = workers,
                     .prefetch = prefetch,
                     .start = start,
                     .close_in_child = std::move(close_in_child),
                     .server_function = std::move(server_function),
                     .setup = std::string(setup),
                     .start_timeout =
                         std::chrono::milliseconds(static_cast<long long>(start_timeout * 1000)),
                     .slot_bytes = slot_bytes,
                     .pin_device = pin_device,
                     .name = std::move(name),
                 },
                 std::move(body), server_pid, server_sock);
           }),
           py::kw_only(), py::arg("workers") = options.workers,
           py::arg("prefetch") = options.prefetch, py::arg("start") = options.start,
           py::arg("body") = py::none(), py::arg("close_in_child") = options.close_in_child,
           py::arg("server_pid") = py::none(), py::arg("server_sock") = py::none(),
           py::arg("server_function") = options.server_function,
           py::arg("setup") = py::bytes(options.setup),
           py::arg("start_timeout") = std::chrono::duration<double>(options.start_timeout).count(),
           py::arg("slot_bytes") = options.slot_bytes, py::arg("pin_device") = options.pin_device,
           py::arg("name") = options.name)
      .def("await_started", &Queue::await_started)
      .def("wants_job", [](const Queue& s) { return s.q->wants_job(); })
      .def("submit", &Queue::submit, py::arg("data"), py::arg("worker") = -1,
           py::arg("in_order") = true)
      .def("next", &Queue::next, py::arg("timeout") = py::none(), py::arg("in_order") = true)
      .def("reactivate", [](Queue& s) { s.q->reactivate(); })
      .def("pid", [](const Queue& s, int w) { return s.q->pid(w); })
      .def("pids", [](const Queue& s) { return s.q->pids(); })
      // torch's Process.terminate()/kill() of a worker: through its pidfd, never by PID.
      .def(
          "signal", [](Queue& s, int w, int sig) { s.q->signal(w, sig); }, py::kw_only(),
          py::arg("worker"), py::arg("sig"))
      .def(
          "exit_status",
          [](Queue& s, int w, double timeout) {
            py::gil_scoped_release nogil;
            return s.q->exit_status(
                w, std::chrono::milliseconds(static_cast<long long>(timeout * 1000)));
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
