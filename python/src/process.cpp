// Processes the Python package starts, started by the one process layer (launch/child.hpp) and
// held by their Child handle: a pidfd, never a bare PID that could be reused.
//
//   p = _native.start_process([sys.executable, script, "3"], pass_fds=[sock.fileno()])
//   c = _native.start_python_child(fn, stdout_fd=out, stderr_fd=err, close_fds=[sock],
//                                  reap_tree=True)   # fn() runs in a fork of this interpreter
//   p.pid; p.poll()  # None while it runs, else the return code (-9: killed by SIGKILL)
//   p.wait(timeout=10.0)  # the return code, or None after `timeout` seconds
//   c.wait_status  # the raw wait status once reaped (os.waitpid's), else None
//   p.kill(); c.signal(signal.SIGTERM)
//
// start_process: stdin /dev/null, stdout and stderr this process's, `pass_fds` at their numbers,
// every other fd closed; it stays in this process's group with no parent-death signal (it ends
// when its socket says so, as a subprocess.Popen would).
//
// start_python_child: os.fork's meaning (the child keeps every fd but `close_fds`, CPython's fork
// hooks run around it) with start_child's set-up: the parent-death signal (SIGKILL), its own
// process group (unless `new_group` is false), the stop signals at their defaults and none blocked,
// stdout/stderr where asked; with `reap_tree` under a reaper that takes every descendant with it
// when it ends or when this process dies, as a rank of the C++ fork server. fn()'s result is the
// exit code (an exception: its traceback on stderr, exit code 1); fn may leave by os._exit itself.
// Python's own SIGPIPE rule (ignored) holds in the child as in any interpreter.
//
// A handle copied into a forked child (a fork of its owner) does nothing there: its process is
// the owner's to signal and reap.
//
// serve_zygote: the interpreter fork server's loop (python/forkguard/_server.py hands it its socket
// once it has preloaded): the one fork-server loop (launch/zygote_loop.hpp) with Python handlers.
// It sends `ready`, then serves requests until EOF: each is decoded as a typed message
// (decode_server_request: a malformed one is answered with why) and given to the handler of its
// kind (a `call`: of its function) as handler(fds, own, **fields): `fds` came with it (the
// handler closes them), `own` are the loop's fds, which no child may keep (the socket, the
// children's pidfds). A handler returns a ChildProcess it started (the loop takes its Child, holds
// and reaps it, replies `started PID` with its pidfd and `exit PID STATUS` once it exited), a str
// (an `error` reply), or a reply as (kind, {fields}), encoded and checked here. At EOF every child
// left is killed and reaped.
//
//   _native.serve_zygote(fd, {"pid": os.getpid(), "preloaded": "[]", "errors": "{}"},
//                        {"entry": notebook_rank, "preload": preload, ...})
//
// Thread-safety: one handle per owner; wait() releases the GIL. start_python_child must be
// called by a thread holding the GIL, like os.fork; so must serve_zygote, which releases it while
// it waits.
#include <Python.h>
#include <fcntl.h>
#include <poll.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <signal.h>
#include <unistd.h>

#include <fmt/format.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "detail/deadline.hpp"
#include "detail/fd.hpp"
#include "detail/seqpacket.hpp"
#include "forkguard/error.hpp"
#include "launch/child.hpp"
#include "launch/zygote_loop.hpp"
#include "launch/zygote_protocol.hpp"

namespace py = pybind11;
namespace fl = forkguard::launch;

namespace {

// subprocess's return code: the exit code, or minus the signal.
int returncode(const fl::ExitStatus& s) {
  return s.kind == fl::ExitStatus::Kind::kSignaled ? -s.signal : s.code;
}

class ChildProcess {
 public:
  explicit ChildProcess(fl::detail::Child child)
      : child_(std::move(child)), pid_(child_.pid()), owner_(::getpid()) {}
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;  // a fork's copy leaves it alone

  int pid() const { return pid_; }
  int pidfd() const { return mine() ? child_.pidfd() : -1; }
  // Its Child, for a new holder (the fork server's loop); this handle is empty afterwards.
  fl::detail::Child take() {
    if (!mine()) throw forkguard::Error("a fork's copy of a child's handle cannot give it away");
    return std::move(child_);
  }

