// What a probe costs, beside the cheapest thing that could be called a probe: reading
// /proc/self/maps once (the peer a hand-written "is libcuda mapped?" check would be).
// The ratio says how much the full evidence (fds, threads, kcmp, driver state) adds.
//
//   build/release/bin/probe_bench
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

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

BENCHMARK_MAIN();
