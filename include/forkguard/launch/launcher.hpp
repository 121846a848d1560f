// The launcher: N ranks of a command or of a registered entry, supervised like torchrun.
//
//   namespace fl = forkguard::launch;
//   auto result = fl::run({.nproc = 2}, {"python3", "train.py"});           // a command
//   auto result = fl::launch({.nproc = 4, .start = fl::StartMethod::kForkServer}, "train", {});
//
// Every rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), its
// own process group and PR_SET_PDEATHSIG, so no rank outlives the launcher. The first rank to
// fail is the root cause: the others get the stop policy's signal, then SIGKILL after the grace
// period; the group restarts up to max_restarts times. SIGINT/SIGTERM/SIGHUP that reach the
// launcher during a launch are forwarded to every rank.
//
// A successful launch returns the per-rank Result; a failed one throws RankFailedError carrying
// it. A plain fork of a process that holds CUDA state throws DirtyForkError before any child
// exists.
//
// Thread-safety: one launch at a time per process (signals are process-wide). Call it from a
// thread that outlives the launch (PR_SET_PDEATHSIG follows the thread that forked).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include "forkguard/error.hpp"
#include "forkguard/launch/exit_status.hpp"
#include "forkguard/launch/options.hpp"
#include "forkguard/probe/cuda_state.hpp"

namespace forkguard::launch {

struct RankResult {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  ExitStatus status;
  double seconds = 0;                    // start to exit
  bool stopped_by_launcher = false;      // signalled by the stop policy, not a failure of its own
  std::vector<std::string> stderr_tail;  // last lines of its stderr
  // Why no exit status of its own came: its fork server ended, and it with it (the status is
  // then the server's parent-death signal, SIGKILL). Empty when it was reported.
  std::string lost{};

  std::string describe() const;  // the status, and `lost` when set
};

struct Result {
  std::vector<RankResult> ranks;             // of the last attempt, by local rank
  int root_cause = -1;                       // local rank that failed first, -1 when none
  StartMethod method = StartMethod::kSpawn;  // what was used
  int restarts = 0;                          // attempts after the first
  bool timed_out = false;
  int interrupted_by = 0;  // signal forwarded to the ranks, 0 when none
  std::string gpu_plan;    // description of the GPU plan

  bool success() const { return root_cause < 0 && interrupted_by == 0 && !timed_out; }
  int exit_code() const;       // 0, the root cause's shell code, or 128 + interrupting signal
  std::string report() const;  // per-rank table, root cause first
  std::string to_json() const;
};

// A rank failed (after any restarts); what() is the report.
class RankFailedError : public Error {
 public:
  explicit RankFailedError(Result result);
  const Result& result() const noexcept { return result_; }

 private:
  Result result_;
};

// Plain fork refused: this process holds CUDA state. what() names the evidence and the cures.
class DirtyForkError : public Error {
 public:
  explicit DirtyForkError(probe::CudaState state, int nproc);
  const probe::CudaState& state() const noexcept { return state_; }

 private:
  probe::CudaState state_;
};

// A rank could not be started ("failed to execute X: ...", "error preparing to execute X").
// exit_code() follows the shell's (and env's, timeout's) convention: 127 when the command does
// not exist, 126 when it exists but cannot be executed, 1 for any other failure to start.
class SpawnError : public Error {
 public:
  explicit SpawnError(const std::string& what, int exit_code = 1)
      : Error(what), exit_code_(exit_code) {}
  int exit_code() const noexcept { return exit_code_; }

 private:
  int exit_code_;
};

Result launch(const Options& options, std::string_view entry, const std::vector<std::string>& args);
Result run(const Options& options, const std::vector<std::string>& argv);

}  // namespace forkguard::launch
