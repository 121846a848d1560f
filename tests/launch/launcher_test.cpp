// The launcher's invariants in real processes, with the test driver as the GPU.
//
// This binary is its own rank program: main() calls forkguard::init(), so ranks started by
// spawn re-execute it and run the entries below; LAUNCHER_TEST_MODE turns it into a launcher
// for the tests that kill the launcher.
#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "forkguard/cuda/driver.hpp"
#include "forkguard/init.hpp"
#include "forkguard/launch/entry.hpp"
#include "forkguard/launch/launcher.hpp"
#include "launch/fork_server.hpp"
#include "paths.hpp"

namespace fl = forkguard::launch;
namespace cuda = forkguard::cuda;
namespace ft = forkguard::testing;
using namespace std::chrono_literals;

// ---------------------------------------------------------------- entries (run in ranks)

FORKGUARD_ENTRY(cuda_rank) {
  const auto& api = cuda::Driver::load().api();
  auto r = api.cuInit(0);
  if (r != cuda::CUDA_SUCCESS) {
    std::fprintf(stderr, "rank %d: cuInit: %s\n", ctx.rank, cuda::result_name(r).c_str());
    return 1;
  }
  cuda::CUcontext c = nullptr;
  r = api.cuDevicePrimaryCtxRetain(&c, 0);
  if (r != cuda::CUDA_SUCCESS) {
    std::fprintf(stderr, "rank %d: cuDevicePrimaryCtxRetain: %s\n", ctx.rank,
                 cuda::result_name(r).c_str());
    return 1;
  }
  std::printf("rank %d: cuda ok\n", ctx.rank);
  return 0;
}

FORKGUARD_ENTRY(print_context) {
  std::printf("rank=%d local=%d world=%d local_world=%d node=%d restart=%d args=%zu env_rank=%s\n",
              ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size, ctx.node_rank,
              ctx.restart_count, ctx.args.size(), std::getenv("RANK"));
  return 0;
}

// Rank 1 fails after two stderr lines; the others wait to be stopped.
FORKGUARD_ENTRY(rank1_fails) {
  if (ctx.rank == 1) {
    std::fprintf(stderr, "loading shard 1\nshard 1 is corrupt\n");
    return 3;
  }
  while (true) ::pause();
}

FORKGUARD_ENTRY(rank0_segfaults) {
  if (ctx.rank == 0) {
    rlimit none{0, 0};
    ::setrlimit(RLIMIT_CORE, &none);  // no core file in the build tree
    ::signal(SIGSEGV, SIG_DFL);       // a sanitizer's handler would turn it into an exit code
    ::raise(SIGSEGV);
  }
  while (true) ::pause();
}

// Rank 1 ignores SIGTERM and then opens SYNC_FIFO; rank 0 fails once that open has happened.
FORKGUARD_ENTRY(ignores_sigterm) {
  const char* fifo = std::getenv("SYNC_FIFO");
  if (ctx.rank == 0) {
    int fd = ::open(fifo, O_RDONLY);  // blocks until rank 1 opens it for writing
    ::close(fd);
    return 1;
  }
  ::signal(SIGTERM, SIG_IGN);
  int fd = ::open(fifo, O_WRONLY);
  while (true) ::pause();
  ::close(fd);
}

FORKGUARD_ENTRY(sleeps) {
  while (true) ::pause();
}

// Fails on the first two attempts, succeeds on the third.
FORKGUARD_ENTRY(flaky) {
  return ctx.restart_count < 2 && ctx.rank == 0 ? 5 : 0;
}

FORKGUARD_ENTRY(list_fds) {
  std::string fds;
  DIR* d = ::opendir("/proc/self/fd");
  int own = ::dirfd(d);
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.' && std::atoi(e->d_name) != own) fds += std::string(e->d_name) + " ";
  }
  ::closedir(d);
  std::printf("fds %s\n", fds.c_str());
  return 0;
}

