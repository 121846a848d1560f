// forkguard: the command-line tool (run, doctor, trace; bench is forkguard-bench, beside it). It
// parses flags, fills option structs and calls the library.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include <optional>

#include "cli_common.hpp"
#include "forkguard/doctor/report.hpp"
#include "forkguard/init.hpp"
#include "forkguard/launch/environment.hpp"
#include "forkguard/launch/gpu_plan.hpp"
#include "forkguard/launch/launcher.hpp"
#include "forkguard/probe/cuda_state.hpp"
#include "forkguard/trace/trace.hpp"
#include "forkguard/version.hpp"

namespace {

using forkguard::cli::whole_number;

const CLI::Validator kPidValidator = whole_number("a PID", 1, INT_MAX);

// With --json, a failure is a JSON object on stdout too (a reader parses stdout whatever
// happened), beside the message on stderr.
void print_json_error(const std::string& message, int exit_code) {
  nlohmann::ordered_json j{{"error", message}, {"exit_code", exit_code}};
  fmt::print("{}\n", j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
}

int doctor(int pid, bool json) {
  using namespace forkguard;
  try {
    // Probe first: what the doctor itself loads for the environment section (NVML) must not
    // appear in its own verdict.
    auto state = pid > 0 ? probe::pid(pid) : probe::self();
    auto report = doctor::diagnose(std::move(state));
    std::fputs((json ? doctor::to_json(report) + "\n" : doctor::to_text(report)).c_str(), stdout);
    return doctor::exit_code(report);
  } catch (const probe::ProbeError& e) {
    fmt::print(stderr, "forkguard doctor: {}\n", e.what());
    if (json) print_json_error(e.what(), doctor::kExitUsage);
    return doctor::kExitUsage;
  } catch (const std::exception& e) {
    fmt::print(stderr, "forkguard doctor: {}\n", e.what());
    if (json) print_json_error(e.what(), 1);
    return 1;
  }
}

// `forkguard doctor ... --json` as typed, for a usage error CLI11 found before it set the flag.
bool doctor_json_requested(int argc, char** argv) {
  if (argc < 2 || std::string_view(argv[1]) != "doctor") return false;
  for (int i = 2; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--json") return true;
  }
  return false;
}

struct RunFlags {
  std::string nproc = "1";
  std::string start = "auto";
  std::optional<int> nnodes, node_rank, master_port;
  std::string master_addr;
  bool standalone = false;
  int max_restarts = 0;
  std::string log_dir;
  bool no_prefix = false;
  std::string tee;
  std::string ranks_filter;
  bool bind_gpus = false;
  bool allow_sharing = false;
  double grace = 30;
  double timeout = 0;
  std::string json_report;
  bool quiet = false;
  std::vector<std::string> command;
};

// False (and said) when the report cannot be written in full: a full disk, a missing folder.
bool write_report(const std::string& path, const forkguard::launch::Result& result) {
  if (path.empty()) return true;
  const std::string text = result.to_json() + "\n";
  std::FILE* f = std::fopen(path.c_str(), "w");
  int err = f == nullptr ? errno : 0;
  if (f != nullptr) {
    if (std::fwrite(text.data(), 1, text.size(), f) != text.size() || std::fflush(f) != 0) {
      err = errno;
    }
    if (std::fclose(f) != 0 && err == 0) err = errno;
  }
  if (err == 0) return true;
  fmt::print(stderr, "forkguard run: cannot write the JSON report to {}: {}\n", path,
             std::strerror(err));
  return false;
}

// Seconds from a flag: finite, not negative, at most a year (past that the milliseconds would
// overflow the clock arithmetic).
std::optional<std::chrono::milliseconds> seconds_flag(const char* flag, double v) {
  constexpr double kYear = 365.0 * 24 * 3600;
  if (!std::isfinite(v) || v < 0 || v > kYear) {
    fmt::print(stderr,
               "forkguard run: {} must be a number of seconds from 0 to {:.0f} (a year), not {}\n",
               flag, kYear, v);
    return std::nullopt;
  }
  return std::chrono::milliseconds(static_cast<long>(v * 1000));
}

// The library names options by their API names (launch::Options fields); here they are flags.
std::string in_flags(std::string message) {
  static const std::pair<const char*, const char*> kFlags[] = {
      {"nodes.master_addr = ", "--master-addr "},    {"nodes.master_addr", "--master-addr"},
      {"nodes.master_port", "--master-port"},        {"nodes.standalone", "--standalone"},
      {"gpus.allow_sharing", "--allow-gpu-sharing"}, {"gpus.bind", "--bind-gpus"},
      {"nproc_per_gpu", "--nproc-per-node gpu"},     {"log.console_ranks", "--local-ranks-filter"}};
  for (const auto& [api, flag] : kFlags) {
    for (size_t at = message.find(api); at != std::string::npos;
         at = message.find(api, at + std::strlen(flag))) {
      message.replace(at, std::strlen(api), flag);
    }
  }
  return message;
}

int run(int argc, char** argv, const RunFlags& f) {
  namespace fl = forkguard::launch;
  fl::Options o;
  auto method = fl::parse_start_method(f.start);
  if (!method) {
    fmt::print(stderr,
               "forkguard run: --start-method must be spawn, forkserver, fork or auto, not {}\n",
               f.start);
    return 2;
  }
  o.start = *method;
  if (f.nproc == "gpu") {
    o.nproc_per_gpu = true;
  } else {
    char* end = nullptr;
    long n = std::strtol(f.nproc.c_str(), &end, 10);
    if (*end != '\0' || n < 1 || n > 4096) {
      fmt::print(
          stderr,
          "forkguard run: --nproc-per-node must be a number from 1 to 4096 or \"gpu\", not {}\n",
          f.nproc);
      return 2;
    }
    o.nproc = static_cast<int>(n);
  }
  o.nodes = {f.nnodes, f.node_rank, f.master_addr, f.master_port, f.standalone};
  o.max_restarts = f.max_restarts;
  o.log.log_dir = f.log_dir;
  o.log.prefix = !f.no_prefix;
  // Syntax here; which local ranks exist is the library's check (log.console_ranks), so that
  // --nproc-per-node gpu is bounded the same way once the GPUs are counted.
  if (!f.ranks_filter.empty()) {
    for (size_t pos = 0; pos <= f.ranks_filter.size();) {
      size_t comma = std::min(f.ranks_filter.find(',', pos), f.ranks_filter.size());
      std::string item = f.ranks_filter.substr(pos, comma - pos);
      pos = comma + 1;
      int r = -1;
      auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), r);
      if (item.empty() || ec != std::errc() || end != item.data() + item.size() || r < 0) {
        fmt::print(stderr,
                   "forkguard run: --local-ranks-filter takes local ranks (whole numbers from 0) "
                   "separated by commas; \"{}\" is not one\n",
                   item);
        return 2;
      }
      o.log.console_ranks.push_back(r);
    }
  }
  o.gpus = {f.bind_gpus, f.allow_sharing};
  auto grace = seconds_flag("--grace", f.grace);
  auto timeout = seconds_flag("--timeout", f.timeout);
  if (!grace || !timeout) return 2;
  o.stop.grace = *grace;
  if (timeout->count() > 0) o.timeout = *timeout;
  o.quiet = f.quiet;
  if (o.start == fl::StartMethod::kForkServer) forkguard::init(argc, argv);
  try {
    auto result = fl::run(o, f.command);
    return write_report(f.json_report, result) ? 0 : 1;
  } catch (const fl::RankFailedError& e) {
    fmt::print(stderr, "forkguard run: {}", e.what());
    write_report(f.json_report, e.result());
    return e.result().exit_code();
  } catch (const fl::GpuPlanError& e) {
    fmt::print(stderr, "forkguard run: {}\n", in_flags(e.what()));
    return 2;
  } catch (const fl::PlacementError& e) {  // the port's range and the console ranks too
    fmt::print(stderr, "forkguard run: {}\n", in_flags(e.what()));
    return 2;
  } catch (const fl::SpawnError& e) {
    fmt::print(stderr, "forkguard run: {}\n", e.what());
    return e.exit_code();
  }
}

