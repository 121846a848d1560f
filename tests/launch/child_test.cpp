// launch/child: the fd plan (pure, no fork), and real children started by start_child: the error
// pipe, the stop policy, the reaper that takes a rank's whole tree with it, no fd or zombie left.
#include "launch/child.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "forkguard/launch/launcher.hpp"
#include "paths.hpp"
#include "process.hpp"

namespace fl = forkguard::launch;
namespace fd = forkguard::launch::detail;
namespace ft = forkguard::testing;
using namespace std::chrono_literals;

namespace {

// Runs a plan on a table of "fds" (number -> the file it holds) the way the kernel would.
std::map<int, int> simulate(std::map<int, int> fds, const std::vector<fd::FdStep>& steps) {
  for (const auto& s : steps) {
    switch (s.op) {
      case fd::FdStep::Op::kDup:
        EXPECT_TRUE(fds.count(s.a)) << "dup of a closed fd " << s.a;
        EXPECT_NE(s.a, s.b);
        fds[s.b] = fds[s.a];
        break;
      case fd::FdStep::Op::kSetFlags: EXPECT_TRUE(fds.count(s.a)); break;
      case fd::FdStep::Op::kCloseRange:
        for (auto it = fds.begin(); it != fds.end();) {
          it = it->first >= s.a && (s.b < 0 || it->first <= s.b) ? fds.erase(it) : std::next(it);
        }
        break;
    }
  }
  return fds;
}

// Each fd in `open` holds "file" fd*100; the plan must leave target -> from's file.
void expect_plan(std::vector<fd::FdMapping> m, std::vector<int> open, bool close_others) {
  std::map<int, int> fds;
  for (int f : open) fds[f] = f * 100;
  std::map<int, int> want;
  for (const auto& x : m) want[x.to] = x.from * 100;
  auto got = simulate(fds, fd::plan_fds(m, close_others));
  for (const auto& [to, file] : want) EXPECT_EQ(got[to], file) << "fd " << to;
  if (close_others) {
    for (const auto& [f, file] : got) {
      EXPECT_TRUE(f < 3 || want.count(f)) << "fd " << f << " left open";
    }
  }
}

std::string comm_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/comm");
  std::string s;
  std::getline(in, s);
  return s;
}

void wait_until_gone(const std::vector<pid_t>& pids, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline &&
         std::any_of(pids.begin(), pids.end(), ft::is_alive)) {
    std::this_thread::sleep_for(5ms);
  }
}

class Child : public ::testing::Test {
 protected:
  void SetUp() override { fds_before_ = ft::open_fds(); }
  void TearDown() override {
    EXPECT_EQ(ft::open_fds(), fds_before_) << "an fd leaked";
    EXPECT_TRUE(ft::children_of(::getpid()).empty()) << "a child (or zombie) is left";
  }
  std::vector<int> fds_before_;
};

fd::PreparedExec sh(const std::string& script) {
  return fd::prepare_exec({"/bin/sh", "-c", script}, fl::current_environment());
}

// A pipe whose read end is ours and whose write end goes to the child as its stdout.
struct Pipe {
  fd::UniqueFd r, w;
  Pipe() {
    int p[2];
    EXPECT_EQ(::pipe2(p, O_CLOEXEC), 0);
    r.reset(p[0]);
    w.reset(p[1]);
  }
  std::string line() {
    std::string s;
    char c;
    while (::read(r.get(), &c, 1) == 1 && c != '\n') s += c;
    return s;
  }
};

}  // namespace

// ---------------------------------------------------------------- the fd plan

TEST(FdPlan, PlainMovesAndTheRestClosed) {
  expect_plan({{7, 1}, {8, 2}, {9, 3}}, {0, 1, 2, 5, 7, 8, 9, 12}, true);
}

TEST(FdPlan, AFdAlreadyInPlaceOnlyHasItsFlagSet) {
  auto steps = fd::plan_fds({{4, 4, false}}, false);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].op, fd::FdStep::Op::kSetFlags);
  EXPECT_FALSE(steps[0].cloexec);
}

TEST(FdPlan, OverlapsWaitForTheirSourceToBeRead) {
  // 3 -> 4 must read 3 before 5 -> 3 overwrites it; 4 -> 5 before 3 -> 4.
  expect_plan({{3, 4}, {5, 3}, {4, 5}}, {3, 4, 5}, true);
  expect_plan({{1, 3}, {3, 1}}, {1, 3}, true);  // stdout and 3 swapped
}

