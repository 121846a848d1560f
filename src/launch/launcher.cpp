// The public entry points (launch::run, launch::launch) and the launcher's errors; the work is
// the supervisor's (launch/supervisor.hpp), the start methods' (launch/start_method.hpp) and the
// rank output's (launch/rank_output.hpp).
#include "forkguard/launch/launcher.hpp"

#include <fmt/format.h>

#include "forkguard/doctor/report.hpp"
#include "launch/supervisor.hpp"

namespace forkguard::launch {

std::string to_string(StartMethod m) {
  switch (m) {
    case StartMethod::kSpawn: return "spawn";
    case StartMethod::kForkServer: return "forkserver";
    case StartMethod::kFork: return "fork";
    case StartMethod::kAuto: return "auto";
  }
  return "unknown";
}

std::optional<StartMethod> parse_start_method(const std::string& s) {
  for (auto m :
       {StartMethod::kSpawn, StartMethod::kForkServer, StartMethod::kFork, StartMethod::kAuto}) {
    if (s == to_string(m)) return m;
  }
  if (s == "fork-server" || s == "fork_server") return StartMethod::kForkServer;
  return std::nullopt;
}

Result launch(const Options& options, std::string_view entry,
              const std::vector<std::string>& args) {
  detail::Job job;
  job.entry = std::string(entry);
  job.args = args;
  if (job.entry.empty()) throw Error("launch: empty entry name");
  return detail::supervise(options, job);
}

Result run(const Options& options, const std::vector<std::string>& argv) {
  detail::Job job;
  job.argv = argv;
  return detail::supervise(options, job);
}

RankFailedError::RankFailedError(Result result)
    : Error(result.report()), result_(std::move(result)) {}

namespace {
std::string dirty_message(const probe::CudaState& s, int nproc) {
  std::string msg = fmt::format(
      "refusing to fork {} rank{}: this process (PID {}) is {}; CUDA state does not survive "
      "fork, so every rank would fail with CUDA_ERROR_NOT_INITIALIZED.\nevidence:",
      nproc, nproc == 1 ? "" : "s", s.pid, probe::to_string(s.verdict));
  for (const auto& e : s.evidence) {
    msg += fmt::format("\n  - {}: {} [{}]", probe::to_string(e.kind), e.detail, e.source);
  }
  msg += "\ncures:";
  auto report = doctor::diagnose(s, {.environment = false});
  for (const auto& a : report.advice) msg += "\n  - " + a;
  return msg;
}
}  // namespace

DirtyForkError::DirtyForkError(probe::CudaState state, int nproc)
    : Error(dirty_message(state, nproc)), state_(std::move(state)) {}

}  // namespace forkguard::launch