// A zygote function (run in a fork of the fork server): reads an int from its fd; below 256 it is
// the exit code, above it 256 + a signal to die of (without a core file).
int exit_as_told(int fd) {
  int v = 0;
  if (::read(fd, &v, sizeof v) != static_cast<ssize_t>(sizeof v)) return 99;
  if (v < 256) return v;
  rlimit none{0, 0};
  ::setrlimit(RLIMIT_CORE, &none);
  ::signal(v - 256, SIG_DFL);  // a sanitizer's handler would turn it into an exit code
  ::raise(v - 256);
  return 98;
}
[[maybe_unused]] const bool g_exit_as_told =
    forkguard::launch::detail::register_zygote_function("test.exit_as_told", &exit_as_told);

// ---------------------------------------------------------------- helpers

namespace {

std::string self_exe() {
  return std::filesystem::read_symlink("/proc/self/exe").string();
}

// The fork server forkguard::init() started, known by its PID: its name ("forkguard-zygot") is set
// a moment after its fork, so a test that ends within milliseconds can still read the old one.
bool is_fork_server(pid_t pid) {
  const auto* server = forkguard::launch::detail::ForkServer::get();
  return server != nullptr && server->pid() == pid;
}

// A rank's reaper (launch/child.hpp, reap_tree), by the name it gives itself once the rank runs.
bool is_reaper(pid_t pid) {
  std::ifstream comm("/proc/" + std::to_string(pid) + "/comm");
  std::string name;
  std::getline(comm, name);
  return name == "fg-reaper";
}

class Launcher : public ::testing::Test {
 protected:
  void SetUp() override {
    ::setenv("FORKGUARD_CUDA_DRIVER", ft::kFakeCuda.c_str(), 1);
    ::setenv("FAKE_CUDA_DEV_DIR", (dir_.path() + "/dev").c_str(), 1);
    ::unsetenv("FAKE_CUDA_LOG");
    ::unsetenv("CUDA_VISIBLE_DEVICES");
    fds_before_ = ft::open_fds();
  }
  void TearDown() override {
    // No rank outlives a launch, and no fd is left open by one (the driver's, once loaded, stay).
    for (pid_t child : ft::children_of(::getpid())) {
      EXPECT_TRUE(is_fork_server(child))
          << "a child other than the fork server is left: PID " << child;
    }
    if (cuda::Driver::if_mapped() == nullptr) {
      EXPECT_EQ(ft::open_fds(), fds_before_);
    }
  }
  fl::Options quiet(int nproc, fl::StartMethod m) {
    fl::Options o;
    o.nproc = nproc;
    o.start = m;
    o.quiet = true;
    o.stop.grace = 5s;
    return o;
  }
  ft::TempDir dir_;
  std::vector<int> fds_before_;
};

#ifdef FORKGUARD_SANITIZED_BUILD
constexpr int kRounds = 10;  // sanitized processes take ~100 ms each to start
#else
constexpr int kRounds = 100;
#endif

void init_cuda_here() {
  const auto& drv = cuda::Driver::load();
  drv.check(drv.api().cuInit(0), "cuInit");
}

}  // namespace

// ---------------------------------------------------------------- clean parent

TEST_F(Launcher, TheForkServerIsNoChildAReapAllLoopWaitsFor) {
  // init() started the fork server; the program's own `while (wait(NULL) > 0)` ends at once (it
  // used to block on the fork server for ever), and the fork server still serves.
  const auto* server = forkguard::launch::detail::ForkServer::get();
  ASSERT_NE(server, nullptr);
  errno = 0;
  EXPECT_EQ(::wait(nullptr), -1);
  EXPECT_EQ(errno, ECHILD);
  EXPECT_TRUE(ft::is_alive(server->pid()));
  testing::internal::CaptureStdout();
  auto r = fl::launch(quiet(2, fl::StartMethod::kForkServer), "print_context", {});
  testing::internal::GetCapturedStdout();
  EXPECT_TRUE(r.success());
}

