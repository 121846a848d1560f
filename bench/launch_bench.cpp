// bench/launch: start-to-exit time of N ranks per start method, beside the shell doing the same
// work (`sh -c '/bin/true & ... wait'`) in the same run; prints medians and ratios.
//
//   build/release/bin/launch_bench [--reps 30]
#include <fmt/format.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "forkguard/init.hpp"
#include "forkguard/launch/entry.hpp"
#include "forkguard/launch/launcher.hpp"
#include "launch/fork_server.hpp"  // private: to time one rank start on its own

namespace fl = forkguard::launch;
using Clock = std::chrono::steady_clock;

extern char** environ;

FORKGUARD_ENTRY(noop) {
  return 0;
}

namespace {

double median_ms(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename F>
double time_ms(int reps, F&& f) {
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto start = Clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  return median_ms(t);
}

void spawn_wait(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  if (posix_spawn(&pid, args[0], nullptr, nullptr, args.data(), environ) != 0) std::abort();
  int status;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fmt::print(stderr, "{} failed\n", argv[0]);
    std::exit(1);
  }
}

std::string shell_fanout(int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += "/bin/true & ";
  return s + "wait";
}

std::string self_dir() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  std::string p(buf, n > 0 ? static_cast<size_t>(n) : 0);
  return p.substr(0, p.rfind('/'));
}

}  // namespace

int main(int argc, char** argv) {
  forkguard::init(argc, argv);
  int reps = 30;
  if (argc == 3 && std::strcmp(argv[1], "--reps") == 0) reps = std::max(3, std::atoi(argv[2]));
  const std::string forkguard_cli = self_dir() + "/forkguard";

  fmt::print("start-to-exit, median of {} runs, ms (ratio to the shell doing the same)\n\n", reps);
  fmt::print("{:>3}  {:>9}  {:>16} {:>16} {:>16}  {:>16} {:>16} {:>16}\n", "N", "sh &/wait",
             "cmd spawn", "cmd forkserver", "cmd fork", "fn spawn", "fn forkserver", "fn fork");
  const fl::StartMethod methods[] = {fl::StartMethod::kSpawn, fl::StartMethod::kForkServer,
                                     fl::StartMethod::kFork};
  double fs_one_rank = 0;
  for (int n : {1, 2, 4, 8}) {
    double shell = time_ms(reps, [&] { spawn_wait({"/bin/sh", "-c", shell_fanout(n)}); });
    std::string row = fmt::format("{:>3}  {:>9.3f} ", n, shell);
    fl::Options o;
    o.nproc = n;
    o.quiet = true;
    for (auto m : methods) {
      o.start = m;
      double t = time_ms(reps, [&] { fl::run(o, {"/bin/true"}); });
      row += fmt::format(" {:>8.3f} ({:>4.2f}x)", t, t / shell);
    }
    row += " ";
    for (auto m : methods) {
      o.start = m;
      double t = time_ms(reps, [&] { fl::launch(o, "noop", {}); });
      if (n == 1 && m == fl::StartMethod::kForkServer) fs_one_rank = t;
      row += fmt::format(" {:>8.3f} ({:>4.2f}x)", t, t / shell);
    }
    fmt::print("{}\n", row);
  }

  fmt::print("\nwhole command, 2 ranks of /bin/true, median of {} runs:\n", reps);
  double sh2 = time_ms(reps, [&] { spawn_wait({"/bin/sh", "-c", shell_fanout(2)}); });
  double cli2 = time_ms(reps, [&] {
    spawn_wait({forkguard_cli, "run", "--quiet", "--nproc-per-node", "2", "--", "/bin/true"});
  });
  fmt::print("  sh -c '/bin/true & /bin/true & wait'           {:8.3f} ms\n", sh2);
  fmt::print(
      "  forkguard run --nproc-per-node 2 -- /bin/true  {:8.3f} ms  (+{:.3f} ms, {:.2f}x; target: "
      "within 3 ms)\n",
      cli2, cli2 - sh2, cli2 / sh2);
  fmt::print(
      "\nfork-server rank, start to exit of one no-op entry: {:.3f} ms (target: start under 1 "
      "ms)\n",
      fs_one_rank);

  // One fork-server rank start on its own: request sent to "started" reply (the zygote's
  // fork-safety check and fork included), then its exit report awaited outside the timing.
  if (auto* server = fl::detail::ForkServer::get()) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    std::vector<double> t;
    for (int i = 0; i < reps * 4; ++i) {
      auto start = Clock::now();
      pid_t pid = server->start_entry("noop", {}, env, 1, 2).pid();
      t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
      for (bool reaped = false; !reaped;) {
        pollfd p{server->fd(), POLLIN, 0};
        ::poll(&p, 1, 1000);
        for (auto [exited, status] : server->take_exits([&](pid_t q) { return q == pid; })) {
          reaped = reaped || exited == pid;
        }
      }
    }
    fmt::print("fork-server rank start (request to started), median of {}: {:.3f} ms\n", t.size(),
               median_ms(t));
  }

  // torchrun, the peer, on the same job, where Debian's PyTorch and the shared script are present.
  const char* script_env = std::getenv("FORKGUARD_TORCHRUN");
  std::string script =
      script_env != nullptr ? script_env : "../shared/bench-data/torchrun_py311.py";
  if (::access(script.c_str(), R_OK) == 0 && ::access("/usr/bin/python3", X_OK) == 0) {
    const int treps = 3;
    for (const char* interval : {"0.1", "5"}) {
      double t = time_ms(treps, [&] {
        spawn_wait({"/usr/bin/python3", script, "--nproc_per_node", "2", "--monitor_interval",
                    interval, "--no_python", "/bin/true"});
      });
      fmt::print(
          "torchrun --nproc-per-node 2 --monitor-interval {} --no-python /bin/true: {:.1f} ms "
          "(median of {}; forkguard run is {:.0f}x faster)\n",
          interval, t, treps, t / cli2);
    }
  } else {
    fmt::print("torchrun not measured: {} or /usr/bin/python3 missing (set FORKGUARD_TORCHRUN)\n",
               script);
  }
  return 0;
}
