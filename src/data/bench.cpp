#include "forkguard/data/bench.hpp"

#include <fmt/format.h>
#include <sys/resource.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <fstream>
#include <mutex>
#include <thread>

#include "data/image/decode.hpp"
#include "detail/fnv.hpp"
#include "forkguard/data/image_folder.hpp"
#include "forkguard/data/image_transform.hpp"
#include "forkguard/data/tar_shards.hpp"

namespace forkguard::data {
namespace {

using Clock = std::chrono::steady_clock;

std::shared_ptr<Dataset> open_dataset(const std::string& data, DatasetFormat format) {
  switch (format) {
    case DatasetFormat::kImageFolder: return std::make_shared<ImageFolder>(data);
    case DatasetFormat::kFileList: return std::make_shared<FileList>(data);
    case DatasetFormat::kWebDataset: return std::make_shared<TarShards>(data);
  }
  throw DataError("unknown dataset format");
}

// A "Key:   1234 kB" line of a /proc file, in bytes; 0 when the process or the line is gone.
uint64_t proc_kb(pid_t pid, const char* file, const char* key) {
  std::ifstream in(fmt::format("/proc/{}/{}", pid, file));
  std::string line;
  const size_t n = std::strlen(key);
  while (std::getline(in, line)) {
    if (line.compare(0, n, key) == 0) return std::strtoull(line.c_str() + n, nullptr, 10) * 1024;
  }
  return 0;
}

// The epochs of one loader: the rates, the first batch, the memory.
void measure_epochs(const std::shared_ptr<Dataset>& ds, const std::shared_ptr<Transform>& tf,
                    const LoaderOptions& options, const LoaderBenchOptions& o,
                    LoaderBenchResult& r) {
  const auto t0 = Clock::now();
  Loader loader(ds, tf, options);
  const uint64_t total = static_cast<uint64_t>(o.epochs) * loader.size() * o.batch_size;
  uint64_t h = forkguard::detail::kFnvOffset;
  Clock::time_point first{};
  uint64_t after_first = 0;
  for (int e = 0; e < o.epochs; ++e) {
    while (auto b = loader.next()) {
      if (r.images == 0) {
        first = Clock::now();
        r.first_batch_seconds = std::chrono::duration<double>(first - t0).count();
      } else {
        after_first += b->size();
      }
      r.images += b->size();
      if (o.digest) {
        h = forkguard::detail::fnv1a(b->images_data(), b->images_bytes(), h);
        h = forkguard::detail::fnv1a(b->labels(), b->size() * sizeof(int64_t), h);
      }
      if (o.progress) o.progress(r.images, total);
    }
    const auto measuring = Clock::now();  // not counted in the rate
    uint64_t pss = proc_kb(::getpid(), "smaps_rollup", "Pss:");
    for (pid_t w : loader.worker_pids()) pss += proc_kb(w, "smaps_rollup", "Pss:");
    r.epoch_pss_bytes.push_back(pss);
    first += Clock::now() - measuring;
  }
  uint64_t workers_peak = 0;
  for (pid_t w : loader.worker_pids()) workers_peak += proc_kb(w, "status", "VmHWM:");
  const double steady = std::chrono::duration<double>(Clock::now() - first).count();
  r.images_per_second = steady > 0 ? static_cast<double>(after_first) / steady : 0;
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  r.peak_rss_bytes = static_cast<uint64_t>(ru.ru_maxrss) * 1024 + workers_peak;
  r.stats = loader.stats();
  r.skipped = r.stats.skipped;
  if (o.digest) r.digest = fmt::format("{:016x}", h);
}

}  // namespace

LoaderBenchResult run_loader_bench(const LoaderBenchOptions& o) {
  auto ds = open_dataset(o.data, o.format);
  auto tf = std::make_shared<ImageTransform>(ImageOptions{.train = true, .dtype = o.dtype});
  const LoaderOptions options{.batch_size = o.batch_size,
                              .workers = o.workers,
                              .worker_kind = o.worker_kind,
                              .bad_sample = o.bad_sample,
                              .seed = o.seed,
                              .shuffle = true};
  LoaderBenchResult r;
  measure_epochs(ds, tf, options, o, r);
  for (int k = 0; k < o.fresh_loaders; ++k) {
    const auto t0 = Clock::now();
    Loader fresh(ds, tf, options);
    if (!fresh.next()) break;  // an empty epoch (an empty dataset): nothing to time
    r.fresh_first_batches.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  if (!r.fresh_first_batches.empty()) {
    auto v = r.fresh_first_batches;
    std::sort(v.begin(), v.end());
    const size_t m = v.size() / 2;
    r.fresh_first_batch_seconds = v.size() % 2 == 1 ? v[m] : (v[m - 1] + v[m]) / 2;
  }
  return r;
}

DecodeBenchResult run_decode_bench(const std::string& data, DatasetFormat format, size_t threads) {
  if (threads > kMaxWorkers) {
    throw DataError(
        fmt::format("bench decode: threads must be at most {}, not {}", kMaxWorkers, threads));
  }
  auto ds = open_dataset(data, format);
  std::vector<std::vector<unsigned char>> files;
  files.reserve(ds->size());
  for (size_t i = 0; i < ds->size(); ++i) files.push_back(ds->read(i).data);
  threads = std::max<size_t>(1, threads);
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> pixels{0};
  std::vector<std::thread> pool;
  std::exception_ptr failure;
  std::mutex failure_mutex;
  const auto t0 = Clock::now();
  for (size_t t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      try {
        for (size_t i; (i = next++) < files.size();) {
          image::DecodeOptions d{100'000'000, 1, 1, false};
          auto r = image::decode(files[i].data(), files[i].size(), ds->key(i), d, [](int w, int h) {
            return image::Box{0, 0, static_cast<double>(w), static_cast<double>(h)};
          });
          pixels += static_cast<uint64_t>(r.width) * static_cast<uint64_t>(r.height);
        }
      } catch (...) {
        std::lock_guard lock(failure_mutex);
        if (!failure) failure = std::current_exception();
      }
    });
  }
  for (auto& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  return {static_cast<double>(files.size()) / s, static_cast<double>(pixels) / s / 1e6,
          files.size(), threads};
}

}  // namespace forkguard::data
