#include "forkguard/doctor/report.hpp"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <optional>

namespace forkguard::doctor {
namespace {

using probe::Verdict;

constexpr const char* kSpawnCure =
    "Start worker or rank processes with spawn or a fork server, not plain fork: `forkguard run "
    "--start-method spawn|forkserver`, or multiprocessing.set_start_method(\"spawn\") / "
    "\"forkserver\" in Python.";
constexpr const char* kMoveCure =
    "Move the CUDA call after the launch: initialize CUDA in each rank, never in the parent that "
    "forks.";
constexpr const char* kNvmlCure =
    "Set PYTORCH_NVML_BASED_CUDA_CHECK=1 so torch.cuda.is_available() and device_count() ask "
    "NVML instead of initializing the driver.";
constexpr const char* kLoaderCure =
    "Keep data-loader workers CPU-only and move batches to the GPU in the main training loop.";
constexpr const char* kOpenMpThreadsCure =
    "In a process that will fork, keep GNU OpenMP to one thread before its first parallel CPU op: "
    "OMP_NUM_THREADS=1 in its environment, or torch.set_num_threads(1) (torch's DataLoader "
    "workers do this themselves).";
constexpr const char* kOpenMpStartCure =
    "Start the children by spawn or a fork server started before the first parallel op: "
    "`forkguard run --start-method spawn|forkserver`, multiprocessing.get_context(\"spawn\") / "
    "\"forkserver\", or forkguard.guard() in Python, which reroutes such forks.";

std::string summary_of(const probe::CudaState& s) {
  switch (s.verdict) {
    case Verdict::kClean: return "No CUDA state: forking this process is safe.";
    case Verdict::kDriverLoaded:
      return "A CUDA library is loaded but the driver is not initialized: forking is safe.";
    case Verdict::kNvmlOpen:
      return "NVIDIA device files are open (NVML) but CUDA is not initialized: forking is safe.";
    case Verdict::kInitialized:
      return "CUDA is initialized in this process: a child forked from it cannot use CUDA "
             "(CUDA_ERROR_NOT_INITIALIZED, \"Cannot re-initialize CUDA in forked subprocess\").";
    case Verdict::kContextActive:
      return "CUDA is initialized and a context is active: a child forked from it cannot use "
             "CUDA (CUDA_ERROR_NOT_INITIALIZED, \"Cannot re-initialize CUDA in forked "
             "subprocess\").";
    case Verdict::kPoisoned:
      if (s.poisoned_by != s.parent_pid) {
        return fmt::format(
            "This process was forked from a parent (PID {}) that descends from PID {}, which had "
            "initialized CUDA: every CUDA call here fails with CUDA_ERROR_NOT_INITIALIZED "
            "(\"initialization error\").",
            s.parent_pid, s.poisoned_by);
      }
      return fmt::format(
          "This process was forked from a parent (PID {}) that had initialized CUDA: every CUDA "
          "call here fails with CUDA_ERROR_NOT_INITIALIZED (\"initialization error\").",
          s.parent_pid);
    case Verdict::kOpenMpPool:
      return "GNU OpenMP's thread pool is live in this process: a child fork()ed from it hangs "
             "for ever at its first parallel region (a parallel CPU op: torch's matmul, conv, "
             "large elementwise ops), because libgomp's workers do not survive fork.";
  }
  return {};
}

std::vector<std::string> advice_for(Verdict v) {
  switch (v) {
    case Verdict::kClean:
    case Verdict::kDriverLoaded:
    case Verdict::kNvmlOpen:
      return {"Keep it so until the ranks or workers are started: " + std::string(kNvmlCure),
              kLoaderCure};
    case Verdict::kInitialized:
    case Verdict::kContextActive: return {kSpawnCure, kMoveCure, kNvmlCure, kLoaderCure};
    case Verdict::kPoisoned:
      return {
          "This process cannot be repaired: restart it by spawn (fork+exec) or from a fork "
          "server started before CUDA was initialized.",
          kSpawnCure, kMoveCure, kNvmlCure, kLoaderCure};
    case Verdict::kOpenMpPool: return {kOpenMpThreadsCure, kOpenMpStartCure};
  }
  return {};
}

std::vector<std::string> advice_for(const probe::CudaState& s) {
  auto advice = advice_for(s.verdict);
  if (s.verdict != Verdict::kOpenMpPool && s.has(probe::EvidenceKind::kOpenMpPool)) {
    advice.emplace_back(kOpenMpThreadsCure);  // a second hazard beside CUDA's
  }
  return advice;
}

bool safety_unknown(const probe::CudaState& s) {
  return s.fork_safe && !s.unseen_hazards.empty();
}

std::string joined(const std::vector<std::string>& parts, std::string_view sep) {
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : std::string(sep)) + p;
  return out;
}

std::optional<std::string> target_visible_devices(const probe::CudaState& s) {
  for (const auto& e : s.evidence) {
    constexpr std::string_view kPrefix = "CUDA_VISIBLE_DEVICES=";
    if (e.kind == probe::EvidenceKind::kEnvironment && e.detail.rfind(kPrefix, 0) == 0) {
      return e.detail.substr(kPrefix.size());
    }
  }
  return std::nullopt;
}

// Appends one formatted line to a string.
struct Lines {
  std::string& out;
  template <typename... T>
  void operator()(fmt::format_string<T...> format, T&&... args) {
    out += fmt::format(format, std::forward<T>(args)...);
    out += '\n';
  }
};

std::string cuda_version(int v) {
  return fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
}

}  // namespace

