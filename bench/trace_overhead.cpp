// What libforkguard_trace.so costs a program that never touches CUDA: start-up added, and the
// cost per fork(), each measured beside the bare program in the same run (interleaved rounds, so
// that machine noise hits both alike).
//
//   trace_overhead [--runs N] [--forks N] [--rounds N] [--library PATH] [--python]
//
// Start-up: posix_spawn to waitpid of a program that exits at once (this binary, re-executed),
// N times each, with and without LD_PRELOAD; medians and their difference. Per fork: the same
// program forks N children (each _exit(0)s at once, waited for), with and without the library;
// the median round of each. Wall time and CPU time (user + system, from wait4) are both
// printed: on a loaded machine the CPU time is the steadier figure. --python adds /usr/bin/python3
// -c pass start-up.
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::string> environment(const std::string& preload) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "LD_PRELOAD=", 11) != 0) env.emplace_back(*e);
  }
  if (!preload.empty()) env.push_back("LD_PRELOAD=" + preload);
  return env;
}

struct Times {
  double wall_us = 0;
  double cpu_us = 0;  // user + system time of the child: what it cost, whatever the machine's load
};

// Runs argv to completion; returns its wall and CPU time, and its stdout.
Times run(const std::vector<std::string>& argv, const std::string& preload, std::string* out) {
  auto args = argv;
  auto env = environment(preload);
  std::vector<char*> a, e;
  for (auto& s : args) a.push_back(s.data());
  a.push_back(nullptr);
  for (auto& s : env) e.push_back(s.data());
  e.push_back(nullptr);
  int fds[2];
  if (::pipe(fds) != 0) std::exit(1);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  const auto start = Clock::now();
  pid_t pid = -1;
  if (::posix_spawn(&pid, a[0], &fa, nullptr, a.data(), e.data()) != 0) {
    std::fprintf(stderr, "trace_overhead: cannot run %s\n", a[0]);
    std::exit(1);
  }
  ::close(fds[1]);
  std::string text;
  char buf[256];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) text.append(buf, size_t(n));
  int status = 0;
  rusage usage{};
  ::wait4(pid, &status, 0, &usage);
  Times t;
  t.wall_us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  t.cpu_us = (usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) * 1e6 + usage.ru_utime.tv_usec +
             usage.ru_stime.tv_usec;
  ::close(fds[0]);
  posix_spawn_file_actions_destroy(&fa);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "trace_overhead: %s failed\n", a[0]);
    std::exit(1);
  }
  if (out != nullptr) *out = text;
  return t;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The child: N forks, each child exiting at once; prints the mean microseconds per fork+wait.
int fork_loop(int n) {
  const auto start = Clock::now();
  for (int i = 0; i < n; ++i) {
    pid_t pid = ::fork();
    if (pid == 0) ::_exit(0);
    int status = 0;
    ::waitpid(pid, &status, 0);
  }
  const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  std::printf("%.3f\n", us / n);
  return 0;
}

void startup(const char* name, const std::vector<std::string>& argv, const std::string& library,
             int runs) {
  std::vector<double> bare, traced, bare_cpu, traced_cpu;
  for (int i = 0; i < runs; ++i) {
    const bool traced_first = i % 2 == 1;  // alternated: back-to-back runs are not alike
    const Times first = run(argv, traced_first ? library : "", nullptr);
    const Times second = run(argv, traced_first ? "" : library, nullptr);
    const Times& b = traced_first ? second : first;
    const Times& t = traced_first ? first : second;
    bare.push_back(b.wall_us);
    traced.push_back(t.wall_us);
    bare_cpu.push_back(b.cpu_us);
    traced_cpu.push_back(t.cpu_us);
  }
  const double b = median(bare), t = median(traced);
  const double bc = median(bare_cpu), tc = median(traced_cpu);
  std::printf("start-up  %-26s wall: bare %7.0f us  traced %7.0f us  added %+6.0f us (x%.3f)\n",
              name, b, t, t - b, t / b);
  std::printf(
      "          %-26s cpu:  bare %7.0f us  traced %7.0f us  added %+6.0f us (x%.3f)  "
      "[medians of %d runs each]\n",
      "", bc, tc, tc - bc, tc / bc, runs);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "--child-noop") == 0) return 0;
  if (argc >= 3 && std::strcmp(argv[1], "--child-forks") == 0) return fork_loop(std::atoi(argv[2]));
  int runs = 200, forks = 2000, rounds = 7;
  bool python = false;
  std::string library = FORKGUARD_TRACE_LIBRARY;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--runs" && i + 1 < argc)
      runs = std::atoi(argv[++i]);
    else if (a == "--forks" && i + 1 < argc)
      forks = std::atoi(argv[++i]);
    else if (a == "--rounds" && i + 1 < argc)
      rounds = std::atoi(argv[++i]);
    else if (a == "--library" && i + 1 < argc)
      library = argv[++i];
    else if (a == "--python")
      python = true;
    else {
      std::fprintf(stderr,
                   "usage: trace_overhead [--runs N] [--forks N] [--rounds N] [--library PATH] "
                   "[--python]\n");
      return 2;
    }
  }
  if (::access(library.c_str(), R_OK) != 0) {
    std::fprintf(stderr, "trace_overhead: no %s\n", library.c_str());
    return 1;
  }
  char self[4096];
  ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return 1;
  self[n] = '\0';
  std::printf("library: %s\n", library.c_str());
  startup("(a program that exits)", {self, "--child-noop"}, library, runs);
  if (python)
    startup("/usr/bin/python3 -c pass", {"/usr/bin/python3", "-c", "pass"}, library,
            std::max(20, runs / 5));
  std::vector<double> bare, traced, bare_cpu, traced_cpu;
  const std::string count = std::to_string(forks);
  for (int r = 0; r < rounds; ++r) {
    // Which goes first alternates: the second of two back-to-back runs is not the same machine.
    for (int k = 0; k < 2; ++k) {
      const bool with = (k == 0) == (r % 2 == 1);
      std::string out;
      const Times times = run({self, "--child-forks", count}, with ? library : "", &out);
      (with ? traced : bare).push_back(std::atof(out.c_str()));
      (with ? traced_cpu : bare_cpu).push_back(times.cpu_us / forks);
    }
  }
  const double b = median(bare), t = median(traced);
  const double bc = median(bare_cpu), tc = median(traced_cpu);
  std::printf("per fork  %-26s wall: bare %7.1f us  traced %7.1f us  added %+6.1f us (x%.3f)\n",
              "(fork, _exit, waitpid)", b, t, t - b, t / b);
  std::printf(
      "          %-26s cpu:  bare %7.1f us  traced %7.1f us  added %+6.1f us (x%.3f)  "
      "[medians of %d rounds of %d forks]\n",
      "(in the forking process)", bc, tc, tc - bc, tc / bc, rounds, forks);
  return 0;
}
