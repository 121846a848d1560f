// The probe's verdicts in real processes walking through the CUDA stages with the test driver,
// seen from inside (probe::self in the helper) and from outside (probe::pid here).
#include "forkguard/probe/cuda_state.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sstream>

#include "fake_cuda_gate.hpp"
#include "paths.hpp"

namespace probe = forkguard::probe;
namespace ft = forkguard::testing;

namespace {

// "probe VERDICT kinds" -> VERDICT
std::string verdict_of(const std::string& reply) {
  std::istringstream in(reply);
  std::string word, verdict;
  in >> word >> verdict;
  EXPECT_EQ(word, "probe") << reply;
  return verdict;
}

std::string outside(pid_t pid) {
  return std::string(probe::to_string(probe::pid(pid).verdict));
}

class ProbeStages : public ::testing::Test {
 protected:
  ft::TempDir dir_;
  ft::Interactive helper_{{ft::kCudaStage}, ft::fake_cuda_env(dir_.path())};

  // The helper's own verdict, checked against what this process sees from outside.
  std::string both() {
    std::string inside = verdict_of(helper_.ask("probe"));
    EXPECT_EQ(outside(helper_.pid()), inside) << "probe::pid disagrees with probe::self";
    return inside;
  }
  std::string log() { return ft::read_file(dir_.path() + "/calls.log"); }
};

}  // namespace

TEST(Probe, TestProcessIsClean) {
  auto s = probe::self();
  EXPECT_EQ(s.verdict, probe::Verdict::kClean);
  EXPECT_TRUE(s.fork_safe);
  EXPECT_FALSE(s.has(probe::EvidenceKind::kLibraryMapped));
  EXPECT_EQ(s.pid, ::getpid());
  EXPECT_EQ(s.parent_pid, ::getppid());
}

TEST(Probe, LeavesNoFileDescriptorBehind) {
  auto before = ft::open_fds();
  for (int i = 0; i < 20; ++i) {
    probe::self();
    probe::pid(::getppid());
  }
  EXPECT_EQ(ft::open_fds(), before);
}

TEST(Probe, NoSuchProcessIsAClearError) {
  // A PID above pid_max cannot exist.
  try {
    probe::pid(99999999);
    FAIL() << "probing a missing PID must throw";
  } catch (const probe::ProbeError& e) {
    EXPECT_STREQ(e.what(), "no process with PID 99999999");
    EXPECT_EQ(e.pid(), 99999999);
    EXPECT_FALSE(e.permission_denied());
  }
  EXPECT_THROW(probe::pid(0), probe::ProbeError);
}

TEST(Probe, ExitedChildIsNoSuchProcess) {
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  EXPECT_THROW(probe::pid(child), probe::ProbeError);
}

TEST_F(ProbeStages, VerdictsFollowLoadInitContext) {
  EXPECT_EQ(both(), "clean");
  ASSERT_EQ(helper_.ask("load"), "ok");
  EXPECT_EQ(both(), "driver_loaded");
  ASSERT_EQ(helper_.ask("init"), "ok");
  EXPECT_EQ(both(), "initialized");
  ASSERT_EQ(helper_.ask("ctx"), "ok");
  EXPECT_EQ(both(), "context_active");
  ASSERT_EQ(helper_.ask("release"), "ok");
  EXPECT_EQ(both(), "initialized");
}

TEST_F(ProbeStages, EvidenceNamesWhatWasSeenAndWhere) {
  ASSERT_EQ(helper_.ask("init"), "ok");
  ASSERT_EQ(helper_.ask("ctx"), "ok");
  auto s = probe::pid(helper_.pid());
  EXPECT_EQ(s.verdict, probe::Verdict::kContextActive);
  EXPECT_FALSE(s.fork_safe);
  auto pid = std::to_string(helper_.pid());
  bool lib = false, uvm = false, thread = false, mapped = false;
  for (const auto& e : s.evidence) {
    if (e.kind == probe::EvidenceKind::kLibraryMapped &&
        e.detail.find(ft::kFakeCuda) != std::string::npos) {
      lib = true;
      EXPECT_EQ(e.source, "/proc/" + pid + "/maps");
    }
    if (e.kind == probe::EvidenceKind::kDeviceFileOpen &&
        e.detail.find("/dev/nvidia-uvm") != std::string::npos) {
      uvm = true;
      EXPECT_EQ(e.source.rfind("/proc/" + pid + "/fd/", 0), 0u) << e.source;
    }
    if (e.kind == probe::EvidenceKind::kDriverThread) {
      thread = true;
      EXPECT_NE(e.detail.find("cuda-EvtHandlr"), std::string::npos);
    }
    if (e.kind == probe::EvidenceKind::kDeviceFileMapped) mapped = true;
  }
  EXPECT_TRUE(lib && uvm && thread && mapped);
}

