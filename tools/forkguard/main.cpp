// forkguard: the command-line tool. It parses flags, fills option structs and calls the library.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <unistd.h>

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
#include <thread>

#include <fstream>
#include <optional>
#include <sstream>

#include "forkguard/cuda/nvml.hpp"
#include "forkguard/cuda/visible_devices.hpp"
#include "forkguard/data/bench.hpp"
#include "forkguard/doctor/report.hpp"
#include "forkguard/init.hpp"
#include "forkguard/launch/environment.hpp"
#include "forkguard/launch/gpu_plan.hpp"
#include "forkguard/launch/launcher.hpp"
#include "forkguard/probe/cuda_state.hpp"
#include "forkguard/trace/trace.hpp"
#include "forkguard/version.hpp"

namespace {

// A whole number from lo to hi, said in a short message. CLI11's PositiveNumber/NonNegativeNumber
// refused "abc" with the whole double range ("not in range 0 to 1.79769e+308" spelled out: 308
// digits).
CLI::Validator whole_number(const char* what, long lo, long hi) {
  return CLI::Validator(
      [what, lo, hi](std::string& s) -> std::string {
        long v = 0;
        auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (ec == std::errc() && end == s.data() + s.size() && v >= lo && v <= hi) return {};
        return fmt::format("{} is a whole number from {} to {}, not \"{}\"", what, lo, hi, s);
      },
      fmt::format("{}..{}", lo, hi));
}
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

struct BenchFlags {
  std::string data;
  std::string format = "imagefolder";
  size_t workers = std::max(1u, std::thread::hardware_concurrency());
  std::string worker_kind = "thread";
  size_t batch_size = 64;
  int epochs = 3;
  std::string dtype = "float32";
  std::string bad_sample = "error";
  bool digest = false;
  bool json = false;
  int fresh_loaders = 3;
};

forkguard::data::DatasetFormat format_of(const std::string& f) {
  using forkguard::data::DatasetFormat;
  return f == "filelist" ? DatasetFormat::kFileList
         : f == "wds"    ? DatasetFormat::kWebDataset
                         : DatasetFormat::kImageFolder;
}

int bench_loader(const BenchFlags& f) {
  namespace fd = forkguard::data;
  fd::LoaderBenchOptions o;
  o.data = f.data;
  o.format = format_of(f.format);
  o.workers = f.workers;
  o.worker_kind = f.worker_kind == "process" ? fd::WorkerKind::kProcess : fd::WorkerKind::kThread;
  o.batch_size = f.batch_size;
  o.epochs = f.epochs;
  o.dtype = f.dtype == "uint8" ? fd::DType::kUInt8 : fd::DType::kFloat32;
  o.bad_sample = f.bad_sample == "skip" ? fd::BadSample::kSkip : fd::BadSample::kError;
  o.digest = f.digest;
  o.fresh_loaders = f.fresh_loaders;
  const bool bar = ::isatty(2) != 0;
  if (bar) {
    o.progress = [start = std::chrono::steady_clock::now()](uint64_t done, uint64_t total) {
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const int width = 30;
      const int filled = total > 0 ? static_cast<int>(width * done / total) : width;
      fmt::print(stderr, "\r[{:=<{}}{: <{}}] {}/{} images  {:.0f} img/s ", "", filled, "",
                 width - filled, done, total, s > 0 ? done / s : 0.0);
    };
  }
  auto r = fd::run_loader_bench(o);
  if (bar) fmt::print(stderr, "\n");
  if (f.json) {
    nlohmann::ordered_json j{{"images_per_second", r.images_per_second},
                             {"first_batch_seconds", r.first_batch_seconds},
                             {"fresh_first_batch_seconds", r.fresh_first_batch_seconds},
                             {"peak_rss_bytes", r.peak_rss_bytes},
                             {"images", r.images},
                             {"skipped", r.skipped}};
    if (f.digest) j["digest"] = r.digest;
    j["workers"] = f.workers;
    j["worker_kind"] = f.worker_kind;
    j["read_seconds"] = r.stats.read_seconds;
    j["transform_seconds"] = r.stats.transform_seconds;
    j["consumer_wait_seconds"] = r.stats.consumer_wait_seconds;
    j["epoch_pss_bytes"] = r.epoch_pss_bytes;
    j["fresh_first_batches_seconds"] = r.fresh_first_batches;
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print(
      "{:.1f} images/s (steady state, after the first batch), first batch {:.3f} s, "
      "peak RSS {:.1f} MB, {} images, {} skipped\n",
      r.images_per_second, r.first_batch_seconds, r.peak_rss_bytes / 1e6, r.images, r.skipped);
  fmt::print(
      "  per stage (summed over {} {} workers): read {:.2f} s, transform {:.2f} s, "
      "consumer wait {:.2f} s\n",
      f.workers, f.worker_kind, r.stats.read_seconds, r.stats.transform_seconds,
      r.stats.consumer_wait_seconds);
  if (!r.fresh_first_batches.empty()) {
    fmt::print(
        "  first batch of a fresh loader on running cores: {:.3f} s (median of {}; the first "
        "loader's started on idle cores)\n",
        r.fresh_first_batch_seconds, r.fresh_first_batches.size());
  }
  std::string pss;
  for (uint64_t b : r.epoch_pss_bytes)
    pss += fmt::format("{}{:.1f}", pss.empty() ? "" : " / ", b / 1e6);
  fmt::print("  memory at each epoch's end (Pss of this process and its workers): {} MB\n", pss);
  if (f.digest) fmt::print("digest {}\n", r.digest);
  return 0;
}

int bench_decode(const BenchFlags& f) {
  auto r = forkguard::data::run_decode_bench(f.data, format_of(f.format), f.workers);
  if (f.json) {
    fmt::print("{}\n", nlohmann::ordered_json{{"images_per_second", r.images_per_second},
                                              {"megapixels_per_second", r.megapixels_per_second},
                                              {"images", r.images},
                                              {"threads", r.threads}}
                           .dump());
    return 0;
  }
  fmt::print("full-size decode only: {:.1f} images/s, {:.1f} MP/s ({} images, {} threads)\n",
             r.images_per_second, r.megapixels_per_second, r.images, r.threads);
  return 0;
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"forkguard: multi-process GPU work that survives fork"};
  app.set_version_flag("--version", std::string(forkguard::kVersion));
  app.require_subcommand(1);

  auto* doc = app.add_subcommand(
      "doctor",
      "Tell whether a process holds CUDA driver state (is fork safe?), with the evidence and the "
      "cure. Exit code: 0 fork-safe, 3 fork-unsafe, 2 usage or permission error, or a PID that is "
      "no live user process (a kernel thread, a zombie).");
  int pid = 0;
  bool json = false;
  doc->add_option("--pid", pid, "Process to inspect (default: this doctor process itself)")
      ->check(kPidValidator);
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

  BenchFlags bf;
  auto* benchc =
      app.add_subcommand("bench", "Benchmarks of the data loader")->require_subcommand(1);
  auto* bl = benchc->add_subcommand(
      "loader",
      "The standard training pipeline (decode, RandomResizedCrop 224, flip, normalize) on image "
      "files: images/s after the first batch, time to first batch, peak RSS");
  auto* bd = benchc->add_subcommand(
      "decode", "Full-size decode-only rate of the same files on as many threads: the ceiling");
  for (auto* sc : {bl, bd}) {
    sc->add_option("--data", bf.data, "ImageFolder root, or the file list")->required();
    sc->add_option("--format", bf.format, "imagefolder | filelist | wds")
        ->check(CLI::IsMember({"imagefolder", "filelist", "wds"}))
        ->capture_default_str();
    // CLI11 reads "-1" into a size_t as 2^64-1: the range check refuses it by the flag's name.
    sc->add_option("--workers", bf.workers, "Workers (threads for decode)")
        ->capture_default_str()
        ->check(CLI::Range(size_t{0}, forkguard::data::kMaxWorkers));
    sc->add_flag("--json", bf.json, "Print one JSON object");
  }
  bl->add_option("--worker-kind", bf.worker_kind, "thread | process")
      ->check(CLI::IsMember({"thread", "process"}))
      ->capture_default_str();
  bl->add_option("--batch-size", bf.batch_size)
      ->capture_default_str()
      ->check(whole_number("--batch-size", 1, 65536));
  bl->add_option("--epochs", bf.epochs)
      ->capture_default_str()
      ->check(whole_number("--epochs", 1, 1'000'000));
  bl->add_option("--dtype", bf.dtype, "float32 | uint8")
      ->check(CLI::IsMember({"float32", "uint8"}))
      ->capture_default_str();
  bl->add_option("--bad-sample", bf.bad_sample, "error | skip")
      ->check(CLI::IsMember({"error", "skip"}))
      ->capture_default_str();
  bl->add_option("--fresh-loaders", bf.fresh_loaders,
                 "After the epochs, build this many fresh loaders one after another and time "
                 "each one's first batch (new workers and slots, on running cores)")
      ->capture_default_str()
      ->check(whole_number("--fresh-loaders", 0, 1000));
  bl->add_flag("--digest", bf.digest,
               "Print a hash of every batch in delivery order (the same for any number or kind "
               "of workers)");

  TraceFlags tf;
  auto* tracec = app.add_subcommand(
      "trace",
      "Run a command with libforkguard_trace.so preloaded (children inherit it): report where "
      "CUDA was initialized when a process forks after that, and where a child of such a fork "
      "touches CUDA. Exit code: the command's. Usage: forkguard trace [options] -- CMD ARGS...");
  tracec->add_flag("--strict", tf.strict,
                   "A child forked after CUDA initialization exits with code 70 at its first CUDA "
                   "touch, with the report, instead of failing later");
  tracec->add_option("--json", tf.json,
                     "Write every event (driver_loaded, device_opened, cuda_init, dirty_fork, "
                     "poisoned_touch) with pid, ppid, time and native and Python frames");
  tracec->add_flag("--quiet", tf.quiet, "No summary when nothing was found");
  tracec->add_option("command", tf.command, "The command to trace (after --)")->required();

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
    if (doc->parsed()) return doctor(pid, json);
    if (runc->parsed()) return run(argc, argv, rf);
    if (tracec->parsed()) return trace(tf);
    if (bl->parsed() || bd->parsed()) {
      forkguard::init(argc, argv);  // the fork server for --worker-kind process
      return bl->parsed() ? bench_loader(bf) : bench_decode(bf);
    }
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
