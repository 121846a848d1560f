// forkguard._native._supervise_notebook: notebook_launch's ranks supervised by the C++ supervisor
// (launch/supervisor.hpp), the same one `forkguard run` uses: same rank environment, same stop
// policy, same output prefix and report. The ranks come from the interpreter fork server
// (python/forkguard/_server.py), attached by PID and socket; it speaks the C++ fork server's
// protocol.
//
// Per rank and attempt a memfd carries the cloudpickled function in and the rank's pickled
// outcome out (no pipe to drain while the rank runs: a 200 MB return value is one copy each way).
// The memfds of the last attempt are handed to Python, which reads the outcomes.
//
// The GIL is released for the whole launch; it is taken only to write rank output to
// sys.stdout / sys.stderr and, every kInterruptPoll, to run Python's signal handlers: a
// KeyboardInterrupt there forwards SIGINT to the ranks, waits for them by the stop policy, then
// propagates.
//
// Thread-safety: one launch at a time per process (the supervisor's rule).
#include <Python.h>
#include <fmt/format.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "detail/fd.hpp"
#include "forkguard/error.hpp"
#include "forkguard/launch/launcher.hpp"
#include "launch/child.hpp"
#include "launch/fork_server.hpp"
#include "launch/supervisor.hpp"

namespace py = pybind11;
namespace fl = forkguard::launch;

namespace {

py::str decode_text(std::string_view text) {
  PyObject* o = PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace");
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

// Rank output and notices to sys.stdout / sys.stderr as they are when written (a notebook's
// cell output, pytest's capture), not to fd 1 and 2.
class PythonSink final : public fl::detail::OutputSink {
 public:
  void rank_output(int, bool is_err, std::string_view text) override {
    write(is_err ? "stderr" : "stdout", text);
  }
  void notice(std::string_view text) override {
    write("stderr", "forkguard: " + std::string(text) + "\n");
  }

 private:
  static void write(const char* stream, std::string_view text) {
    py::gil_scoped_acquire gil;
    py::object s = py::module_::import("sys").attr(stream);
    s.attr("write")(decode_text(text));
    s.attr("flush")();
  }
};

// What _supervise_notebook gives back (_NotebookResult, read-only attributes).
struct NotebookResult {
  std::string json{};         // the result, as `forkguard run --json-report` writes it
  std::string report{};       // the launcher's report, as `forkguard run` prints it
  std::vector<int> memfds{};  // each rank's outcome by local rank (-1: none); the caller's to close
};

NotebookResult supervise_notebook(int server_pid, int server_sock, const py::bytes& payload_bytes,
                                  int nproc, const std::vector<std::string>& args, double grace,
                                  bool bind_gpus, int max_restarts, const std::string& master_addr,
                                  std::optional<int> master_port,
                                  const std::map<std::string, std::string>& env,
                                  std::optional<double> timeout, int nnodes, int node_rank) {
  fl::Options o;
  o.nproc = nproc;
  o.start = fl::StartMethod::kForkServer;
  o.gpus.bind = bind_gpus;
  o.max_restarts = max_restarts;
  // Placed by the caller (accelerate's num_nodes / node_rank), never by Slurm or MPI variables
  // in the notebook's environment.
  o.nodes.nnodes = nnodes;
  o.nodes.node_rank = node_rank;
  o.nodes.master_addr = master_addr;
  o.nodes.master_port = master_port;
  o.nodes.standalone = !master_port.has_value();
  o.env = env;
  o.stop.grace = std::chrono::milliseconds(static_cast<long long>(grace * 1000));
  if (timeout) o.timeout = std::chrono::milliseconds(static_cast<long long>(*timeout * 1000));

  const std::string payload(payload_bytes);
  std::vector<forkguard::detail::UniqueFd> memfds(static_cast<size_t>(nproc));
  auto server = fl::detail::ForkServer::attach(server_pid, server_sock);
  fl::detail::Job job;
  job.entry = "notebook";
  job.args = args;
  job.server = server.get();
  job.rank_fd = [&](int local_rank, int) {
    forkguard::detail::UniqueFd fd(::memfd_create("forkguard-notebook-rank", MFD_CLOEXEC));
    if (!fd) throw forkguard::SystemError("memfd_create for a notebook rank", errno);
    for (size_t at = 0; at < payload.size();) {
      ssize_t n =
          ::pwrite(fd.get(), payload.data() + at, payload.size() - at, static_cast<off_t>(at));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw forkguard::SystemError("writing a notebook rank's payload", errno);
      at += static_cast<size_t>(n);
    }
    auto& slot = memfds[static_cast<size_t>(local_rank)];
    slot = std::move(fd);  // the previous attempt's outcome is not needed any more
    return slot.get();
  };

  PythonSink sink;
  std::optional<py::error_already_set> interrupt;  // what Python's signal handler raised
  auto interrupted = [&]() -> int {
    if (interrupt) return 0;
    py::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() == 0) return 0;
    interrupt.emplace();  // fetches the error (KeyboardInterrupt)
    return SIGINT;
  };
  fl::Result result;
  {
    py::gil_scoped_release release;
    try {
      result = fl::detail::supervise(o, job, {.sink = &sink, .interrupted = interrupted});
    } catch (const fl::RankFailedError& e) {
      result = e.result();
    }
  }
  if (interrupt) {
    interrupt->restore();
    throw py::error_already_set();
  }
  NotebookResult out{.json = result.to_json(), .report = result.report(), .memfds = {}};
  for (auto& fd : memfds) out.memfds.push_back(fd ? fd.release() : -1);
  return out;
}

// forkguard._native._ServerLink: this process's one reader of the Python fork server's socket,
// the object DataLoader and notebook_launch attach to as well (ForkServer::attach), so an exit
// report or a reply is never read by one user and lost to another. The Python side sends its
// own requests through it (exchange: the request and its reply under one lock) and claims the
// exit reports of forkguard.guard()'s children (wait_exit).
class ServerLink {
 public:
  ServerLink(pid_t pid, int sock) : server_(fl::detail::ForkServer::attach(pid, sock)) {}

