#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "detail/signal_capture.hpp"
#include "forkguard/launch/launcher.hpp"
#include "forkguard/trace/trace.hpp"
#include "launch/child.hpp"

#ifndef FORKGUARD_INSTALL_LIBDIR
#define FORKGUARD_INSTALL_LIBDIR "lib"
#endif

extern char** environ;

namespace forkguard::trace {
namespace {

constexpr const char* kLibraryName = "libforkguard_trace.so";

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string dir_of(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// Removes the events file however run() ends.
struct TempFile {
  std::string path;
  ~TempFile() {
    if (!path.empty()) ::unlink(path.c_str());
  }
};

std::string make_events_file(TempFile& tmp) {
  const char* dir = std::getenv("TMPDIR");
  std::string templ =
      std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/forkguard-trace-XXXXXX";
  int fd = ::mkstemp(templ.data());
  if (fd < 0) {
    throw TraceError("cannot create the events file " + templ + ": " + std::strerror(errno), 2);
  }
  ::close(fd);
  tmp.path = templ;
  return templ;
}

std::vector<std::string> traced_environment(const std::string& library, const std::string& events,
                                            bool strict) {
  std::vector<std::string> env;
  std::string preload = library;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string_view kv(*e);
    if (kv.substr(0, 11) == "LD_PRELOAD=") {
      // The user's preloads keep their place in front (a sanitizer runtime must come first).
      if (kv.size() > 11) preload = std::string(kv.substr(11)) + ":" + library;
      continue;
    }
    if (kv.substr(0, 23) == "FORKGUARD_TRACE_EVENTS=" ||
        kv.substr(0, 23) == "FORKGUARD_TRACE_STRICT=") {
      continue;
    }
    env.emplace_back(kv);
  }
  env.push_back("LD_PRELOAD=" + preload);
  env.push_back("FORKGUARD_TRACE_EVENTS=" + events);
  if (strict) env.push_back("FORKGUARD_TRACE_STRICT=1");
  return env;
}

int spawn_and_wait(const std::vector<std::string>& command, std::vector<std::string> env) {
  // While the command runs, the signals that would end us are for it: blocked here and read from
  // a signalfd. ^C, ^\ and a hangup from the terminal already reach it (it is in our process
  // group), so those sent by the kernel are not sent again; one sent to us by a process (kill
  // PID, a supervisor's SIGTERM) is passed on, so the program can stop and we remove our
  // temporary file after it instead of dying with it still running.
  forkguard::detail::SignalCapture signals({SIGINT, SIGQUIT, SIGTERM, SIGHUP});
  // However this ends, what arrived while the program ran has been dealt with: dropped rather
  // than acted on when the mask comes back.
  struct Drop {
    forkguard::detail::SignalCapture& signals;
    ~Drop() {
      signals.each([](const signalfd_siginfo&) {});
    }
  } drop{signals};
  // The program runs under a reaper (launch/child.hpp): what it leaves running when it ends, or
  // when this process dies, is killed. It stays in our process group (a terminal's signals and
  // job control reach it as before) and gets our signal mask from before, not the blocked set.
  auto exec = launch::detail::prepare_exec(command, launch::current_environment());
  exec.env_storage = std::move(env);
  exec.envp = launch::detail::c_array(exec.env_storage);
  launch::detail::Child child;
  try {
    child = launch::detail::start_child({.exec = &exec,
                                         .group = launch::detail::ProcessGroup::kInherit,
                                         .signal_mask = &signals.saved_mask(),
                                         .reap_tree = true,
                                         .what = command[0]});
  } catch (const launch::SpawnError& e) {
    std::string why = e.what();
    const std::string prefix = "failed to execute " + command[0] + ": ";
    if (why.rfind(prefix, 0) == 0) why = why.substr(prefix.size());
    throw TraceError("cannot run " + command[0] + ": " + why, e.exit_code());
  }
  for (;;) {
    pollfd fds[2] = {{child.pidfd(), POLLIN, 0}, {signals.fd(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0 && errno != EINTR) {
      throw TraceError(std::string("poll: ") + std::strerror(errno), 2);
    }
    if (fds[1].revents != 0) {
      signals.each([&](const signalfd_siginfo& info) {
        if (info.ssi_code == SI_USER || info.ssi_code == SI_QUEUE) {
          child.signal(static_cast<int>(info.ssi_signo));
        }
      });
    }
    if (fds[0].revents != 0) break;
  }
  return child.wait().shell_code();
}

std::vector<Event> read_events(const std::string& path, nlohmann::json* all) {
  std::vector<Event> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) continue;  // a line cut by a process that died
    Event e;
    e.kind = j.value("event", "");
    e.pid = j.value("pid", 0);
    e.ppid = j.value("ppid", 0);
    e.time = j.value("time", 0.0);
    e.what = j.value("what", "");
    e.site = j.value("site", "");
    e.json = line;
    out.push_back(std::move(e));
    all->push_back(std::move(j));
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const Event& a, const Event& b) { return a.time < b.time; });
  return out;
}

std::string plural(size_t n, const char* one, const char* many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

}  // namespace

bool Result::found() const {
  return std::any_of(events.begin(), events.end(), [](const Event& e) {
    return e.kind == "dirty_fork" || e.kind == "poisoned_touch" || e.kind == "openmp_fork";
  });
}

std::string Result::summary() const {
  const Event* init = nullptr;
  const Event* first_fork = nullptr;
  const Event* pool = nullptr;
  const Event* first_pool_fork = nullptr;
  std::set<int> loaded;
  std::vector<const Event*> touches;
  size_t forks = 0, pool_forks = 0;
  for (const auto& e : events) {
    if (e.kind == "driver_loaded") loaded.insert(e.pid);
    if (e.kind == "cuda_init" && init == nullptr) init = &e;
    if (e.kind == "dirty_fork") {
      ++forks;
      if (first_fork == nullptr) first_fork = &e;
    }
    if (e.kind == "poisoned_touch") touches.push_back(&e);
    if (e.kind == "openmp_pool" && pool == nullptr) pool = &e;
    if (e.kind == "openmp_fork") {
      ++pool_forks;
      if (first_pool_fork == nullptr) first_pool_fork = &e;
    }
  }
  const bool cuda_found = forks > 0 || !touches.empty();
  std::ostringstream s;
  s << "forkguard trace: ";
  if (!found()) {
    s << "nothing to report: ";
    if (init != nullptr || !loaded.empty() || pool == nullptr) {
      s << "no fork after CUDA initialization";
      if (init != nullptr) {
        s << " (CUDA initialized in PID " << init->pid << " at " << init->site << ")";
      } else if (!loaded.empty()) {
        s << " (a CUDA library was loaded in " << plural(loaded.size(), "process", "processes")
          << ", CUDA never initialized)";
      }
      if (pool != nullptr) s << ", ";
    }
    if (pool != nullptr) {
      s << "no fork while GNU OpenMP's thread pool was alive (started in PID " << pool->pid
        << " at " << pool->site << ")";
    }
    s << ".";
    return s.str();
  }
  if (cuda_found) {
    if (init != nullptr) {
      s << "CUDA was initialized in PID " << init->pid << " at " << init->site << "; ";
    }
    if (first_fork != nullptr) {
      s << "PID " << first_fork->pid << " then forked " << plural(forks, "time", "times")
        << " (first at " << first_fork->site << ")";
    }
    if (!touches.empty()) {
      s << (first_fork != nullptr ? ", and " : "") << plural(touches.size(), "child", "children")
        << " touched CUDA where it cannot work (PID ";
      for (size_t i = 0; i < touches.size(); ++i) {
        s << (i ? ", " : "") << touches[i]->pid;
      }
      s << ", first at " << touches.front()->site << ")";
    }
    s << ". Those children get CUDA_ERROR_NOT_INITIALIZED from every CUDA call: start them with "
         "spawn or a fork server, or move the CUDA call after the fork (reports above).";
  }
  if (first_pool_fork != nullptr) {
    if (cuda_found) s << " ";
    if (pool != nullptr) {
      s << "GNU OpenMP's thread pool was started in PID " << pool->pid << " at " << pool->site
        << "; ";
    }
    s << "PID " << first_pool_fork->pid << " forked " << plural(pool_forks, "time", "times")
      << " while it was alive (first at " << first_pool_fork->site
      << "). Those children hang at their first parallel region: torch.set_num_threads(1) or "
         "OMP_NUM_THREADS=1 before the first parallel op, or start them with spawn or a fork "
         "server (reports above).";
  }
  s << " Exit code " << exit_code << ".";
  return s.str();
}

std::string find_library() {
  if (const char* v = std::getenv("FORKGUARD_TRACE_LIBRARY"); v != nullptr && *v != '\0') {
    if (!is_file(v)) throw TraceError(std::string("FORKGUARD_TRACE_LIBRARY: no such file ") + v, 2);
    return v;
  }
  char exe[4096];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) throw TraceError("cannot find this program (/proc/self/exe)", 2);
  exe[n] = '\0';
  const std::string prefix = dir_of(dir_of(exe));
  for (const std::string& dir : {prefix + "/lib", prefix + "/" + FORKGUARD_INSTALL_LIBDIR}) {
    if (is_file(dir + "/" + kLibraryName)) return dir + "/" + kLibraryName;
  }
  throw TraceError(std::string("cannot find ") + kLibraryName + " in " + prefix + "/lib or " +
                       prefix + "/" + FORKGUARD_INSTALL_LIBDIR +
                       " (set FORKGUARD_TRACE_LIBRARY to its path)",
                   2);
}

Result run(const Options& options, const std::vector<std::string>& command) {
  if (command.empty()) throw TraceError("no command to trace", 2);
  const std::string library = options.library.empty() ? find_library() : options.library;
  TempFile tmp;
  const std::string events = make_events_file(tmp);
  Result result;
  result.exit_code = spawn_and_wait(command, traced_environment(library, events, options.strict));
  nlohmann::json all = nlohmann::json::array();
  result.events = read_events(events, &all);
  std::sort(all.begin(), all.end(), [](const nlohmann::json& a, const nlohmann::json& b) {
    return a.value("time", 0.0) < b.value("time", 0.0);
  });
  if (!options.json_path.empty()) {
    nlohmann::ordered_json doc;
    doc["command"] = command;
    doc["exit_code"] = result.exit_code;
    doc["found"] = result.found();
    doc["events"] = all;
    std::ofstream out(options.json_path);
    out << doc.dump(2) << "\n";
    if (!out) throw TraceError("cannot write " + options.json_path, 2);
  }
  return result;
}

}  // namespace forkguard::trace