Report diagnose(probe::CudaState state, const Options& options) {
  Report r;
  r.summary = summary_of(state);
  r.advice = advice_for(state);
  if (options.environment) {
    r.environment_checked = true;
    r.gpus = cuda::discover_gpus();
    auto value = target_visible_devices(state);
    r.visible =
        cuda::parse_visible_devices(value ? std::optional<std::string_view>(*value) : std::nullopt);
    r.resolution = cuda::resolve_visible_devices(r.visible, r.gpus.gpus);
  }
  r.state = std::move(state);
  return r;
}

int exit_code(const Report& r) {
  if (!r.state.fork_safe) return kExitForkUnsafe;
  return safety_unknown(r.state) ? kExitForkUnknown : kExitForkSafe;
}

std::string to_text(const Report& r) {
  const auto& s = r.state;
  std::string out;
  Lines line{out};
  line("forkguard doctor: PID {} (parent {})", s.pid, s.parent_pid);
  if (safety_unknown(s)) {
    line("verdict: {} (fork safety unknown: {})", probe::to_string(s.verdict),
         joined(s.unseen_hazards, "; "));
    line("  {} (So far as can be seen from here: the notes say what cannot.)", r.summary);
  } else {
    line("verdict: {} (fork {})", probe::to_string(s.verdict), s.fork_safe ? "safe" : "UNSAFE");
    line("  {}", r.summary);
  }
  line("evidence:");
  if (s.evidence.empty()) {
    line("  none: no CUDA library, device file, driver thread, OpenMP pool, thread or variable");
  }
  for (const auto& e : s.evidence) {
    line("  - {:<18} {}  [{}]", probe::to_string(e.kind), e.detail, e.source);
  }
  for (const auto& n : s.notes) line("  note: {}", n);
  line("advice:");
  for (const auto& a : r.advice) line("  - {}", a);
  if (r.environment_checked) {
    line("environment:");
    line("  GPUs from {}: {}", r.gpus.source, r.gpus.gpus.size());
    if (!r.gpus.driver_version.empty()) {
      line("  driver {}{}", r.gpus.driver_version,
           r.gpus.cuda_driver_version ? " (CUDA " + cuda_version(r.gpus.cuda_driver_version) + ")"
                                      : std::string());
    }
    for (const auto& g : r.gpus.gpus) {
      line("  GPU {}: {} {}", g.index, g.name.empty() ? "(unnamed)" : g.name, g.uuid);
    }
    for (const auto& n : r.gpus.notes) line("  note: {}", n);
    if (r.visible.set) {
      std::string shown;
      for (const auto& g : r.resolution.visible) {
        shown += (shown.empty() ? "" : ", ") + std::to_string(g.index);
      }
      line("  CUDA_VISIBLE_DEVICES=\"{}\": CUDA sees {} GPU{}{}{}", r.visible.value,
           r.resolution.visible.size(), r.resolution.visible.size() == 1 ? "" : "s",
           shown.empty() ? std::string() : " (" + shown + ")",
           r.resolution.uses_mig
               ? fmt::format(" and {} MIG instance(s)", r.resolution.mig_instances)
               : std::string());
    } else {
      line("  CUDA_VISIBLE_DEVICES unset: CUDA sees every GPU");
    }
    for (const auto& p : r.resolution.problems) line("  mismatch: {}", p);
  }
  return out;
}

std::string to_json(const Report& r) {
  using json = nlohmann::ordered_json;  // keys in the order a reader wants them
  const auto& s = r.state;
  json evidence = json::array();
  for (const auto& e : s.evidence) {
    evidence.push_back(
        {{"kind", probe::to_string(e.kind)}, {"detail", e.detail}, {"source", e.source}});
  }
  json j = {
      {"pid", s.pid},
      {"parent_pid", s.parent_pid},
      {"verdict", probe::to_string(s.verdict)},
      {"fork_safe", s.fork_safe},
      {"fork_safety", !s.fork_safe        ? "unsafe"
                      : safety_unknown(s) ? "unknown"
                                          : "safe"},
      {"unseen_hazards", s.unseen_hazards},
      {"summary", r.summary},
      {"evidence", evidence},
      {"notes", s.notes},
      {"advice", r.advice},
  };
  if (s.verdict == Verdict::kPoisoned) j["poisoned_by"] = s.poisoned_by;
  if (r.environment_checked) {
    json gpus = json::array();
    for (const auto& g : r.gpus.gpus) {
      gpus.push_back({{"index", g.index}, {"name", g.name}, {"uuid", g.uuid}, {"minor", g.minor}});
    }
    json visible = json::array();
    for (const auto& g : r.resolution.visible) visible.push_back(g.index);
    j["environment"] = {
        {"gpu_source", r.gpus.source},
        {"driver_version", r.gpus.driver_version},
        {"cuda_driver_version", r.gpus.cuda_driver_version},
        {"gpus", gpus},
        {"gpu_notes", r.gpus.notes},
        {"cuda_visible_devices",
         {{"set", r.visible.set},
          {"value", r.visible.value},
          {"visible", visible},
          {"mig_instances", r.resolution.mig_instances},
          {"problems", r.resolution.problems}}},
    };
  }
  // A process's environment and file names are bytes, not UTF-8: an invalid byte becomes
  // U+FFFD (the text report keeps the bytes) instead of dump() throwing type_error 316.
  return j.dump(2, ' ', false, json::error_handler_t::replace);
}

}  // namespace forkguard::doctor