TEST_F(ProbeStages, NvmlIsForkSafe) {
  ASSERT_EQ(helper_.ask("nvml"), "ok");
  EXPECT_EQ(both(), "nvml_open");
  EXPECT_TRUE(probe::pid(helper_.pid()).fork_safe);
}

TEST_F(ProbeStages, ChildForkedAfterInitIsPoisoned) {
  ASSERT_EQ(helper_.ask("init"), "ok");
  auto child_line = helper_.ask("fork");
  ASSERT_EQ(child_line.rfind("child ", 0), 0u) << child_line;
  pid_t child = std::stoi(child_line.substr(6));
  EXPECT_EQ(verdict_of(helper_.ask("probe")), "poisoned");
  auto s = probe::pid(child);
  EXPECT_EQ(s.verdict, probe::Verdict::kPoisoned);
  EXPECT_FALSE(s.fork_safe);
  EXPECT_TRUE(s.has(probe::EvidenceKind::kInheritedFile)) << "kcmp shows the parent's files";
  EXPECT_EQ(s.poisoned_by, helper_.pid());
  EXPECT_FALSE(s.has(probe::EvidenceKind::kDriverThread)) << "threads do not survive fork";
  EXPECT_EQ(helper_.ask("init"), "error CUDA_ERROR_NOT_INITIALIZED")
      << "the poisoned child cannot initialize CUDA";
  helper_.send("exit");
  EXPECT_EQ(helper_.read_line(), "parent 0");
  EXPECT_EQ(both(), "initialized") << "the parent is still initialized";
}

// Device files open, driver thread not started yet: no parent shares those files, so nothing
// proves a poisoning fork; it was called "poisoned", accusing an innocent parent.
TEST(Probe, ProcessInsideCuInitIsInitializedNotPoisoned) {
  ft::TempDir dir;
  ft::CuInitGate gate(dir.path());
  ft::Interactive h({ft::kCudaStage}, gate.env(ft::fake_cuda_env(dir.path())));
  h.send("init");
  gate.wait_until_held();
  auto s = probe::pid(h.pid());
  EXPECT_EQ(s.verdict, probe::Verdict::kInitialized);
  EXPECT_FALSE(s.fork_safe);
  EXPECT_TRUE(s.has(probe::EvidenceKind::kDeviceFileOpen));
  EXPECT_FALSE(s.has(probe::EvidenceKind::kDriverThread)) << "held before its thread starts";
  EXPECT_FALSE(s.has(probe::EvidenceKind::kInheritedFile));
  EXPECT_EQ(s.poisoned_by, 0);
  ASSERT_EQ(s.notes.size(), 1u);
  EXPECT_NE(s.notes[0].find("cuInit is in progress"), std::string::npos) << s.notes[0];
  gate.release();
  EXPECT_EQ(h.read_line(), "ok");
  EXPECT_EQ(outside(h.pid()), "initialized");
}

// The child shares its parent's NVML files (nvidiactl), but the parent never initialized CUDA:
// the child can, and it was called "poisoned".
TEST_F(ProbeStages, ChildOfAnNvmlParentIsNotPoisoned) {
  ASSERT_EQ(helper_.ask("load"), "ok");
  ASSERT_EQ(helper_.ask("nvml"), "ok");
  auto child_line = helper_.ask("fork");
  ASSERT_EQ(child_line.rfind("child ", 0), 0u) << child_line;
  pid_t child = std::stoi(child_line.substr(6));
  auto s = probe::pid(child);
  EXPECT_EQ(s.verdict, probe::Verdict::kNvmlOpen);
  EXPECT_TRUE(s.fork_safe);
  EXPECT_TRUE(s.has(probe::EvidenceKind::kInheritedFile)) << "it does share nvidiactl";
  EXPECT_EQ(verdict_of(helper_.ask("probe")), "nvml_open");
  EXPECT_EQ(helper_.ask("init"), "ok") << "the child can initialize CUDA";
  helper_.send("exit");
  EXPECT_EQ(helper_.read_line(), "parent 0");
}