struct TraceFlags {
  bool strict = false;
  std::string json;
  bool quiet = false;
  std::vector<std::string> command;
};

int trace(const TraceFlags& f) {
  namespace tr = forkguard::trace;
  try {
    tr::Options options;
    options.strict = f.strict;
    options.json_path = f.json;
    auto result = tr::run(options, f.command);
    // A program that never came near CUDA gets no summary at all: there is nothing to sum up.
    if (result.found() || (!f.quiet && !result.events.empty())) {
      fmt::print(stderr, "{}\n", result.summary());
    }
    return result.exit_code;
  } catch (const tr::TraceError& e) {
    fmt::print(stderr, "forkguard trace: {}\n", e.what());
    return e.exit_code();
  }
}

// `forkguard bench ...` is `forkguard-bench ...`, the program beside this one.
int run_bench_program(int argc, char** argv) {
  std::string self(PATH_MAX, '\0');
  const ssize_t n = ::readlink("/proc/self/exe", self.data(), self.size());
  self.resize(n > 0 ? static_cast<size_t>(n) : 0);
  std::string path = self.substr(0, self.rfind('/') + 1) + "forkguard-bench";
  std::vector<char*> args{path.data()};
  args.insert(args.end(), argv + 2, argv + argc);
  args.push_back(nullptr);
  ::execv(path.c_str(), args.data());
  fmt::print(stderr, "forkguard bench: cannot run {} (installed beside forkguard): {}\n", path,
             std::strerror(errno));
  return 127;
}

