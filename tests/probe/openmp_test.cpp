// Fork hazards beyond CUDA: GNU OpenMP's thread pool (tests/helpers/openmp_pool.cpp runs parallel
// regions through Debian's libgomp.so.1, a stand-in for torch's CPU ops) and other live threads,
// seen from inside (probe::self, the fast path) and from outside (probe::pid).
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <sstream>
#include <string>
#include <thread>

#include "forkguard/probe/cuda_state.hpp"
#include "paths.hpp"

namespace probe = forkguard::probe;
namespace ft = forkguard::testing;

namespace {

const std::string kOpenMpPool = FORKGUARD_HELPER_DIR "/openmp_pool";

std::string verdict_of(const std::string& reply) {
  std::istringstream in(reply);
  std::string word, verdict;
  in >> word >> verdict;
  return verdict;
}

std::string details(const probe::CudaState& s, probe::EvidenceKind kind) {
  std::string out;
  for (const auto& e : s.evidence) {
    if (e.kind == kind) out += e.detail + "\n";
  }
  return out;
}

bool have_libgomp() {
  void* h = ::dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (h != nullptr) return true;
  return ::access("/usr/lib/x86_64-linux-gnu/libgomp.so.1", R_OK) == 0 ||
         ::access("/usr/lib/aarch64-linux-gnu/libgomp.so.1", R_OK) == 0;
}

class OpenMp : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_libgomp()) GTEST_SKIP() << "no libgomp.so.1 here (Debian's libgomp1)";
  }
};

}  // namespace

TEST_F(OpenMp, ALivePoolSeenFromOutsideIsNotForkSafe) {
  ft::Interactive h({kOpenMpPool});
  ASSERT_EQ(h.ask("parallel 2"), "ran 2");
  auto s = probe::pid(h.pid());
  EXPECT_EQ(s.verdict, probe::Verdict::kOpenMpPool) << details(s, probe::EvidenceKind::kLiveThread);
  EXPECT_EQ(probe::to_string(s.verdict), "openmp_pool");
  EXPECT_FALSE(s.fork_safe);
  const auto pool = details(s, probe::EvidenceKind::kOpenMpPool);
  EXPECT_NE(pool.find("1 GNU OpenMP worker thread (TID "), std::string::npos) << pool;
  EXPECT_NE(pool.find("blocked in /"), std::string::npos) << pool;  // the mapped file's path
  EXPECT_NE(pool.find("libgomp.so.1"), std::string::npos) << pool;
  EXPECT_NE(pool.find(": a child fork()ed from here hangs at its first parallel region"),
            std::string::npos)
      << pool;
  // Other threads may be live (a sanitizer's background thread), but not the pool's workers.
  const auto live = details(s, probe::EvidenceKind::kLiveThread);
  EXPECT_EQ(live.find("libgomp"), std::string::npos) << "the pool's workers are not listed twice";
  EXPECT_TRUE(s.unseen_hazards.empty());
  // The same from inside: the full probe and the fast path at each guarded fork.
  EXPECT_EQ(verdict_of(h.ask("probe")), "openmp_pool");
  EXPECT_EQ(h.ask("fast"), "fast openmp_pool");
}

TEST_F(OpenMp, LibgompLoadedWithoutAParallelRegionIsForkSafe) {
  ft::Interactive h({kOpenMpPool});
  ASSERT_EQ(h.ask("load"), "ok");
  auto s = probe::pid(h.pid());
  EXPECT_EQ(s.verdict, probe::Verdict::kClean);
  EXPECT_TRUE(s.fork_safe);
  EXPECT_FALSE(s.has(probe::EvidenceKind::kOpenMpPool));
  EXPECT_TRUE(s.unseen_hazards.empty());
  EXPECT_EQ(verdict_of(h.ask("probe")), "clean");
  EXPECT_EQ(h.ask("fast"), "fast safe");
}

// One thread runs the region: libgomp starts no worker, so there is no pool (torch with
// OMP_NUM_THREADS=1, Debian's torch 1.13 on this machine).
TEST_F(OpenMp, ARegionOfOneThreadLeavesNoPool) {
  ft::Interactive h({kOpenMpPool});
  ASSERT_EQ(h.ask("parallel 1"), "ran 1");
  EXPECT_TRUE(probe::pid(h.pid()).fork_safe);
  EXPECT_EQ(h.ask("fast"), "fast safe");
}

