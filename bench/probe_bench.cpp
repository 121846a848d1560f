// What a probe costs, beside the cheapest thing that could be called a probe: reading
// /proc/self/maps once (the peer a hand-written "is libcuda mapped?" check would be).
// The ratio says how much the full evidence (fds, threads, kcmp, driver state) adds.
//
//   build/release/bin/probe_bench
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <map>
#include <string>

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
    for (const char* name : {"BM_ProbeSelf", "BM_ProbeParent"}) {
      if (reporter.times.count(name) != 0) {
        fmt::print("ratio {} / BM_ReadProcSelfMaps = {:.2f}\n", name, reporter.times[name] / peer);
      }
    }
  }
  return 0;
}