  std::optional<int> poll() {
    if (auto s = try_wait()) return returncode(*s);
    return std::nullopt;
  }

  std::optional<int> status() {
    if (auto s = try_wait()) return s->wait_status();  // os.waitpid's
    return std::nullopt;
  }

  std::optional<fl::ExitStatus> exit_status() { return try_wait(); }

  std::optional<int> wait(std::optional<double> timeout) {
    if (auto s = try_wait()) return returncode(*s);
    if (!mine()) return std::nullopt;
    {
      py::gil_scoped_release nogil;
      pollfd p{child_.pidfd(), POLLIN, 0};
      const auto deadline =
          timeout ? std::optional(std::chrono::steady_clock::now() +
                                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                      std::chrono::duration<double>(*timeout)))
                  : std::nullopt;
      while (child_.running() && p.fd >= 0) {
        const int r = ::poll(&p, 1, forkguard::detail::poll_ms(deadline));
        if (r > 0 || (r == 0 && timeout)) break;
      }
    }
    if (auto s = try_wait()) return returncode(*s);
    return std::nullopt;
  }

  void signal(int sig) {
    if (mine()) child_.signal(sig);
  }

 private:
  bool mine() const { return owner_ == ::getpid(); }
  std::optional<fl::ExitStatus> try_wait() { return mine() ? child_.try_wait() : std::nullopt; }

  fl::detail::Child child_;
  int pid_;
  pid_t owner_;
};

std::unique_ptr<ChildProcess> start_process(const std::vector<std::string>& argv,
                                            const std::vector<int>& pass_fds,
                                            std::optional<std::string> name) {
  if (argv.empty()) throw py::value_error("start_process: argv is empty");
  auto exec = fl::detail::prepare_exec(argv, fl::current_environment());
  forkguard::detail::UniqueFd null(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!null) throw forkguard::SystemError("open /dev/null", errno);
  std::vector<fl::detail::FdMapping> keep;
  for (int fd : pass_fds) keep.push_back({fd, fd, false});
  py::gil_scoped_release nogil;
  return std::make_unique<ChildProcess>(
      fl::detail::start_child({.exec = &exec,
                               .stdin_fd = null.get(),
                               .keep_fds = keep,
                               .group = fl::detail::ProcessGroup::kInherit,
                               .parent_death_signal = 0,
                               .stop = {.signal = SIGTERM,
                                        .grace = std::chrono::seconds(10),
                                        .kill_wait = std::chrono::seconds(30)},
                               .what = name.value_or(argv[0])}));
}

std::unique_ptr<ChildProcess> start_python_child(py::function fn, int stdout_fd, int stderr_fd,
                                                 const std::vector<int>& close_fds, bool new_group,
                                                 bool reap_tree, std::optional<std::string> name) {
  PyOS_BeforeFork();
  fl::detail::Child child;
  try {
    child = fl::detail::start_child(
        {.main = [&fn]() -> int {
           PyOS_AfterFork_Child();
           ::signal(SIGPIPE, SIG_IGN);  // Python's own rule, which the set-up reset
           try {
             py::object r = fn();
             return r.is_none() ? 0 : r.cast<int>();
           } catch (py::error_already_set& e) {
             e.restore();
             PyErr_Print();
             return 1;
           } catch (const std::exception& e) {
             PySys_WriteStderr("%s\n", e.what());
             return 1;
           }
         },
         .stdout_fd = stdout_fd,
         .stderr_fd = stderr_fd,
         .close_other_fds = false,
         .close_fds = close_fds,
         .group = new_group ? fl::detail::ProcessGroup::kNew : fl::detail::ProcessGroup::kInherit,
         .reap_tree = reap_tree,
         .stop = {.signal = SIGKILL},
         .what = name.value_or("a child of the interpreter")});
  } catch (...) {
    PyOS_AfterFork_Parent();
    throw;
  }
  PyOS_AfterFork_Parent();
  return std::make_unique<ChildProcess>(std::move(child));
}

