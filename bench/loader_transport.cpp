// The loader's transport, beside a plain memcpy of the same bytes in the same run: fixed-size
// samples (one 3x224x224 uint8 image each) through a trivial transform (copy), delivered to the
// consumer by thread workers and by process workers (fork server, memfd slots over SCM_RIGHTS).
//
//   build/release/bin/loader_transport [--workers N] [--batches N] [--batch-size N]
//
// Prints GB/s delivered for each worker kind, process/thread as a percentage, and the consumer's
// own cost per batch (next() + release when the batch is already there) as a percentage of one
// memcpy of that batch. Targets (issue 4): process >= 90 % of thread; consumer overhead < 5 %.
#include <fmt/format.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "forkguard/data/loader.hpp"
#include "forkguard/init.hpp"

namespace fd = forkguard::data;
using Clock = std::chrono::steady_clock;

namespace {

constexpr size_t kSample = 3 * 224 * 224;

// Every sample is the same precomputed bytes (with its index stamped in): reading costs one copy
// into the Sample, as reading a cached file would.
class PatternDataset : public fd::Dataset {
 public:
  explicit PatternDataset(size_t n) : n_(n), bytes_(kSample) {
    for (size_t i = 0; i < kSample; ++i) bytes_[i] = static_cast<unsigned char>(i * 31 + 7);
  }
  size_t size() const override { return n_; }
  fd::Sample read(size_t i) const override {
    fd::Sample s;
    s.data = bytes_;
    std::memcpy(s.data.data(), &i, sizeof i);
    s.label = static_cast<int64_t>(i % 1000);
    s.key = std::to_string(i);
    return s;
  }
  std::optional<fd::Description> describe() const override {
    return fd::Description{"bench_pattern", {{"n", n_}}};
  }

 private:
  size_t n_;
  std::vector<unsigned char> bytes_;
};

FORKGUARD_REGISTER_DATASET(bench_pattern, [](const nlohmann::json& p) {
  return std::make_unique<PatternDataset>(p.at("n").get<size_t>());
});

double thread_cpu_ms() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Run {
  double gbps = 0;
  double next_ms = 0;  // median consumer CPU time in next() + release, batches already waiting
};

Run measure(fd::WorkerKind kind, size_t workers, size_t batches, size_t batch_size) {
  auto ds = std::make_shared<PatternDataset>(batches * batch_size);
  auto tf = std::make_shared<fd::CopyTransform>(fd::OutputSpec{{3, 224, 224}});
  fd::Loader loader(
      ds, tf, {.batch_size = batch_size, .workers = workers, .worker_kind = kind, .prefetch = 4});
  Run r;
  // Warm-up epoch: workers started, slots created (and their pages touched once).
  while (auto b = loader.next()) {
  }
  // Throughput: the consumer takes each batch and reads one byte per page of it.
  size_t bytes = 0;
  auto t0 = Clock::now();
  while (auto b = loader.next()) {
    const auto* p = static_cast<const volatile unsigned char*>(b->images_data());
    unsigned sum = 0;
    for (size_t off = 0; off < b->images_bytes(); off += 4096) sum += p[off];
    (void)sum;
    bytes += b->images_bytes();
  }
  r.gbps =
      static_cast<double>(bytes) / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9;
  // Consumer overhead: let the workers fill every slot, then take the waiting batches back to
  // back, timing the consumer thread's CPU in next() + release (not the time it is descheduled
  // while the workers it wakes take the cores).
  std::vector<double> next_ms;
  for (size_t round = 0; next_ms.size() < batches; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(60));
    for (size_t i = 0; i < workers * 3; ++i) {
      const double t = thread_cpu_ms();
      auto b = loader.next();
      if (!b) break;
      b.reset();  // release: the slot goes back to its worker
      next_ms.push_back(thread_cpu_ms() - t);
    }
  }
  r.next_ms = median(next_ms);
  return r;
}

double memcpy_gbps(size_t batch_bytes, size_t reps, double* ms_per_batch) {
  std::vector<unsigned char> src(batch_bytes, 1), dst(batch_bytes);
  std::memcpy(dst.data(), src.data(), batch_bytes);  // fault the pages in
  std::vector<double> t;
  for (size_t i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    std::memcpy(dst.data(), src.data(), batch_bytes);
    t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    src[i % batch_bytes] = static_cast<unsigned char>(dst[(i * 7) % batch_bytes] + 1);
  }
  *ms_per_batch = median(t);
  return static_cast<double>(batch_bytes) / (*ms_per_batch * 1e-3) / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  forkguard::init(argc, argv);
  size_t workers = std::max(1u, std::thread::hardware_concurrency());
  size_t batches = 40, batch_size = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    size_t v = std::stoul(argv[i + 1]);
    if (a == "--workers") workers = v;
    if (a == "--batches") batches = v;
    if (a == "--batch-size") batch_size = v;
  }
  const size_t batch_bytes = kSample * batch_size;
  fmt::print("loader transport: {} batches of {} x {} B ({:.1f} MB), {} workers\n", batches,
             batch_size, kSample, batch_bytes / 1e6, workers);
  double memcpy_ms = 0;
  double mc = memcpy_gbps(batch_bytes, 50, &memcpy_ms);
  Run th = measure(fd::WorkerKind::kThread, workers, batches, batch_size);
  Run pr = measure(fd::WorkerKind::kProcess, workers, batches, batch_size);
  fmt::print("  memcpy of one batch (1 thread):    {:7.2f} GB/s  {:.3f} ms/batch\n", mc, memcpy_ms);
  fmt::print("  thread workers, delivered:         {:7.2f} GB/s  consumer {:.4f} ms/batch\n",
             th.gbps, th.next_ms);
  fmt::print("  process workers, delivered:        {:7.2f} GB/s  consumer {:.4f} ms/batch\n",
             pr.gbps, pr.next_ms);
  fmt::print("  process / thread:                  {:7.1f} %   (target >= 90 %)\n",
             100 * pr.gbps / th.gbps);
  fmt::print("  consumer overhead / memcpy, thread:  {:5.2f} %   (target < 5 %)\n",
             100 * th.next_ms / memcpy_ms);
  fmt::print("  consumer overhead / memcpy, process: {:5.2f} %   (target < 5 %)\n",
             100 * pr.next_ms / memcpy_ms);
  return 0;
}
