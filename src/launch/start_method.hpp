// How a rank is started: the choice of start method (spawn, the fork server, a guarded fork) and
// the starter for each, for the supervisor (launch/supervisor.hpp), which owns what they return.
//
//   auto method = detail::resolve_method(options, job, notice);   // may throw DirtyForkError
//   auto rank = detail::start_rank(method, job, ctx, env, io);    // one rank, its PID
//
// Thread-safety: resolve_method probes this process; start_rank forks. One launch at a time.
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

#include "detail/fd.hpp"
#include "forkguard/launch/entry.hpp"
#include "forkguard/launch/environment.hpp"
#include "forkguard/launch/options.hpp"
#include "launch/child.hpp"

namespace forkguard::launch::detail {

class ForkServer;

// What to start: a command, or a registered entry (an entry of an attached fork server when
// `server` is set: notebook_launch's Python ranks).
struct Job {
  std::vector<std::string> argv;  // a command
  std::string entry;              // or an entry
  std::vector<std::string> args;  // its arguments
  // A fork server to start the entry from instead of init()'s: one attached by notebook_launch
  // (ForkServer::attach), whose entries are not registered in this process.
  ForkServer* server = nullptr;
  // With `server`: the fd sent along with each rank's request (its payload), by local rank and
  // attempt; -1 for none. The fd stays the caller's.
  std::function<int(int local_rank, int restart)> rank_fd{};
  bool is_entry() const { return !entry.empty(); }
};

using NoticeFn = std::function<void(const std::string&)>;

// Decides the start method (and says so once through `notice` under kAuto / a fallback).
StartMethod resolve_method(const Options& o, const Job& job, const NoticeFn& notice);

// The fork server a job's ranks come from under kForkServer: the job's own or init()'s.
ForkServer* server_for(const Job& job);

struct StartedRank {
  pid_t pid = -1;
  Child child;               // started here (under its reaper); empty for fork-server ranks
  bool via_server = false;   // its exit comes as the fork server's report
  ServerChild server_child;  // a fork-server rank's handle
};

// Starts one rank by `method` with `env` as its whole environment and stdio from `io`.
StartedRank start_rank(StartMethod method, const Job& job, const RankContext& ctx,
                       const EnvMap& env, const ChildIo& io);

}  // namespace forkguard::launch::detail