// OMP_WAIT_POLICY=active: the workers never block, so no PC can be read; running threads with
// libgomp mapped under that policy are taken for the pool.
TEST_F(OpenMp, WorkersSpinningForEverAreAPool) {
  ft::Interactive h({kOpenMpPool}, {{"OMP_WAIT_POLICY", "active"}});
  ASSERT_EQ(h.ask("parallel 2"), "ran 2");
  auto s = probe::pid(h.pid());
  EXPECT_EQ(s.verdict, probe::Verdict::kOpenMpPool);
  EXPECT_FALSE(s.fork_safe);
  const auto pool = details(s, probe::EvidenceKind::kOpenMpPool);
  EXPECT_NE(pool.find("running"), std::string::npos) << pool;
  EXPECT_NE(pool.find("OMP_WAIT_POLICY=active"), std::string::npos) << pool;
  EXPECT_NE(details(s, probe::EvidenceKind::kEnvironment).find("OMP_WAIT_POLICY=active"),
            std::string::npos);
  EXPECT_EQ(h.ask("fast"), "fast openmp_pool");
}

// The test process stays clean: libgomp is loaded and run in a forked child, which reports.
TEST_F(OpenMp, SelfProbeSeesItsOwnPool) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t child = ::fork();
  if (child == 0) {
    ::close(fds[0]);
    std::string out = "no libgomp";
    if (void* gomp = ::dlopen("libgomp.so.1", RTLD_NOW)) {
      using Parallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
      auto parallel = reinterpret_cast<Parallel>(::dlsym(gomp, "GOMP_parallel"));
      const bool before = !probe::self_if_fork_unsafe().has_value();
      std::atomic<int> ran{0};
      parallel([](void* d) { static_cast<std::atomic<int>*>(d)->fetch_add(1); }, &ran, 2, 0);
      auto self = probe::self();
      auto fast = probe::self_if_fork_unsafe();
      out = std::string(before ? "safe" : "unsafe") + " " + std::to_string(ran.load()) + " " +
            std::string(probe::to_string(self.verdict)) + " " +
            (fast ? std::string(probe::to_string(fast->verdict)) : "safe");
    }
    (void)!::write(fds[1], out.data(), out.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string got;
  char buf[256];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0) got.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_EQ(status, 0);
  EXPECT_EQ(got, "safe 2 openmp_pool openmp_pool");
}

// NOTE [the hazard is real]: not a probe test. It shows what the openmp_pool verdict is about:
// a child fork()ed after a parallel region hangs at its own first parallel region (libgomp's pool
// does not survive fork: the child's master still believes it has workers). Control: the same
// fork before any parallel region finishes at once.
TEST_F(OpenMp, HazardIsRealAChildForkedFromALivePoolHangs) {
  {
    ft::Interactive control({kOpenMpPool});
    ASSERT_EQ(control.ask("load"), "ok");
    ASSERT_EQ(control.ask("fork 2").rfind("child ", 0), 0u);
    EXPECT_EQ(control.ask("wait 20000", std::chrono::seconds(30)), "exited 0");
  }
  ft::Interactive h({kOpenMpPool});
  ASSERT_EQ(h.ask("parallel 2"), "ran 2");
  ASSERT_EQ(h.ask("fork 2").rfind("child ", 0), 0u);
  EXPECT_EQ(h.ask("wait 2000"), "running") << "the child's parallel region was expected to hang";
  EXPECT_EQ(h.ask("kill"), "killed");
}

// Other threads are named, with the library they are blocked in, but change nothing.
TEST(LiveThreads, AreEvidenceNotAVerdict) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  std::atomic<pid_t> tid{0};
  std::thread reader([&] {
    tid = static_cast<pid_t>(::syscall(SYS_gettid));
    char c;
    (void)!::read(fds[0], &c, 1);  // blocked in libc's read until the test writes
  });
  while (tid.load() == 0) std::this_thread::yield();
  probe::CudaState s;
  // Until the thread is inside read(): before, its syscall file says "running".
  for (int i = 0; i < 10000; ++i) {
    s = probe::self();
    if (details(s, probe::EvidenceKind::kLiveThread).find("blocked in libc") != std::string::npos)
      break;
    std::this_thread::yield();
  }
  (void)!::write(fds[1], "x", 1);
  reader.join();
  ::close(fds[0]);
  ::close(fds[1]);
  EXPECT_TRUE(s.fork_safe);
  EXPECT_EQ(s.verdict, probe::Verdict::kClean);
  const auto live = details(s, probe::EvidenceKind::kLiveThread);
  EXPECT_NE(live.find("thread " + std::to_string(tid.load()) + " '"), std::string::npos) << live;
  EXPECT_NE(live.find("blocked in libc"), std::string::npos) << live;
  bool noted = false;
  for (const auto& n : s.notes)
    noted |= n.find("not counted against fork safety") != std::string::npos;
  EXPECT_TRUE(noted);
  EXPECT_EQ(live.find("thread " + std::to_string(::syscall(SYS_gettid)) + " "), std::string::npos)
      << "the calling thread is not listed";
}
