// forkguard trace: run a command with libforkguard_trace.so preloaded and collect what it saw in
// the command and every process it forks or executes: where the CUDA driver was loaded and
// initialized, forks after initialization (dirty forks), CUDA touches in the children of such
// forks (poisoned touches), where GNU OpenMP's thread pool was started and forks while it was
// alive (their children hang at their first parallel region). The reports themselves are printed by
// the library, on the traced processes' stderr, as the events happen; this API adds the run, the
// events and a summary.
//
//   auto result = forkguard::trace::run({.strict = true, .json_path = "events.json"},
//                                       {"/usr/bin/python3", "train.py"});
//   if (result.found()) std::cerr << result.summary() << "\n";
//   return result.exit_code;   // the command's own (128 + N when killed by signal N)
//
// The library is found next to the calling program (../lib/libforkguard_trace.so, or the
// installed library directory), or at FORKGUARD_TRACE_LIBRARY. See docs/trace.md.
//
// Thread-safety: run() may be called from several threads; each run has its own events file.
#pragma once

#include <string>
#include <vector>

#include "forkguard/error.hpp"

namespace forkguard::trace {

struct Options {
  bool strict = false;    // a poisoned child exits with kExitStrict at its first CUDA touch
  std::string json_path;  // write every event there as JSON ("" for none)
  std::string library;    // libforkguard_trace.so to preload ("" to find it, see above)
};

// The exit code of a child that --strict stopped at its first CUDA touch (EX_SOFTWARE).
inline constexpr int kExitStrict = 70;

// One event from a traced process.
struct Event {
  std::string kind;  // driver_loaded, device_opened, cuda_init, dirty_fork, poisoned_touch,
                     // openmp_pool, openmp_fork
  int pid = 0;
  int ppid = 0;
  double time = 0;   // seconds since the epoch
  std::string what;  // one line: the library, the device file, the call
  std::string site;  // where, in one phrase (the user's innermost frame)
  std::string json;  // the whole event (frames included) as the library wrote it
};

struct Result {
  int exit_code = 0;          // the command's
  std::vector<Event> events;  // in time order
  // A fork after CUDA initialization, or a CUDA touch in a child of one, or a fork while GNU
  // OpenMP's thread pool was alive, was seen.
  bool found() const;
  // One paragraph: what was found and where, or that nothing was.
  std::string summary() const;
};

// The library could not be found, or the command could not be started.
class TraceError : public Error {
 public:
  TraceError(std::string message, int exit_code)
      : Error(std::move(message)), exit_code_(exit_code) {}
  int exit_code() const noexcept { return exit_code_; }  // 127: command not found; 2: otherwise

 private:
  int exit_code_;
};

// Runs `command` (searched in PATH) traced and waits for it. SIGINT and SIGQUIT are left to the
// command while it runs, as a shell does.
Result run(const Options& options, const std::vector<std::string>& command);

// Where libforkguard_trace.so is: FORKGUARD_TRACE_LIBRARY, else next to this program.
std::string find_library();

}  // namespace forkguard::trace
