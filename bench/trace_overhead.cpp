// What libforkguard_trace.so costs a program that never touches CUDA: start-up added, and the
// cost per fork(), each measured beside the bare program in the same run (interleaved rounds, so
// that machine noise hits both alike).
//
//   trace_overhead [--runs N] [--forks N] [--rounds N] [--library PATH] [--python]
//
// Start-up: posix_spawn to waitpid of a program that exits at once (this binary, re-executed),
// N times each, with and without LD_PRELOAD; medians and their difference. Per fork: the same
// program forks N children (each _exit(0)s at once, waited for), with and without the library;
// the median round of each. --python adds /usr/bin/python3 -c pass start-up.
#include <spawn.h>
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

// Runs argv to completion; returns the wall time in microseconds and its stdout (first line).
double run(const std::vector<std::string>& argv, const std::string& preload, std::string* out) {
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
  ::waitpid(pid, &status, 0);
  const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  ::close(fds[0]);
  posix_spawn_file_actions_destroy(&fa);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "trace_overhead: %s failed\n", a[0]);
    std::exit(1);
  }
  if (out != nullptr) *out = text;
  return us;
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
  std::vector<double> bare, traced;
  for (int i = 0; i < runs; ++i) {
    bare.push_back(run(argv, "", nullptr));
    traced.push_back(run(argv, library, nullptr));
  }
  const double b = median(bare), t = median(traced);
  std::printf(
      "start-up  %-28s bare %8.0f us   traced %8.0f us   added %+7.0f us  (x%.3f, "
      "median of %d each)\n",
      name, b, t, t - b, t / b, runs);
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
  std::vector<double> bare, traced;
  const std::string count = std::to_string(forks);
  for (int r = 0; r < rounds; ++r) {
    std::string out;
    run({self, "--child-forks", count}, "", &out);
    bare.push_back(std::atof(out.c_str()));
    run({self, "--child-forks", count}, library, &out);
    traced.push_back(std::atof(out.c_str()));
  }
  const double b = median(bare), t = median(traced);
  std::printf(
      "per fork  %-28s bare %8.1f us   traced %8.1f us   added %+7.1f us  (x%.3f, best "
      "of %d rounds of %d forks)\n",
      "(fork, child _exit, waitpid)", b, t, t - b, t / b, rounds, forks);
  return 0;
}