  int fd() const { return live().fd(); }

  // The reply's fields, or None when none came within `timeout` seconds (None: no limit).
  py::object exchange(const std::vector<std::string>& fields, const std::vector<int>& fds,
                      std::optional<double> timeout) {
    std::optional<std::chrono::milliseconds> limit;
    if (timeout) limit = std::chrono::milliseconds(static_cast<long long>(*timeout * 1000));
    std::optional<std::vector<std::string>> reply;
    {
      py::gil_scoped_release nogil;
      reply = live().exchange(fields, fds, limit);
    }
    if (!reply) return py::none();
    py::list out;
    for (const auto& f : *reply) {
      out.append(py::reinterpret_steal<py::str>(
          PyUnicode_DecodeUTF8(f.data(), static_cast<Py_ssize_t>(f.size()), "surrogateescape")));
    }
    return out;
  }

  // A start request (guard_start) and the child it started: the server's reply is
  // "started PID" with the child's pidfd, which the server opened before it could
  // reap the child (so it is that child's, whatever happens to the PID later), or "error
  // MESSAGE", raised as an Error with the message; so is no reply within `timeout` seconds.
  fl::detail::ServerChild start_child(const std::vector<std::string>& fields,
                                      const std::vector<int>& fds, std::optional<double> timeout) {
    std::optional<std::chrono::milliseconds> limit;
    if (timeout) limit = std::chrono::milliseconds(static_cast<long long>(*timeout * 1000));
    std::optional<std::vector<std::string>> reply;
    forkguard::detail::UniqueFd pidfd;
    {
      py::gil_scoped_release nogil;
      reply = live().exchange(fields, fds, limit, &pidfd);
    }
    if (!reply) {
      throw fl::SpawnError(py::str("no answer within {:g} s").format(*timeout).cast<std::string>());
    }
    std::optional<fl::detail::ZygoteReply> decoded;
    try {
      decoded = fl::detail::decode_zygote_reply(*reply);
    } catch (const forkguard::Error& e) {
      throw fl::SpawnError(fmt::format("an unexpected reply: {}", e.what()));
    }
    if (const auto* error = std::get_if<fl::detail::ErrorReply>(&*decoded)) {
      throw fl::SpawnError(error->message);
    }
    const auto* started = std::get_if<fl::detail::StartedReply>(&*decoded);
    if (started == nullptr) throw fl::SpawnError("an unexpected reply: an exit report");
    return fl::detail::ServerChild(started->pid, std::move(pidfd));
  }

  std::optional<int> wait_exit(pid_t pid, double timeout) {
    py::gil_scoped_release nogil;
    return live().wait_exit(pid, std::chrono::milliseconds(static_cast<long long>(timeout * 1000)));
  }

  // This link's share of the socket: the server sees EOF once every attachment let go.
  void close() { server_.reset(); }

 private:
  fl::detail::ForkServer& live() const {
    if (!server_) throw py::value_error("the fork server link is closed");
    return *server_;
  }
  std::shared_ptr<fl::detail::ForkServer> server_;
};

}  // namespace

void bind_notebook(py::module_& m) {
  py::class_<ServerLink>(m, "_ServerLink")
      .def(py::init<pid_t, int>(), py::arg("pid"), py::arg("sock"))
      .def("fd", &ServerLink::fd)
      .def("exchange", &ServerLink::exchange, py::arg("fields"),
           py::arg("fds") = std::vector<int>{}, py::arg("timeout") = py::none())
      .def("start_child", &ServerLink::start_child, py::arg("fields"),
           py::arg("fds") = std::vector<int>{}, py::arg("timeout") = py::none())
      .def("wait_exit", &ServerLink::wait_exit, py::arg("pid"), py::arg("timeout"))
      .def("close", &ServerLink::close);
  py::class_<NotebookResult>(m, "_NotebookResult")
      .def_readonly("json", &NotebookResult::json)
      .def_readonly("report", &NotebookResult::report)
      .def_readonly("memfds", &NotebookResult::memfds);
  // Keywords only. What the launch needs from its caller has no default (the server, the
  // payload, the ranks' count, cwd and sys.path, the stop grace: notebook_launch's, not
  // launch::Options' 30 s); the rest defaults as launch::Options has it (master_addr "": 127.0.0.1;
  // a single node).
  const fl::Options defaults;
  m.def("_supervise_notebook", &supervise_notebook, py::kw_only(), py::arg("server_pid"),
        py::arg("server_sock"), py::arg("payload"), py::arg("nproc"), py::arg("args"),
        py::arg("grace"), py::arg("bind_gpus") = defaults.gpus.bind,
        py::arg("max_restarts") = defaults.max_restarts,
        py::arg("master_addr") = defaults.nodes.master_addr, py::arg("master_port") = py::none(),
        py::arg("env") = std::map<std::string, std::string>{}, py::arg("timeout") = py::none(),
        py::arg("nnodes") = 1, py::arg("node_rank") = 0,
        "notebook_launch's ranks under the C++ supervisor: a _NotebookResult (the result as "
        "JSON, the report, each rank's memfd by local rank).");
}
