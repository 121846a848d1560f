// What a probe costs, beside the cheapest thing that could be called a probe: reading
// /proc/self/maps once (the peer a hand-written "is libcuda mapped?" check would be).
// The ratio says how much the full evidence (fds, threads, kcmp, driver state) adds.
// Then the fast path at each guarded fork (self_if_fork_unsafe) as GNU OpenMP changes it, in
// this order (benchmarks run in registration order, and each stage changes this process): no
// libgomp; Debian's libgomp.so.1 dlopen()ed, no parallel region yet; a thread that keeps running
// beside it (the bounded re-reads); a live pool after one GOMP_parallel of 2 threads.
//
//   build/release/bin/probe_bench
#include <benchmark/benchmark.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>

#include "forkguard/probe/cuda_state.hpp"

static void BM_ReadProcSelfMaps(benchmark::State& state) {
  char buf[65536];
  for (auto _ : state) {
    int fd = ::open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    ssize_t total = 0, n = 0;
    while ((n = ::read(fd, buf, sizeof buf)) > 0) total += n;
    ::close(fd);
    benchmark::DoNotOptimize(total);
  }
}
BENCHMARK(BM_ReadProcSelfMaps);

static void BM_ProbeSelf(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(forkguard::probe::self());
}
BENCHMARK(BM_ProbeSelf);

static void BM_ProbeParent(benchmark::State& state) {
  pid_t parent = ::getppid();
  for (auto _ : state) benchmark::DoNotOptimize(forkguard::probe::pid(parent));
}
BENCHMARK(BM_ProbeParent);

namespace {

using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);

GompParallel libgomp() {
  static GompParallel parallel = [] {
    void* h = ::dlopen("libgomp.so.1", RTLD_NOW);
    return h ? reinterpret_cast<GompParallel>(::dlsym(h, "GOMP_parallel")) : nullptr;
  }();
  return parallel;
}

bool fast_path_is_safe() {
  return !forkguard::probe::self_if_fork_unsafe().has_value();
}

}  // namespace

static void BM_FastPathNoLibgomp(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(fast_path_is_safe());
}
BENCHMARK(BM_FastPathNoLibgomp);

static void BM_FastPathLibgompNoPool(benchmark::State& state) {
  if (libgomp() == nullptr) return state.SkipWithError("no libgomp.so.1");
  for (auto _ : state) benchmark::DoNotOptimize(fast_path_is_safe());
}
BENCHMARK(BM_FastPathLibgompNoPool);

// A thread that never blocks (a busy loop): with libgomp mapped, each check re-reads it 5 times,
// 2 ms apart, in case it is an OpenMP worker still spinning.
static void BM_FastPathLibgompBusyThread(benchmark::State& state) {
  if (libgomp() == nullptr) return state.SkipWithError("no libgomp.so.1");
  std::atomic<bool> stop{false};
  std::thread busy([&] {
    while (!stop.load(std::memory_order_relaxed)) {
    }
  });
  for (auto _ : state) benchmark::DoNotOptimize(fast_path_is_safe());
  stop = true;
  busy.join();
}
BENCHMARK(BM_FastPathLibgompBusyThread)->Iterations(50);

// From here on this process has a live pool: the fast path finds it, then probes in full.
static void BM_FastPathLivePool(benchmark::State& state) {
  auto parallel = libgomp();
  if (parallel == nullptr) return state.SkipWithError("no libgomp.so.1");
  std::atomic<int> ran{0};
  parallel([](void* d) { static_cast<std::atomic<int>*>(d)->fetch_add(1); }, &ran, 2, 0);
  for (auto _ : state) benchmark::DoNotOptimize(fast_path_is_safe());
  if (fast_path_is_safe()) state.SkipWithError("no pool seen");
}
BENCHMARK(BM_FastPathLivePool);

static void BM_ProbeSelfLivePool(benchmark::State& state) {
  if (libgomp() == nullptr) return state.SkipWithError("no libgomp.so.1");
  for (auto _ : state) benchmark::DoNotOptimize(forkguard::probe::self());
}
BENCHMARK(BM_ProbeSelfLivePool);

namespace {

// The console report, plus each benchmark's time kept for the ratios printed at the end.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  RatioReporter() : ConsoleReporter(::isatty(1) ? OO_Defaults : OO_Tabular) {}
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& r : runs) {
      if (r.run_type == Run::RT_Iteration) times[r.benchmark_name()] = r.GetAdjustedRealTime();
    }
    ConsoleReporter::ReportRuns(runs);
  }
  std::map<std::string, double> times;
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  const double peer = reporter.times["BM_ReadProcSelfMaps"];
  if (peer > 0) {
    for (const char* name : {"BM_ProbeSelf", "BM_ProbeParent", "BM_ProbeSelfLivePool"}) {
      if (reporter.times.count(name) != 0) {
        fmt::print("ratio {} / BM_ReadProcSelfMaps = {:.2f}\n", name, reporter.times[name] / peer);
      }
    }
  }
  return 0;
}