// A field as str, undecodable bytes kept as os.fsdecode keeps them (an environment may hold any).
py::object text(const std::string& field) {
  PyObject* s =
      PyUnicode_DecodeUTF8(field.data(), static_cast<Py_ssize_t>(field.size()), "surrogateescape");
  if (s == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(s);
}

py::list texts(const std::vector<std::string>& fields) {
  py::list out;
  for (const auto& f : fields) out.append(text(f));
  return out;
}

// A message's fields as a handler's keyword arguments (name -> value).
class ToKeywords {
 public:
  py::dict out;
  void operator()(const char* name, const std::string& v) { out[name] = text(v); }
  template <forkguard::detail::Number T>
  void operator()(const char* name, T v, forkguard::detail::Bounds<T> = {}) {
    out[name] = v;
  }
  void operator()(const char* name, const std::vector<std::string>& v, size_t = 0) {
    out[name] = texts(v);
  }
  void rest(const char* name, const std::vector<std::string>& v) { out[name] = texts(v); }
};

// A reply's fields from a handler's dict; TypeError naming what is missing or of the wrong type.
class FromKeywords {
 public:
  explicit FromKeywords(py::dict d) : d_(std::move(d)) {}
  void operator()(const char* name, std::string& v) { v = get(name).cast<std::string>(); }
  template <forkguard::detail::Number T>
  void operator()(const char* name, T& v, forkguard::detail::Bounds<T> = {}) {
    v = get(name).cast<T>();
  }
  size_t used = 0;

 private:
  py::object get(const char* name) {
    if (!d_.contains(name))
      throw py::type_error(fmt::format("the reply has no field \"{}\"", name));
    ++used;
    return d_[name];
  }
  py::dict d_;
};

// The reply `kind` (one of ServerReply's) with `fields`, encoded and checked by its decoder.
std::vector<std::string> encode_server_reply(const std::string& kind, py::dict fields) {
  std::optional<std::vector<std::string>> out;
  auto one = [&]<class M>(const M*) {
    if (out || M::kKind != kind) return;
    M m;
    FromKeywords from(fields);
    M::fields(from, m);
    if (from.used != fields.size()) {
      throw py::type_error(fmt::format("the reply \"{}\" has fields it does not take", kind));
    }
    out = forkguard::detail::encode_message(m);
  };
  [&]<size_t... I>(std::index_sequence<I...>) {
    (one(static_cast<const std::variant_alternative_t<I, fl::detail::ServerReply>*>(nullptr)), ...);
  }
  (std::make_index_sequence<std::variant_size_v<fl::detail::ServerReply>>{});
  if (!out) throw py::value_error(fmt::format("no reply of the kind \"{}\"", kind));
  fl::detail::decode_server_reply(*out);  // its bounds (a count of -1 throws here)
  return *out;
}

// The interpreter fork server's requests, for the one fork-server loop (launch/zygote_loop.hpp):
// each decoded (a malformed one is answered with why) and given to the Python handler of its kind
// (a `call`: of its function) as handler(fds, own, **fields). The loop runs with the GIL held and
// lets it go while it waits.
class PythonHandlers : public fl::detail::ZygoteHandler {
 public:
  explicit PythonHandlers(py::dict handlers) : handlers_(std::move(handlers)) {}

  std::variant<fl::detail::Child, std::vector<std::string>> handle(
      const std::vector<std::string>& fields, std::vector<int>& fds,
      const std::vector<int>& own) override {
    try {
      return reply(std::visit(
          [&]<class M>(const M& m) {
            std::string name(M::kKind);
            if constexpr (std::is_same_v<M, fl::detail::CallRequest>) name = m.function;
            if (!handlers_.contains(name)) {
              return py::object(py::str(fmt::format(
                  "the Python fork server cannot start {} (it starts notebook_launch ranks, "
                  "DataLoader workers and rerouted Processes only)",
                  name)));
            }
            ToKeywords keywords;
            M::fields(keywords, m);
            py::list given;
            for (int fd : fds) given.append(fd);
            fds.clear();  // the handler's now
            return handlers_[py::str(name)](given, own, **keywords.out);
          },
          fl::detail::decode_server_request(fields)));
    } catch (py::error_already_set& e) {
      if (e.matches(PyExc_KeyboardInterrupt) || e.matches(PyExc_SystemExit)) throw;
      return fl::detail::encode(fl::detail::ErrorReply{.message = e.what()});
    } catch (const std::exception& e) {
      return fl::detail::encode(fl::detail::ErrorReply{.message = e.what()});
    }
  }

  int wait(pollfd* fds, size_t count) override {
    int r;
    {
      py::gil_scoped_release nogil;
      r = ::poll(fds, static_cast<nfds_t>(count), -1);
    }
    if (r < 0 && errno == EINTR && PyErr_CheckSignals() != 0) throw py::error_already_set();
    return r;
  }

 private:
  // A started ChildProcess (the loop holds its Child from here on), a str (an error), or a reply
  // as (kind, {fields}).
  static std::variant<fl::detail::Child, std::vector<std::string>> reply(py::object result) {
    if (py::isinstance<ChildProcess>(result)) return result.cast<ChildProcess&>().take();
    if (py::isinstance<py::str>(result)) {
      return fl::detail::encode(fl::detail::ErrorReply{.message = result.cast<std::string>()});
    }
    try {
      auto [kind, values] = result.cast<std::pair<std::string, py::dict>>();
      return encode_server_reply(kind, values);
    } catch (const std::exception& e) {  // a handler's bug: the caller hears of it
      return fl::detail::encode(fl::detail::ErrorReply{
          .message =
              fmt::format("the Python fork server's handler gave a bad reply: {}", e.what())});
    }
  }

  py::dict handlers_;
};

// At the loop's end (EOF, or an exception), no child outlives it: each is killed (a rank with its
// process group) and reaped.
void stop_all(std::map<pid_t, fl::detail::Child>& children) {
  for (auto& [pid, c] : children) c.signal(SIGKILL);
  py::gil_scoped_release nogil;
  for (auto& [pid, c] : children) c.wait();
}

void serve_zygote(int sock, py::dict ready, py::dict handlers) {
  if (!forkguard::detail::send_message(sock, encode_server_reply("ready", std::move(ready)))) {
    throw forkguard::SystemError("the fork server's ready message", errno);
  }
  PythonHandlers python(std::move(handlers));
  std::map<pid_t, fl::detail::Child> children;
  try {
    fl::detail::serve_zygote(sock, python, children);
  } catch (...) {
    stop_all(children);
    throw;
  }
  stop_all(children);
}

}  // namespace

