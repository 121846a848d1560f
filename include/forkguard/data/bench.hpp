// The loader benchmarks behind `forkguard bench loader` and `forkguard bench decode`: the
// standard training pipeline (decode -> RandomResizedCrop 224 -> flip -> normalize) over image
// files, and the full-size decode-only rate of the same files (the ceiling).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "forkguard/data/loader.hpp"

namespace forkguard::data {

enum class DatasetFormat { kImageFolder, kFileList, kWebDataset };

struct LoaderBenchOptions {
  std::string data;  // a directory, or the list file
  DatasetFormat format = DatasetFormat::kImageFolder;
  size_t workers = 2;
  WorkerKind worker_kind = WorkerKind::kThread;
  size_t batch_size = 64;
  int epochs = 3;
  DType dtype = DType::kFloat32;  // kFloat32 (normalized) or kUInt8
  BadSample bad_sample = BadSample::kError;
  uint64_t seed = 0;
  bool digest = false;  // hash every batch, in delivery order
  // Loaders built one after another once the epochs are done, each timed to its first batch
  // (the CLI's default is 3).
  int fresh_loaders = 0;
  // Called after each batch with (images so far, images in all epochs).
  std::function<void(uint64_t done, uint64_t total)> progress{};
};

struct LoaderBenchResult {
  double images_per_second = 0;    // after the first batch
  double first_batch_seconds = 0;  // from the loader's construction
  // The median first batch of the fresh loaders (new workers, new slots) built after the epochs,
  // on cores that are running: first_batch_seconds starts from cores that may have been idle for
  // seconds (on a VM, idle vCPUs take tens of ms to come back up to speed; docs/performance.md).
  // 0 without fresh loaders.
  double fresh_first_batch_seconds = 0;
  std::vector<double> fresh_first_batches;
  // This process's peak RSS plus each process worker's (VmHWM): an upper bound, since the shared
  // slots count in every process that touched them.
  uint64_t peak_rss_bytes = 0;
  // At the end of each epoch: the proportional set size (Pss: shared pages divided among their
  // processes) of this process and its process workers together. Flat when nothing leaks.
  std::vector<uint64_t> epoch_pss_bytes;
  uint64_t images = 0;
  uint64_t skipped = 0;
  std::string digest;  // hex FNV-1a 64 of every batch's images and labels; "" if off
  LoaderStats stats;
};

LoaderBenchResult run_loader_bench(const LoaderBenchOptions& options);

struct DecodeBenchResult {
  double images_per_second = 0;
  double megapixels_per_second = 0;
  uint64_t images = 0;
  size_t threads = 0;
};

// Full-size decode of every file (read into memory first), on `threads` threads.
DecodeBenchResult run_decode_bench(const std::string& data, DatasetFormat format, size_t threads);

}  // namespace forkguard::data
