// forkguard-bench: the data loader's benchmarks, run as `forkguard bench loader|decode ...` (the
// forkguard program runs this one, beside it) or directly. Flags in, library calls out.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "cli_common.hpp"
#include "forkguard/data/bench.hpp"
#include "forkguard/init.hpp"

namespace {

using forkguard::cli::whole_number;

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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"forkguard bench: benchmarks of the data loader", "forkguard bench"};
  app.require_subcommand(1);
  BenchFlags bf;
  auto* bl = app.add_subcommand(
      "loader",
      "The standard training pipeline (decode, RandomResizedCrop 224, flip, normalize) on image "
      "files: images/s after the first batch, time to first batch, peak RSS");
  auto* bd = app.add_subcommand(
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

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // help: 0
    return e.get_exit_code() == 0 ? rc : 2;
  }
  try {
    forkguard::init(argc, argv);  // the fork server for --worker-kind process
    return bl->parsed() ? bench_loader(bf) : bench_decode(bf);
  } catch (const std::exception& e) {
    // forkguard::Error or not one of ours: a message and the data errors' exit code, never
    // std::terminate's abort.
    fmt::print(stderr, "forkguard: {}\n", e.what());
    return 1;
  }
}
