#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "forkguard/launch/launcher.hpp"

namespace forkguard::launch {

int Result::exit_code() const {
  if (root_cause >= 0) return ranks[static_cast<size_t>(root_cause)].status.shell_code();
  if (interrupted_by != 0) return 128 + interrupted_by;
  if (timed_out) return 124;  // timeout(1)'s convention
  return 0;
}

std::string RankResult::describe() const {
  if (lost.empty()) return status.to_string();
  return fmt::format("{}: {}, and its ranks with it", status.to_string(), lost);
}

std::string Result::report() const {
  std::string out;
  if (root_cause >= 0) {
    const auto& r = ranks[static_cast<size_t>(root_cause)];
    out += fmt::format(
        "rank {} (local rank {}, PID {}) failed first: {}{}\n", r.rank, r.local_rank, r.pid,
        r.describe(),
        restarts > 0 ? fmt::format(" (after {} restart{})", restarts, restarts == 1 ? "" : "s")
                     : std::string());
    if (!r.stderr_tail.empty()) {
      out += fmt::format("  last {} line{} of its stderr:\n", r.stderr_tail.size(),
                         r.stderr_tail.size() == 1 ? "" : "s");
      for (const auto& l : r.stderr_tail) out += "    | " + l + "\n";
    }
  } else if (interrupted_by != 0) {
    out += fmt::format("interrupted by signal {}: forwarded to every rank\n", interrupted_by);
  } else if (timed_out) {
    out += "timed out: every rank was stopped\n";
  } else {
    out += "every rank exited with code 0\n";
  }
  out += fmt::format("{:>6} {:>8} {:>9}  {}\n", "rank", "pid", "seconds", "status");
  auto row = [&](const RankResult& r, const char* note) {
    out += fmt::format("{:>6} {:>8} {:>9.3f}  {}{}\n", r.rank, r.pid, r.seconds,
                       r.status.to_string(), note);
  };
  if (root_cause >= 0) row(ranks[static_cast<size_t>(root_cause)], " (root cause)");
  for (const auto& r : ranks) {
    if (r.local_rank == root_cause) continue;
    row(r, r.stopped_by_launcher ? " (stopped by the launcher)" : "");
  }
  return out;
}

std::string Result::to_json() const {
  using json = nlohmann::ordered_json;
  json ranks_json = json::array();
  for (const auto& r : ranks) {
    const char* kind = r.status.kind == ExitStatus::Kind::kExited     ? "exited"
                       : r.status.kind == ExitStatus::Kind::kSignaled ? "signaled"
                                                                      : "not_started";
    ranks_json.push_back({{"rank", r.rank},
                          {"local_rank", r.local_rank},
                          {"pid", r.pid},
                          {"status", kind},
                          {"exit_code", r.status.code},
                          {"signal", r.status.signal},
                          {"core_dumped", r.status.core_dumped},
                          {"description", r.describe()},
                          {"seconds", r.seconds},
                          {"stopped_by_launcher", r.stopped_by_launcher},
                          {"stderr_tail", r.stderr_tail}});
  }
  json j = {
      {"success", success()},
      {"exit_code", exit_code()},
      {"start_method", to_string(method)},
      {"restarts", restarts},
      {"timed_out", timed_out},
      {"interrupted_by", interrupted_by},
      {"root_cause", root_cause >= 0 ? json(ranks[static_cast<size_t>(root_cause)].rank) : json()},
      {"gpu_plan", gpu_plan},
      {"ranks", ranks_json}};
  return j.dump(2);
}

}  // namespace forkguard::launch