// A worker's worker: its parent is poisoned (no driver thread), its grandparent initialized.
TEST_F(ProbeStages, GrandchildIsPoisonedByTheInitializedGrandparent) {
  ASSERT_EQ(helper_.ask("init"), "ok");
  auto child_line = helper_.ask("fork");
  pid_t child = std::stoi(child_line.substr(6));
  auto grandchild_line = helper_.ask("fork");
  ASSERT_EQ(grandchild_line.rfind("child ", 0), 0u) << grandchild_line;
  pid_t grandchild = std::stoi(grandchild_line.substr(6));
  auto s = probe::pid(grandchild);
  EXPECT_EQ(s.verdict, probe::Verdict::kPoisoned);
  EXPECT_EQ(s.parent_pid, child);
  EXPECT_EQ(s.poisoned_by, helper_.pid());
  EXPECT_EQ(verdict_of(helper_.ask("probe")), "poisoned");
  EXPECT_EQ(probe::pid(child).poisoned_by, helper_.pid());
  helper_.send("exit");
  EXPECT_EQ(helper_.read_line(), "parent 0");
  helper_.send("exit");
  EXPECT_EQ(helper_.read_line(), "parent 0");
}

TEST_F(ProbeStages, ChildForkedBeforeInitCanUseCuda) {
  ASSERT_EQ(helper_.ask("load"), "ok");
  ASSERT_EQ(helper_.ask("fork").rfind("child ", 0), 0u);
  EXPECT_EQ(verdict_of(helper_.ask("probe")), "driver_loaded");
  EXPECT_EQ(helper_.ask("init"), "ok");
  EXPECT_EQ(verdict_of(helper_.ask("probe")), "initialized");
  helper_.send("exit");
  EXPECT_EQ(helper_.read_line(), "parent 0");
}

TEST_F(ProbeStages, ProbeCallsNoInitializingFunction) {
  ASSERT_EQ(helper_.ask("load"), "ok");
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(both(), "driver_loaded");
  }
  std::string calls = log();
  std::istringstream in(calls);
  std::string pid, fn, result;
  int lines = 0;
  while (in >> pid >> fn >> result) {
    ++lines;
    EXPECT_TRUE(fn == "cuDriverGetVersion" || fn == "cuDeviceGetCount") << "probe called " << fn;
    if (fn == "cuDeviceGetCount") {
      EXPECT_EQ(result, "3");
    }
  }
  EXPECT_EQ(lines, 10) << calls;  // two calls per self-probe; probe::pid calls nothing
  ASSERT_EQ(helper_.ask("count"), "error CUDA_ERROR_NOT_INITIALIZED") << "still not initialized";
  EXPECT_EQ(helper_.ask("init"), "ok");
}

TEST(Probe, EnvironmentIsEvidence) {
  ft::TempDir dir;
  auto env = ft::fake_cuda_env(dir.path());
  env["CUDA_VISIBLE_DEVICES"] = "1";
  env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1";
  ft::Interactive h({ft::kCudaStage}, env);
  ASSERT_EQ(h.ask("pid"), "pid " + std::to_string(h.pid()));  // it has exec'd: its own environ
  auto s = probe::pid(h.pid());
  std::vector<std::string> vars;
  for (const auto& e : s.evidence) {
    if (e.kind == probe::EvidenceKind::kEnvironment) vars.push_back(e.detail);
  }
  EXPECT_NE(std::find(vars.begin(), vars.end(), "CUDA_VISIBLE_DEVICES=1"), vars.end());
  EXPECT_NE(std::find(vars.begin(), vars.end(), "PYTORCH_NVML_BASED_CUDA_CHECK=1"), vars.end());
  EXPECT_EQ(s.verdict, probe::Verdict::kClean) << "variables alone do not change the verdict";
}
