// forkguard._native.start_process: a program the Python package runs (the interpreter fork
// server, python/forkguard/_server.py) started by the one process layer (launch/child.hpp), held
// by its Child handle: a pidfd, never a bare PID that could be reused.
//
//   p = _native.start_process([sys.executable, script, "3"], pass_fds=[sock.fileno()])
//   p.pid; p.poll()  # None while it runs, else the return code (-9: killed by SIGKILL)
//   p.wait(timeout=10.0)  # the return code, or None after `timeout` seconds
//   p.kill()
//
// Its stdin is /dev/null; stdout and stderr are this process's; `pass_fds` keep their numbers,
// every other fd is closed. It stays in this process's group and has no parent-death signal: it
// ends when its socket says so, as a subprocess.Popen would.
//
// Thread-safety: one Process per owner; wait() releases the GIL.
#include <fcntl.h>
#include <poll.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <signal.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "detail/deadline.hpp"
#include "detail/fd.hpp"
#include "forkguard/error.hpp"
#include "launch/child.hpp"

namespace py = pybind11;
namespace fl = forkguard::launch;

namespace {

// subprocess's return code: the exit code, or minus the signal.
int returncode(const fl::ExitStatus& s) {
  return s.kind == fl::ExitStatus::Kind::kSignaled ? -s.signal : s.code;
}

class Process {
 public:
  Process(const std::vector<std::string>& argv, const std::vector<int>& pass_fds,
          std::optional<std::string> name) {
    if (argv.empty()) throw py::value_error("start_process: argv is empty");
    exec_ = fl::detail::prepare_exec(argv, fl::current_environment());
    null_ = forkguard::detail::UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (!null_) throw forkguard::SystemError("open /dev/null", errno);
    std::vector<fl::detail::FdMapping> keep;
    for (int fd : pass_fds) keep.push_back({fd, fd, false});
    name_ = name.value_or("");
    py::gil_scoped_release nogil;
    child_ = fl::detail::start_child({.exec = &exec_,
                                      .stdin_fd = null_.get(),
                                      .keep_fds = keep,
                                      .group = fl::detail::ProcessGroup::kInherit,
                                      .parent_death_signal = 0,
                                      .stop = {.signal = SIGTERM,
                                               .grace = std::chrono::seconds(10),
                                               .kill_wait = std::chrono::seconds(30)},
                                      .what = name_.empty() ? argv[0] : name_});
    pid_ = child_.pid();
    null_.reset();
  }

  int pid() const { return pid_; }

  std::optional<int> poll() {
    if (auto s = child_.try_wait()) return returncode(*s);
    return std::nullopt;
  }

  std::optional<int> wait(std::optional<double> timeout) {
    if (auto s = child_.try_wait()) return returncode(*s);
    {
      py::gil_scoped_release nogil;
      pollfd p{child_.pidfd(), POLLIN, 0};
      const auto deadline =
          timeout ? std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(*timeout))
                  : std::chrono::steady_clock::time_point::max();
      while (child_.running() && p.fd >= 0) {
        const int ms = timeout ? forkguard::detail::poll_ms(deadline) : -1;
        const int r = ::poll(&p, 1, ms);
        if (r > 0 || (r == 0 && timeout)) break;
      }
    }
    if (auto s = child_.try_wait()) return returncode(*s);
    return std::nullopt;
  }

  void kill() { child_.signal(SIGKILL); }

 private:
  fl::detail::PreparedExec exec_;
  forkguard::detail::UniqueFd null_;
  std::string name_;
  fl::detail::Child child_;
  int pid_ = -1;
};

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
  py::class_<Process>(m, "Process")
      .def_property_readonly("pid", &Process::pid)
      .def("poll", &Process::poll)
      .def("wait", &Process::wait, py::arg("timeout") = py::none())
      .def("kill", &Process::kill);
  m.def(
      "start_process",
      [](const std::vector<std::string>& argv, const std::vector<int>& pass_fds,
         std::optional<std::string> name) {
        return std::make_unique<Process>(argv, pass_fds, std::move(name));
      },
      py::arg("argv"), py::kw_only(), py::arg("pass_fds") = std::vector<int>{},
      py::arg("name") = py::none());
}