TEST_F(Launcher, AForkServerKilledUnderALaunchIsNamedAtOnceAndReplaced) {
  // Its ranks die with it (their reapers' parent-death signal); no exit report can come any
  // more. The launch ends at once naming the fork server and how it ended; the next launch gets
  // a new one.
  const pid_t zygote = forkguard::launch::detail::ForkServer::get()->pid();
  const auto* old_server = forkguard::launch::detail::ForkServer::get();
  const std::vector<int> old_fds = {old_server->fd(), old_server->pidfd()};
  std::thread killer([&] {
    // Once both ranks run under it (their reapers are its children).
    while (ft::children_of(zygote).size() < 2) std::this_thread::sleep_for(5ms);
    std::this_thread::sleep_for(50ms);
    ::kill(zygote, SIGKILL);
  });
  const auto t0 = std::chrono::steady_clock::now();
  fl::Result r;
  try {
    fl::launch(quiet(2, fl::StartMethod::kForkServer), "sleeps", {});
    ADD_FAILURE() << "ranks that died with their fork server must throw";
  } catch (const fl::RankFailedError& e) {
    r = e.result();
  }
  killer.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  ASSERT_GE(r.root_cause, 0);
  EXPECT_EQ(r.ranks[static_cast<size_t>(r.root_cause)].status.signal, SIGKILL);
  EXPECT_NE(r.report().find(fmt::format("the fork server (PID {}) ended (killed by signal 9 "
                                        "(SIGKILL)), and its ranks with it",
                                        zygote)),
            std::string::npos)
      << r.report();
  testing::internal::CaptureStderr();  // "started a new one"
  testing::internal::CaptureStdout();
  auto again = fl::launch(quiet(2, fl::StartMethod::kForkServer), "print_context", {});
  testing::internal::GetCapturedStdout();
  testing::internal::GetCapturedStderr();
  EXPECT_TRUE(again.success());
  EXPECT_NE(forkguard::launch::detail::ForkServer::get()->pid(), zygote);
  // The new fork server's socket and pidfd replace the old one's (TearDown compares the fds).
  const auto* new_server = forkguard::launch::detail::ForkServer::get();
  std::erase_if(fds_before_, [&](int fd) { return std::ranges::count(old_fds, fd) > 0; });
  fds_before_.push_back(new_server->fd());
  fds_before_.push_back(new_server->pidfd());
  std::sort(fds_before_.begin(), fds_before_.end());
}

