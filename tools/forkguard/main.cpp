// forkguard: the command-line tool. It parses flags, fills option structs and calls the library.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

#include <fstream>
#include <optional>
#include <sstream>

#include "forkguard/cuda/nvml.hpp"
#include "forkguard/cuda/visible_devices.hpp"
#include "forkguard/doctor/report.hpp"
#include "forkguard/init.hpp"
#include "forkguard/launch/gpu_plan.hpp"
#include "forkguard/launch/launcher.hpp"
#include "forkguard/probe/cuda_state.hpp"
#include "forkguard/version.hpp"

namespace {

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
    return doctor::kExitUsage;
  }
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

void write_report(const std::string& path, const forkguard::launch::Result& result) {
  if (path.empty()) return;
  std::ofstream out(path);
  out << result.to_json() << "\n";
  if (!out) fmt::print(stderr, "forkguard run: cannot write the JSON report to {}\n", path);
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
    auto inv = forkguard::cuda::discover_gpus();
    o.nproc = fl::count_visible_gpus(inv, forkguard::cuda::visible_devices_from_env());
    if (o.nproc == 0) {
      fmt::print(stderr,
                 "forkguard run: --nproc-per-node gpu, but no GPU is visible ({} GPUs from {})\n",
                 inv.gpus.size(), inv.source);
      return 2;
    }
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
  if (!f.ranks_filter.empty()) {
    std::stringstream ss(f.ranks_filter);
    std::string item;
    while (std::getline(ss, item, ',')) o.log.console_ranks.push_back(std::atoi(item.c_str()));
  }
  o.gpus = {f.bind_gpus, f.allow_sharing};
  o.stop.grace = std::chrono::milliseconds(static_cast<long>(f.grace * 1000));
  if (f.timeout > 0) o.timeout = std::chrono::milliseconds(static_cast<long>(f.timeout * 1000));
  o.quiet = f.quiet;
  if (o.start == fl::StartMethod::kForkServer) forkguard::init(argc, argv);
  try {
    auto result = fl::run(o, f.command);
    write_report(f.json_report, result);
    return 0;
  } catch (const fl::RankFailedError& e) {
    fmt::print(stderr, "forkguard run: {}", e.what());
    write_report(f.json_report, e.result());
    return e.result().exit_code();
  } catch (const fl::GpuPlanError& e) {
    fmt::print(stderr, "forkguard run: {}\n", e.what());
    return 2;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"forkguard: multi-process GPU work that survives fork"};
  app.set_version_flag("--version", std::string(forkguard::kVersion));
  app.require_subcommand(1);

  auto* doc = app.add_subcommand(
      "doctor",
      "Tell whether a process holds CUDA driver state (is fork safe?), with the evidence and the "
      "cure. Exit code: 0 fork-safe, 3 fork-unsafe, 2 usage or permission error.");
  int pid = 0;
  bool json = false;
  doc->add_option("--pid", pid, "Process to inspect (default: this doctor process itself)")
      ->check(CLI::PositiveNumber);
  doc->add_flag("--json", json,
                "Print one JSON object: pid, verdict, fork_safe, evidence, advice, environment");

  RunFlags rf;
  auto* runc = app.add_subcommand(
      "run",
      "Run N ranks of a command (one per GPU), each with torchrun's environment (RANK, "
      "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), supervised: the first failure stops the others; "
      "exit code is the failed rank's. Usage: forkguard run [options] -- CMD ARGS...");
  runc->add_option("--nproc-per-node,--nproc_per_node", rf.nproc,
                   "Ranks on this node: a number, or \"gpu\" for one per visible GPU")
      ->capture_default_str();
  runc->add_option("--start-method", rf.start,
                   "spawn (fork+exec), forkserver (from a clean zygote), fork (refused when this "
                   "process holds CUDA state) or auto")
      ->capture_default_str();
  runc->add_option("--nnodes", rf.nnodes, "Number of nodes (default 1, or from Slurm / MPI / PMI)");
  runc->add_option("--node-rank,--node_rank", rf.node_rank,
                   "This node's rank (default 0, or from Slurm / MPI / PMI)");
  runc->add_option("--master-addr,--master_addr", rf.master_addr,
                   "MASTER_ADDR for the ranks (default 127.0.0.1)");
  runc->add_option("--master-port,--master_port", rf.master_port,
                   "MASTER_PORT for the ranks (default 29500)");
  runc->add_flag("--standalone", rf.standalone, "Single node: pick a free port on loopback");
  runc->add_option("--max-restarts,--max_restarts", rf.max_restarts,
                   "Restart the whole group this many times after a failure")
      ->check(CLI::NonNegativeNumber);
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
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  runc->add_option("--timeout", rf.timeout, "Stop every rank after this many seconds (0: never)")
      ->check(CLI::NonNegativeNumber);
  runc->add_option("--json-report", rf.json_report,
                   "Write the per-rank report (exit status, duration, stderr tail) as JSON");
  runc->add_flag("--quiet", rf.quiet, "No notices from forkguard itself");
  runc->add_option("command", rf.command, "The command each rank runs (after --)")->required();

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
    return forkguard::doctor::kExitUsage;
  }

  try {
    if (doc->parsed()) return doctor(pid, json);
    if (runc->parsed()) return run(argc, argv, rf);
  } catch (const forkguard::Error& e) {
    fmt::print(stderr, "forkguard: {}\n", e.what());
    return 1;
  }
  return 0;
}