TEST(FdPlan, CyclesGoThroughAFdAboveEveryOneNamed) {
  expect_plan({{5, 6}, {6, 5}}, {5, 6}, true);
  expect_plan({{3, 4}, {4, 5}, {5, 3}}, {3, 4, 5}, false);
  auto steps = fd::plan_fds({{5, 6}, {6, 5}}, false);
  EXPECT_EQ(steps.front().b, 7) << "the temporary fd";
}

TEST(FdPlan, OneSourceToSeveralTargets) {
  expect_plan({{9, 1}, {9, 2}, {1, 9}}, {1, 9}, true);
}

TEST(FdPlan, BadMappingsAreRefusedBeforeAnyFork) {
  EXPECT_THROW(fd::plan_fds({{3, 1}, {4, 1}}, true), forkguard::Error);
  EXPECT_THROW(fd::plan_fds({{-1, 1}}, true), forkguard::Error);
}

// ---------------------------------------------------------------- real children

TEST_F(Child, ExecFailureReportsTheErrnoThroughThePipe) {
  auto missing = fd::prepare_exec({"/nonexistent/program"}, fl::current_environment());
  try {
    fd::start_child({.exec = &missing});
    FAIL() << "a missing program must throw";
  } catch (const fl::SpawnError& e) {
    EXPECT_EQ(e.exit_code(), 127);
    EXPECT_STREQ(e.what(), "failed to execute /nonexistent/program: No such file or directory");
  }
  auto dir = fd::prepare_exec({"/tmp"}, fl::current_environment());
  for (bool reaper : {false, true}) {
    try {
      fd::start_child({.exec = &dir, .reap_tree = reaper});
      FAIL() << "a directory must throw";
    } catch (const fl::SpawnError& e) {
      EXPECT_EQ(e.exit_code(), 126) << reaper;
      EXPECT_STREQ(e.what(), "failed to execute /tmp: Permission denied") << reaper;
    }
  }
}

TEST_F(Child, OnlyStdioAndTheKeptFdsReachTheChild) {
  Pipe out;
  int extra = ::open("/dev/null", O_RDONLY);  // not close-on-exec: close_range must get it
  auto exec = sh("ls /proc/self/fd | sort -n | tr '\\n' ' '; echo");
  auto c = fd::start_child({.exec = &exec, .stdout_fd = out.w.get()});
  out.w.reset();
  EXPECT_EQ(out.line(), "0 1 2 3 ");  // 3: ls's own directory
  EXPECT_TRUE(c.wait().success());
  ::close(extra);
}

TEST_F(Child, AMainFunctionRunsWithItsFdAtTheNumberAsked) {
  Pipe out;
  auto c = fd::start_child({.main =
                                [] {
                                  const char msg[] = "from fd 7\n";
                                  return ::write(7, msg, sizeof msg - 1) > 0 ? 4 : 1;
                                },
                            .keep_fds = {{out.w.get(), 7, false}}});
  out.w.reset();
  EXPECT_EQ(out.line(), "from fd 7");
  auto s = c.wait();
  EXPECT_EQ(s.kind, fl::ExitStatus::Kind::kExited);
  EXPECT_EQ(s.code, 4);
}

TEST_F(Child, StopPolicyTerminatesThenKills) {
  Pipe out;
  // Ignores SIGTERM: the grace runs out and SIGKILL follows.
  auto deaf = sh("trap '' TERM; echo ready; while :; do sleep 0.05; done");
  auto c = fd::start_child(
      {.exec = &deaf, .stdout_fd = out.w.get(), .stop = {.signal = SIGTERM, .grace = 200ms}});
  out.w.reset();
  ASSERT_EQ(out.line(), "ready");
  auto t0 = std::chrono::steady_clock::now();
  auto s = c.stop();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 200ms);
  EXPECT_EQ(s.signal, SIGKILL) << s.to_string();
  // One that stops at SIGTERM is not killed.
  Pipe out2;
  auto polite = sh("trap 'exit 3' TERM; echo ready; while :; do sleep 0.05; done");
  auto p = fd::start_child({.exec = &polite, .stdout_fd = out2.w.get()});
  out2.w.reset();
  ASSERT_EQ(out2.line(), "ready");
  EXPECT_EQ(p.stop().code, 3);
}

TEST_F(Child, ARunningChildIsStoppedAndReapedByItsDestructor) {
  pid_t pid;
  {
    auto exec = sh("exec sleep 60");
    auto c = fd::start_child({.exec = &exec, .stop = {.signal = SIGTERM, .grace = 5s}});
    pid = c.pid();
    EXPECT_TRUE(ft::is_alive(pid));
  }
  EXPECT_FALSE(ft::is_alive(pid));
}