void bind_process(py::module_& m) {
  // A child of the interpreter fork server (a rerouted Process), held by the pidfd the server
  // opened before it could reap it: _ServerLink.start_child makes one.
  py::class_<fl::detail::ServerChild>(m, "_ServerChild")
      .def_property_readonly("pid", &fl::detail::ServerChild::pid)
      .def("signal", &fl::detail::ServerChild::signal, py::arg("sig"),
           "Sends sig unless it has exited (then nothing, whichever process has its PID now); "
           "whether it was sent.")
      .def("exited", &fl::detail::ServerChild::exited,
           "Whether it has exited (it is not reaped: its server does that).")
      .def(
          "close", [](fl::detail::ServerChild& c) { c = fl::detail::ServerChild(); },
          "Lets go of the pidfd; signal() sends nothing afterwards.");
  py::class_<ChildProcess>(m, "ChildProcess")
      .def_property_readonly("pid", &ChildProcess::pid)
      .def_property_readonly("pidfd", &ChildProcess::pidfd)
      .def("poll", &ChildProcess::poll)
      .def_property_readonly("wait_status", &ChildProcess::status)
      // How it ended (_ExitStatus: prints "killed by signal 9 (SIGKILL)"), None while it runs.
      .def_property_readonly("exit_status", &ChildProcess::exit_status)
      .def("wait", &ChildProcess::wait, py::arg("timeout") = py::none())
      .def("signal", &ChildProcess::signal, py::arg("sig"))
      .def("kill", [](ChildProcess& p) { p.signal(SIGKILL); });
  m.def("start_process", &start_process, py::arg("argv"), py::kw_only(),
        py::arg("pass_fds") = std::vector<int>{}, py::arg("name") = py::none());
  m.def("serve_zygote", &serve_zygote, py::arg("sock"), py::arg("ready"), py::arg("handlers"));
  m.def("start_python_child", &start_python_child, py::arg("fn"), py::kw_only(),
        py::arg("stdout_fd") = -1, py::arg("stderr_fd") = -1,
        py::arg("close_fds") = std::vector<int>{}, py::arg("new_group") = true,
        py::arg("reap_tree") = false, py::arg("name") = py::none());
}