// The subcommand typed: the first argument that is not a flag (the top level has only --help and
// --version), or nothing.
std::string_view typed_subcommand(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view a(argv[i]);
    if (a == "--") break;
    if (!a.starts_with('-')) return a;
  }
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  // The data-loader benchmarks are a program of their own: the image pipeline and its codecs
  // (half of this program's code) loaded, relocated and torn down in every `forkguard run`
  // cost 0.1 ms there (docs/performance.md, start-up). As git runs git-<command>.
  if (argc > 1 && std::string_view(argv[1]) == "bench") return run_bench_program(argc, argv);
  CLI::App app{"forkguard: multi-process GPU work that survives fork"};
  app.set_version_flag("--version", std::string(forkguard::kVersion));
  app.require_subcommand(1);
  // Only the typed subcommand is set up (all of them when none is recognised: for --help and
  // CLI11's own messages). Each option costs CLI11 a few microseconds to build, and
  // `forkguard run` starts in every launch (docs/performance.md, start-up).
  const std::string_view typed = typed_subcommand(argc, argv);
  constexpr std::string_view kSubcommands[] = {"doctor", "run", "bench", "trace"};
  const bool known =
      std::find(std::begin(kSubcommands), std::end(kSubcommands), typed) != std::end(kSubcommands);
  auto wanted = [typed, known](std::string_view name) { return typed == name || !known; };

  int pid = 0;
  bool json = false;
  CLI::App* doc = nullptr;
  if (wanted("doctor")) {
    doc = app.add_subcommand(
        "doctor",
        "Tell whether a process holds CUDA driver state or a live GNU OpenMP pool (is fork safe?), "
        "with the evidence and the cure. Exit code: 0 fork-safe, 3 fork-unsafe, 4 fork safety "
        "unknown (what --pid can see is safe, but a hazard cannot be seen from outside: torch's "
        "own fork poison, or OpenMP's threads without ptrace access), 2 usage or permission "
        "error, or a PID that is no live user process (a kernel thread, a zombie).");
    doc->add_option("--pid", pid, "Process to inspect (default: this doctor process itself)")
        ->check(kPidValidator);
    doc->add_flag("--json", json,
                  "Print one JSON object: pid, verdict, fork_safe, evidence, advice, environment");
  }

  RunFlags rf;
  CLI::App* runc = nullptr;
  if (wanted("run")) {
    runc = app.add_subcommand(
        "run",
        "Run N ranks of a command (one per GPU), each with torchrun's environment (RANK, "
        "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), supervised: the first failure stops the "
        "others; exit code is the failed rank's. Usage: forkguard run [options] -- CMD ARGS...");
    runc->add_option("--nproc-per-node,--nproc_per_node", rf.nproc,
                     "Ranks on this node: a number, or \"gpu\" for one per visible GPU")
        ->capture_default_str();
    runc->add_option("--start-method", rf.start,
                     "spawn (fork+exec), forkserver (from a clean zygote), fork (refused when this "
                     "process holds CUDA state) or auto")
        ->capture_default_str();
    runc->add_option("--nnodes", rf.nnodes,
                     "Number of nodes (default 1, or from Slurm / MPI / PMI)");
    runc->add_option("--node-rank,--node_rank", rf.node_rank,
                     "This node's rank (default 0, or from Slurm / MPI / PMI)");
    runc->add_option("--master-addr,--master_addr", rf.master_addr,
                     "MASTER_ADDR for the ranks (default 127.0.0.1)");
    runc->add_option("--master-port,--master_port", rf.master_port,
                     "MASTER_PORT for the ranks (default 29500)");
    runc->add_flag("--standalone", rf.standalone, "Single node: pick a free port on loopback");
    runc->add_option("--max-restarts,--max_restarts", rf.max_restarts,
                     "Restart the whole group this many times after a failure")
        ->check(whole_number("--max-restarts", 0, 1000));
    runc->add_option("--log-dir,--log_dir", rf.log_dir,
                     "Write DIR/attempt_N/rankR/{stdout,stderr}.log for every rank");
    runc->add_option("--tee", rf.tee,
                     "Accepted for torchrun compatibility: console output is "
                     "always shown, prefixed [rankN]:");
    runc->add_flag("--no-prefix", rf.no_prefix, "Do not prefix console lines with [rankN]:");
    runc->add_option("--local-ranks-filter,--local_ranks_filter", rf.ranks_filter,
                     "Show only these ranks on the console (comma-separated)");
    runc->add_flag("--bind-gpus", rf.bind_gpus,
                   "Give each rank its own GPU through CUDA_VISIBLE_DEVICES; more ranks than "
                   "visible GPUs is an error before launch");
    runc->add_flag("--allow-gpu-sharing", rf.allow_sharing,
                   "With --bind-gpus, share GPUs round-robin when there are more ranks than GPUs");
    runc->add_option("--grace", rf.grace, "Seconds between SIGTERM and SIGKILL when stopping ranks")
        ->capture_default_str();
    runc->add_option("--timeout", rf.timeout, "Stop every rank after this many seconds (0: never)");
    runc->add_option("--json-report", rf.json_report,
                     "Write the per-rank report (exit status, duration, stderr tail) as JSON");
    runc->add_flag("--quiet", rf.quiet, "No notices from forkguard itself");
    runc->add_option("command", rf.command, "The command each rank runs (after --)")->required();
  }

  if (wanted("bench")) {
    app.add_subcommand("bench",
                       "Benchmarks of the data loader (loader, decode; forkguard bench --help). "
                       "The program forkguard-bench, beside this one, runs them");
  }

  TraceFlags tf;
  CLI::App* tracec = nullptr;
  if (wanted("trace")) {
    tracec = app.add_subcommand(
        "trace",
        "Run a command with libforkguard_trace.so preloaded (children inherit it): report where "
        "CUDA was initialized when a process forks after that, and where a child of such a fork "
        "touches CUDA. Exit code: the command's. Usage: forkguard trace [options] -- CMD ARGS...");
    tracec->add_flag(
        "--strict", tf.strict,
        "A child forked after CUDA initialization exits with code 70 at its first CUDA "
        "touch, with the report, instead of failing later");
    tracec->add_option(
        "--json", tf.json,
        "Write every event (driver_loaded, device_opened, cuda_init, dirty_fork, "
        "poisoned_touch, openmp_pool, openmp_fork) with pid, ppid, time and native and "
        "Python frames");
    tracec->add_flag("--quiet", tf.quiet, "No summary when nothing was found");
    tracec->add_option("command", tf.command, "The command to trace (after --)")->required();
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    if (doctor_json_requested(argc, argv)) {
      print_json_error(e.what(), forkguard::doctor::kExitUsage);
    }
    return forkguard::doctor::kExitUsage;
  }

  try {
    if (doc != nullptr && doc->parsed()) return doctor(pid, json);
    if (runc != nullptr && runc->parsed()) return run(argc, argv, rf);
    if (tracec != nullptr && tracec->parsed()) return trace(tf);
  } catch (const forkguard::Error& e) {
    fmt::print(stderr, "forkguard: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    // Not one of ours (the library converts what it knows of): still a message and the data
    // errors' exit code, never std::terminate's abort.
    fmt::print(stderr, "forkguard: {}\n", e.what());
    return 1;
  }
  return 0;
}