TEST_F(Child, AForksCopyOfTheHandleLeavesTheChildAlone) {
  // A process forked after the children started holds copies of their handles (a Python object,
  // a member of something the fork copied). Replacing or destroying such a copy neither signals
  // the child (its pidfd still names it there) nor waits for it: only the parent stops it.
  auto exec = sh("exec sleep 60");
  auto a = fd::start_child({.exec = &exec, .stop = {.signal = SIGTERM, .grace = 5s}});
  auto b = fd::start_child({.exec = &exec, .stop = {.signal = SIGTERM, .grace = 5s}});
  const pid_t a_pid = a.pid(), b_pid = b.pid();
  const pid_t copy = ::fork();
  if (copy == 0) {
    a = fd::Child();                    // replaced
    { fd::Child gone = std::move(b); }  // destroyed
    ::_exit(ft::is_alive(a_pid) && ft::is_alive(b_pid) ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(copy, &status, 0), copy);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  for (auto* c : {&a, &b}) {
    EXPECT_FALSE(c->try_wait().has_value()) << "the fork's copy stopped PID " << c->pid();
    EXPECT_EQ(c->stop().signal, SIGTERM);
  }
}

TEST_F(Child, TheReaperMirrorsTheProgramsExit) {
  for (auto [script, code, sig] :
       {std::tuple{"exit 7", 7, 0}, {"kill -USR1 $$", 0, SIGUSR1}, {"kill -SEGV $$", 0, SIGSEGV}}) {
    auto exec = sh(script);
    auto s = fd::start_child({.exec = &exec, .reap_tree = true}).wait();
    if (sig == 0) {
      EXPECT_EQ(s.kind, fl::ExitStatus::Kind::kExited) << script;
      EXPECT_EQ(s.code, code) << script;
    } else {
      EXPECT_EQ(s.kind, fl::ExitStatus::Kind::kSignaled) << script;
      EXPECT_EQ(s.signal, sig) << script;
    }
  }
}

TEST_F(Child, TheReaperTakesTheWholeTreeWithTheProgramSetsidToo) {
  Pipe out;
  // The program starts a plain child and one in its own session, prints their PIDs and exits.
  auto exec = sh("sleep 60 & a=$!; setsid sleep 60 & echo $$ $a $!; exit 5");
  auto c = fd::start_child({.exec = &exec, .stdout_fd = out.w.get(), .reap_tree = true});
  out.w.reset();
  EXPECT_EQ(comm_of(c.pid()), "fg-reaper");
  std::istringstream in(out.line());
  std::vector<pid_t> tree;
  for (pid_t p; in >> p;) tree.push_back(p);
  ASSERT_GE(tree.size(), 3u);
  auto s = c.wait();
  EXPECT_EQ(s.code, 5) << s.to_string();
  for (pid_t p : tree) EXPECT_FALSE(ft::is_alive(p)) << p << " outlived its program";
}

TEST_F(Child, SignalsToAReaperInOurGroupReachTheProgram) {
  Pipe out;
  auto exec = sh("trap 'echo got TERM; exit 0' TERM; echo ready; while :; do sleep 0.02; done");
  auto c = fd::start_child({.exec = &exec,
                            .stdout_fd = out.w.get(),
                            .group = fd::ProcessGroup::kInherit,
                            .reap_tree = true});
  out.w.reset();
  ASSERT_EQ(out.line(), "ready");
  c.signal(SIGTERM);
  EXPECT_EQ(out.line(), "got TERM");
  EXPECT_TRUE(c.wait().success());
}

TEST_F(Child, WhenItsParentDiesTheReaperKillsTheTree) {
  // A middle process starts a reaped program with a setsid grandchild, then is SIGKILLed.
  Pipe out;
  pid_t middle = ::fork();
  if (middle == 0) {
    auto exec = sh("setsid sleep 60 & echo $$ $!; exec sleep 60");
    auto c = fd::start_child({.exec = &exec, .stdout_fd = out.w.get(), .reap_tree = true});
    ::pause();
    ::_exit(0);
  }
  out.w.reset();
  std::istringstream in(out.line());
  std::vector<pid_t> tree;
  for (pid_t p; in >> p;) tree.push_back(p);
  ASSERT_EQ(tree.size(), 2u);
  ::kill(middle, SIGKILL);
  ::waitpid(middle, nullptr, 0);
  wait_until_gone(tree, 1s);
  for (pid_t p : tree) {
    EXPECT_FALSE(ft::is_alive(p)) << p << " outlived the reaper's parent";
    if (ft::is_alive(p)) ::kill(p, SIGKILL);
  }
}

TEST_F(Child, AChildOfTheMainThreadDiesWithItsParent) {
  Pipe out;
  pid_t middle = ::fork();  // its one thread is its main thread
  if (middle == 0) {
    auto exec = sh("echo $$; exec sleep 60");
    auto c = fd::start_child({.exec = &exec, .stdout_fd = out.w.get()});
    ::pause();
    ::_exit(0);
  }
  out.w.reset();
  const pid_t child = std::stoi(out.line());
  ::kill(middle, SIGKILL);
  ::waitpid(middle, nullptr, 0);
  wait_until_gone({child}, 1s);
  EXPECT_FALSE(ft::is_alive(child)) << "the parent-death signal was not armed";
  if (ft::is_alive(child)) ::kill(child, SIGKILL);
}

TEST_F(Child, AChildOutlivesTheThreadThatStartedIt) {
  // The kernel sends the parent-death signal when the forking thread ends: a child started by
  // another thread (persistent DataLoader workers of an iterator made in a thread) must not be
  // killed with that thread. It was (killed by SIGKILL as the thread returned).
  fd::Child c;
  std::thread([&] {
    auto exec = sh("exec sleep 60");
    c = fd::start_child({.exec = &exec, .stop = {.signal = SIGKILL}});
  }).join();
  std::this_thread::sleep_for(200ms);
  ASSERT_TRUE(ft::is_alive(c.pid())) << "killed when the thread that started it ended";
  EXPECT_EQ(c.stop().signal, SIGKILL);  // stopped by us, not by the thread's end
}

TEST_F(Child, ANotWaitableChildIsNoChildAWaitForAnyFinds) {
  // A program's reap-all loop (`while (wait(NULL) > 0)`, Python's os.wait() until
  // ChildProcessError) ends at once with it running, and cannot take its exit status: only its
  // handle reaps it, with the real status. In a single-threaded copy of this test.
  constexpr int kSanitizerThread = 77;
  pid_t forked = ::fork();
  if (forked == 0) {
    int go[2];
    if (::pipe(go) != 0) ::_exit(2);
    auto m = fd::start_child({.main =
                                  [&] {
                                    char c;
                                    return ::read(go[0], &c, 1) == 1 ? 5 : 1;
                                  },
                              .keep_fds = {{go[0], go[0], false}},
                              .waitable = false});
    errno = 0;
    const pid_t any = ::waitpid(-1, nullptr, WNOHANG);  // 0: a waitable child runs
    const bool hidden = any == -1 && errno == ECHILD;
    const bool alive = ft::is_alive(m.pid());
    if (::write(go[1], "x", 1) != 1) ::_exit(3);
    const auto s = m.wait();
    // ThreadSanitizer restarts its background thread in a fork: then it is an ordinary child.
    if (m.waitable() && any == 0 && s.code == 5) ::_exit(kSanitizerThread);
    ::_exit(!m.waitable() && hidden && alive && s.code == 5 ? 0 : 1);
  }
  int st = 0;
  ASSERT_EQ(::waitpid(forked, &st, 0), forked);
  if (WIFEXITED(st) && WEXITSTATUS(st) == kSanitizerThread) {
    GTEST_SKIP() << "the fork of this test has a second thread (a sanitizer's)";
  }
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "status " << st;

  // An exec gives any process SIGCHLD as its exit signal again: an exec'd child is waitable.
  auto exec = sh("exit 4");
  auto c = fd::start_child({.exec = &exec, .waitable = false});
  EXPECT_TRUE(c.waitable());
  EXPECT_EQ(c.wait().code, 4);
}

TEST_F(Child, AMainFunctionOfAThreadedParentIsAnOrdinaryChild) {
  // A raw clone runs none of glibc's fork handlers: with another thread running (which may hold
  // malloc's lock), a main function is forked as usual, and is waitable.
  std::atomic<bool> stop{false};
  std::thread t([&] {
    while (!stop) std::this_thread::sleep_for(1ms);
  });
  auto m = fd::start_child({.main = [] { return 6; }, .waitable = false});
  stop = true;
  t.join();
  EXPECT_TRUE(m.waitable());
  EXPECT_EQ(m.wait().code, 6);
}