TEST_F(Launcher, TheForkServerReportsEveryExitStatusExactly) {
  // Its children are reaped through their Child handles and reported as the wait status
  // waitpid() gives: every exit code, signals, and the core-dump flag, which a rank's reaper
  // reports on its program's behalf (the reaper itself dies without a core).
  namespace fd = forkguard::launch::detail;
  auto* server = fd::ForkServer::get();
  ASSERT_NE(server, nullptr);
  std::vector<std::pair<fd::ServerChild, int>> started;  // and the wait status expected
  for (int v = 0; v < 256 + SIGSYS + 1; ++v) {
    if (v >= 256 && v != 256 + SIGKILL && v != 256 + SIGTERM && v != 256 + SIGSEGV &&
        v != 256 + SIGABRT && v != 256 + SIGUSR1) {
      continue;
    }
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    auto c = server->start_call("test.exit_as_told", sv[1]);
    ::close(sv[1]);
    EXPECT_TRUE(c) << "no pidfd for a running child of the fork server";
    ASSERT_EQ(::write(sv[0], &v, sizeof v), static_cast<ssize_t>(sizeof v));
    ::close(sv[0]);
    started.emplace_back(std::move(c), v < 256 ? v << 8 : v - 256);
  }
  // A program that dumps core under its reaper (start_exec), against the same program run here.
  const std::string dumps =
      fmt::format("cd {} && ulimit -c unlimited && kill -SEGV $$", dir_.path());
  const pid_t here = ::fork();
  if (here == 0) {
    ::execl("/bin/sh", "sh", "-c", dumps.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int expected_core = 0;
  ASSERT_EQ(::waitpid(here, &expected_core, 0), here);
  ASSERT_TRUE(WIFSIGNALED(expected_core));
  if (!WCOREDUMP(expected_core)) std::printf("note: no core dump here (core_pattern)\n");
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  started.emplace_back(server->start_exec({"/bin/sh", "-c", dumps}, env, 1, 2), expected_core);
  started.emplace_back(server->start_exec({"/bin/sh", "-c", "exit 200"}, env, 1, 2), 200 << 8);
  for (auto& [c, expected] : started) {
    auto status = server->wait_exit(c.pid(), 30s);
    ASSERT_TRUE(status.has_value()) << "no exit report of PID " << c.pid();
    EXPECT_EQ(*status, expected) << "PID " << c.pid() << ": "
                                 << fl::ExitStatus::from_wait_status(*status).to_string()
                                 << ", expected "
                                 << fl::ExitStatus::from_wait_status(expected).to_string();
  }
  // Reported is reaped: the fork server is left with no child, zombie or not.
  EXPECT_EQ(ft::children_of(server->pid()), std::vector<pid_t>{});
}

TEST_F(Launcher, EveryStartMethodRunsEntriesWithTheirContext) {
  for (auto m : {fl::StartMethod::kSpawn, fl::StartMethod::kForkServer, fl::StartMethod::kFork}) {
    auto o = quiet(3, m);
    o.log.prefix = false;
    testing::internal::CaptureStdout();
    auto r = fl::launch(o, "print_context", {"a", "b"});
    std::string out = testing::internal::GetCapturedStdout();
    EXPECT_TRUE(r.success());
    EXPECT_EQ(r.method, m);
    for (int i = 0; i < 3; ++i) {
      auto want = fmt::format(
          "rank={} local={} world=3 local_world=3 node=0 restart=0 args=2 env_rank={}\n", i, i, i);
      EXPECT_NE(out.find(want), std::string::npos) << fl::to_string(m) << ": " << out;
    }
  }
}

TEST_F(Launcher, RanksInheritOnlyStdio) {
  for (auto m : {fl::StartMethod::kSpawn, fl::StartMethod::kForkServer, fl::StartMethod::kFork}) {
    auto o = quiet(2, m);
    o.log.prefix = false;
    testing::internal::CaptureStdout();
    fl::launch(o, "list_fds", {});
    std::string out = testing::internal::GetCapturedStdout();
    EXPECT_EQ(out, "fds 0 1 2 \nfds 0 1 2 \n") << fl::to_string(m);
  }
}

TEST_F(Launcher, FirstFailureStopsTheGroupAndIsTheRootCause) {
  for (auto m : {fl::StartMethod::kSpawn, fl::StartMethod::kForkServer, fl::StartMethod::kFork}) {
    auto start = std::chrono::steady_clock::now();
    try {
      testing::internal::CaptureStderr();
      fl::launch(quiet(4, m), "rank1_fails", {});
      testing::internal::GetCapturedStderr();
      FAIL() << "a failed rank must throw";
    } catch (const fl::RankFailedError& e) {
      std::string err = testing::internal::GetCapturedStderr();
      const auto& r = e.result();
      EXPECT_LT(std::chrono::steady_clock::now() - start, 4s) << "stopped within the grace period";
      EXPECT_EQ(r.root_cause, 1);
      EXPECT_EQ(r.exit_code(), 3);
      EXPECT_EQ(r.ranks[1].stderr_tail,
                (std::vector<std::string>{"loading shard 1", "shard 1 is corrupt"}));
      for (int i : {0, 2, 3}) {
        EXPECT_TRUE(r.ranks[static_cast<size_t>(i)].stopped_by_launcher);
        EXPECT_EQ(r.ranks[static_cast<size_t>(i)].status.signal, SIGTERM);
      }
      std::string what = e.what();
      EXPECT_EQ(what.rfind("rank 1 (local rank 1, PID ", 0), 0u) << what;
      EXPECT_NE(what.find("exited with code 3"), std::string::npos);
      EXPECT_NE(what.find("| shard 1 is corrupt"), std::string::npos) << what;
      EXPECT_NE(err.find("[rank1]:shard 1 is corrupt"), std::string::npos) << err;
    }
  }
}

TEST_F(Launcher, SegfaultIsReportedWithItsSignal) {
  try {
    fl::launch(quiet(2, fl::StartMethod::kForkServer), "rank0_segfaults", {});
    FAIL();
  } catch (const fl::RankFailedError& e) {
    EXPECT_EQ(e.result().root_cause, 0);
    EXPECT_EQ(e.result().exit_code(), 128 + SIGSEGV);
    EXPECT_NE(std::string(e.what()).find("killed by signal 11 (SIGSEGV)"), std::string::npos)
        << e.what();
  }
}

TEST_F(Launcher, RankIgnoringSigtermIsKilledAfterTheGrace) {
  auto o = quiet(2, fl::StartMethod::kSpawn);
  o.stop.grace = 300ms;
  o.env["SYNC_FIFO"] = dir_.path() + "/sync";
  ASSERT_EQ(::mkfifo(o.env["SYNC_FIFO"].c_str(), 0600), 0);
  auto start = std::chrono::steady_clock::now();
  try {
    fl::launch(o, "ignores_sigterm", {});
    FAIL();
  } catch (const fl::RankFailedError& e) {
    auto took = std::chrono::steady_clock::now() - start;
    EXPECT_GE(took, 300ms);
    EXPECT_LT(took, 3s);
    EXPECT_EQ(e.result().ranks[1].status.signal, SIGKILL);
  }
}

TEST_F(Launcher, GroupRestartsUpToMaxRestarts) {
  auto o = quiet(2, fl::StartMethod::kForkServer);
  o.max_restarts = 2;
  auto r = fl::launch(o, "flaky", {});
  EXPECT_TRUE(r.success());
  EXPECT_EQ(r.restarts, 2);
  o.max_restarts = 1;
  try {
    fl::launch(o, "flaky", {});
    FAIL() << "two failures with one restart allowed";
  } catch (const fl::RankFailedError& e) {
    EXPECT_EQ(e.result().restarts, 1);
    EXPECT_EQ(e.result().exit_code(), 5);
  }
}

TEST_F(Launcher, TimeoutStopsEveryRank) {
  auto o = quiet(2, fl::StartMethod::kForkServer);
  o.timeout = 200ms;
  try {
    fl::launch(o, "sleeps", {});
    FAIL();
  } catch (const fl::RankFailedError& e) {
    EXPECT_TRUE(e.result().timed_out);
    EXPECT_EQ(e.result().exit_code(), 124);
  }
}

TEST_F(Launcher, CommandsGetTorchrunsEnvironment) {
  auto o = quiet(2, fl::StartMethod::kSpawn);
  o.log.prefix = false;
  o.nodes.nnodes = 2;
  o.nodes.node_rank = 1;
  o.nodes.master_addr = "10.1.2.3";
  o.nodes.master_port = 4242;
  testing::internal::CaptureStdout();
  fl::run(o,
          {"sh", "-c",
           "echo $RANK $LOCAL_RANK $GROUP_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR "
           "$MASTER_PORT $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS $OMP_NUM_THREADS"});
  std::string out = testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("2 0 1 4 2 10.1.2.3 4242 0 0 1\n"), std::string::npos) << out;
  EXPECT_NE(out.find("3 1 1 4 2 10.1.2.3 4242 0 0 1\n"), std::string::npos) << out;
}

TEST_F(Launcher, MissingCommandIsASpawnErrorNamingIt) {
  try {
    fl::run(quiet(2, fl::StartMethod::kSpawn), {"/nonexistent/trainer"});
    FAIL();
  } catch (const fl::SpawnError& e) {
    EXPECT_STREQ(e.what(), "failed to execute /nonexistent/trainer: No such file or directory");
  }
  try {
    fl::run(quiet(2, fl::StartMethod::kForkServer), {"/nonexistent/trainer"});
    FAIL();
  } catch (const fl::SpawnError& e) {
    EXPECT_NE(std::string(e.what()).find("failed to execute /nonexistent/trainer"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(Launcher, UnknownEntryIsRefusedBeforeAnythingStarts) {
  try {
    fl::launch(quiet(2, fl::StartMethod::kSpawn), "no_such_entry", {});
    FAIL();
  } catch (const forkguard::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no entry function named \"no_such_entry\""),
              std::string::npos);
    EXPECT_NE(std::string(e.what()).find("cuda_rank"), std::string::npos) << "lists what exists";
  }
}

TEST_F(Launcher, LogDirGetsEveryRanksOutput) {
  auto o = quiet(2, fl::StartMethod::kSpawn);
  o.log.log_dir = dir_.path() + "/logs";
  o.log.console_ranks = {1};
  testing::internal::CaptureStdout();
  fl::run(o, {"sh", "-c", "echo out $RANK; echo err $RANK >&2"});
  std::string console = testing::internal::GetCapturedStdout();
  EXPECT_EQ(console, "[rank1]:out 1\n") << "only rank 1 on the console";
  EXPECT_EQ(ft::read_file(o.log.log_dir + "/attempt_0/rank0/stdout.log"), "out 0\n");
  EXPECT_EQ(ft::read_file(o.log.log_dir + "/attempt_0/rank1/stderr.log"), "err 1\n");
}

TEST_F(Launcher, ConsoleFilterTakesLocalRanksAsTorchrunDoes) {
  auto o = quiet(2, fl::StartMethod::kSpawn);
  o.nodes.nnodes = 2;
  o.nodes.node_rank = 1;
  o.log.console_ranks = {1};
  testing::internal::CaptureStdout();
  fl::run(o, {"sh", "-c", "echo $RANK"});
  EXPECT_EQ(testing::internal::GetCapturedStdout(), "[rank3]:3\n") << "local rank 1 of node 1";
}

TEST_F(Launcher, GuardedForkOfACleanProcessIsAllowed) {
  auto r = fl::launch(quiet(2, fl::StartMethod::kFork), "cuda_rank", {});
  EXPECT_TRUE(r.success());
  EXPECT_EQ(r.method, fl::StartMethod::kFork);
}

// ---------------------------------------------------------------- the launcher killed

// Re-runs this binary as a launcher of `sleeps` ranks, kills it with SIGKILL, and checks that no
// rank is alive one second later.
void expect_no_orphans(const std::string& method) {
  ft::TempDir dir;
  int out[2];
  ASSERT_EQ(::pipe(out), 0);
  pid_t launcher = ::fork();
  if (launcher == 0) {
    ::dup2(out[1], 1);
    ::setenv("LAUNCHER_TEST_MODE", method.c_str(), 1);
    std::string exe = self_exe();
    ::execl(exe.c_str(), exe.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(out[1]);
  // The launcher prints "ready PID PID PID" once its ranks run.
  std::string line;
  char c;
  while (::read(out[0], &c, 1) == 1 && c != '\n') line += c;
  ::close(out[0]);
  ASSERT_EQ(line.rfind("ready", 0), 0u) << line;
  std::vector<pid_t> ranks;
  std::istringstream in(line.substr(5));
  for (pid_t p; in >> p;) ranks.push_back(p);
  ASSERT_EQ(ranks.size(), 3u);
  ::kill(launcher, SIGKILL);
  ::waitpid(launcher, nullptr, 0);
  auto deadline = std::chrono::steady_clock::now() + 1s;
  bool any = true;
  while (any && std::chrono::steady_clock::now() < deadline) {
    any = std::any_of(ranks.begin(), ranks.end(), ft::is_alive);
    if (any) std::this_thread::sleep_for(10ms);
  }
  for (pid_t p : ranks)
    EXPECT_FALSE(ft::is_alive(p)) << method << ": rank PID " << p << " survived";
}

TEST(LauncherKilled, NoRankSurvivesSigkillOfTheLauncherSpawn) {
  expect_no_orphans("spawn");
}
TEST(LauncherKilled, NoRankSurvivesSigkillOfTheLauncherForkServer) {
  expect_no_orphans("forkserver");
}
TEST(LauncherKilled, NoRankSurvivesSigkillOfTheLauncherFork) {
  expect_no_orphans("fork");
}

// ---------------------------------------------------------------- dirty parent (keep these last:
// they initialize CUDA in this test process)

TEST_F(Launcher, AfterTheParentInitializedCudaManyLaunchesOf4Ranks) {
  init_cuda_here();
  for (auto m : {fl::StartMethod::kSpawn, fl::StartMethod::kForkServer}) {
    int ok = 0;
    auto o = quiet(4, m);
    o.log.prefix = false;
    for (int i = 0; i < kRounds; ++i) {
      testing::internal::CaptureStdout();
      auto r = fl::launch(o, "cuda_rank", {});
      std::string out = testing::internal::GetCapturedStdout();
      for (int k = 0; k < 4; ++k) {
        ok += out.find(fmt::format("rank {}: cuda ok\n", k)) != std::string::npos;
      }
      ASSERT_TRUE(r.success());
    }
    EXPECT_EQ(ok, 4 * kRounds) << fl::to_string(m) << ": every rank's cuInit succeeds";
  }
}

TEST_F(Launcher, GuardedForkAfterInitIsRefusedBeforeAnyChildExists) {
  init_cuda_here();
  for (int i = 0; i < kRounds; ++i) {
    auto before = ft::children_of(::getpid());
    try {
      fl::launch(quiet(4, fl::StartMethod::kFork), "cuda_rank", {});
      FAIL() << "a dirty fork must be refused";
    } catch (const fl::DirtyForkError& e) {
      EXPECT_EQ(ft::children_of(::getpid()), before) << "no child was created";
      std::string what = e.what();
      EXPECT_NE(what.find("refusing to fork 4 ranks"), std::string::npos) << what;
      EXPECT_NE(what.find("is initialized"), std::string::npos) << what;
      EXPECT_NE(what.find("nvidia-uvm"), std::string::npos) << what;
      EXPECT_NE(what.find("cuda-EvtHandlr"), std::string::npos) << what;
      EXPECT_NE(what.find("spawn"), std::string::npos) << what;
      EXPECT_EQ(e.state().verdict, forkguard::probe::Verdict::kInitialized);
    }
  }
}

TEST_F(Launcher, AutoAfterInitUsesTheForkServerAndSaysSo) {
  init_cuda_here();
  auto o = quiet(4, fl::StartMethod::kAuto);
  o.quiet = false;
  o.log.prefix = false;
  testing::internal::CaptureStderr();
  testing::internal::CaptureStdout();
  auto r = fl::launch(o, "cuda_rank", {});
  std::string out = testing::internal::GetCapturedStdout();
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(r.success());
  EXPECT_EQ(r.method, fl::StartMethod::kForkServer);
  EXPECT_NE(err.find("start method auto: forkserver (this process is initialized"),
            std::string::npos)
      << err;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 4) << out;
}

TEST_F(Launcher, FallBackPolicyTurnsADirtyForkIntoTheForkServer) {
  init_cuda_here();
  auto o = quiet(2, fl::StartMethod::kFork);
  o.dirty_parent = fl::DirtyParent::kFallBack;
  o.log.prefix = false;
  testing::internal::CaptureStdout();
  auto r = fl::launch(o, "cuda_rank", {});
  testing::internal::GetCapturedStdout();
  EXPECT_EQ(r.method, fl::StartMethod::kForkServer);
}

TEST_F(Launcher, AChildForkedAfterInitReallyFails) {
  // The failure the launcher prevents, shown directly: a plain fork's cuInit fails.
  init_cuda_here();
  pid_t child = ::fork();
  if (child == 0)
    ::_exit(cuda::Driver::load().api().cuInit(0) == cuda::CUDA_ERROR_NOT_INITIALIZED ? 0 : 1);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

// ---------------------------------------------------------------- main

int main(int argc, char** argv) {
  forkguard::init(argc, argv);  // spawned ranks run their entry here and exit
  if (const char* mode = std::getenv("LAUNCHER_TEST_MODE")) {
    // The launcher of expect_no_orphans(): starts 3 `sleeps` ranks, prints their PIDs, waits.
    ::unsetenv("LAUNCHER_TEST_MODE");
    auto m = fl::parse_start_method(mode);
    std::thread reporter([] {
      for (int i = 0; i < 500; ++i) {
        // Each rank is its reaper's child; the reapers are ours, or the zygote's.
        std::vector<pid_t> reapers, ranks;
        for (pid_t c : ft::children_of(::getpid())) {
          if (is_reaper(c)) reapers.push_back(c);
          if (is_fork_server(c)) {
            for (pid_t r : ft::children_of(c)) {
              if (is_reaper(r)) reapers.push_back(r);
            }
          }
        }
        for (pid_t r : reapers) {
          for (pid_t c : ft::children_of(r)) ranks.push_back(c);
        }
        if (ranks.size() == 3) {
          std::string line = "ready";
          for (pid_t p : ranks) line += " " + std::to_string(p);
          line += "\n";
          if (::write(1, line.data(), line.size()) < 0) std::_Exit(1);
          return;
        }
        std::this_thread::sleep_for(10ms);
      }
    });
    reporter.detach();
    fl::Options o;
    o.nproc = 3;
    o.start = *m;
    o.quiet = true;
    fl::launch(o, "sleeps", {});
    return 1;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
