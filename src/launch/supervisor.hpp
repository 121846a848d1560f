// The supervisor: the one loop that watches ranks, whatever started them — `forkguard run`,
// launch::run/launch, and notebook_launch's Python ranks (python/src/module.cpp).
//
//   detail::Job job{.argv = {"python3", "train.py"}};
//   Result r = detail::supervise(options, job);                      // console, signalfd
//   Result r = detail::supervise(options, job, {.sink = &mine, .interrupted = hook});
//
// It plans the launch (nproc, placement, GPU plan, start method: launch/start_method.hpp), runs
// attempts (each rank's whole environment from rank_process_environment(), its output through
// detail::RankOutput to an OutputSink), stops the group by the stop policy at the first failure,
// a timeout or an interrupt, and restarts it up to max_restarts times. A failed launch throws
// RankFailedError with the Result.
//
// Interrupts: by default SIGINT/SIGTERM/SIGHUP are captured through a signalfd for the launch
// (blocked for the calling thread) and forwarded to every rank. A caller that must keep its own
// signal handling (a Python interpreter) passes `interrupted` instead: it is polled at least every
// kInterruptPoll and returns the signal to forward, 0 for none.
//
// Thread-safety: one launch at a time per process; sink callbacks run on the calling thread.
#pragma once

#include <chrono>
#include <functional>
#include <string_view>

#include "forkguard/launch/launcher.hpp"
#include "forkguard/launch/options.hpp"
#include "launch/start_method.hpp"

namespace forkguard::launch::detail {

// Where the supervisor's text goes.
class OutputSink {
 public:
  virtual ~OutputSink() = default;
  // What the console shows of a rank's stdout (is_err false) or stderr: prefixed lines, '\r'
  // states (detail::RankOutput). Only for the ranks LogPolicy::console_ranks shows.
  virtual void rank_output(int local_rank, bool is_err, std::string_view text) = 0;
  // One notice ("start method auto: fork ..."), without "forkguard: " and the newline; never
  // called under Options::quiet.
  virtual void notice(std::string_view text) = 0;
};

// fd 1 and fd 2 as they are; notices as "forkguard: TEXT" lines on stderr.
class ConsoleSink final : public OutputSink {
 public:
  void rank_output(int local_rank, bool is_err, std::string_view text) override;
  void notice(std::string_view text) override;
};

inline constexpr std::chrono::milliseconds kInterruptPoll{50};

struct Supervision {
  OutputSink* sink = nullptr;          // nullptr: a ConsoleSink
  std::function<int()> interrupted{};  // unset: SIGINT/SIGTERM/SIGHUP through a signalfd
};

Result supervise(const Options& options, const Job& job, const Supervision& how = {});

}  // namespace forkguard::launch::detail
