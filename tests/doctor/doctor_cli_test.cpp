// forkguard doctor as a user runs it: exit codes, text, JSON, errors.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "fake_cuda_gate.hpp"
#include "paths.hpp"

namespace ft = forkguard::testing;
using nlohmann::json;

namespace {

class Doctor : public ::testing::Test {
 protected:
  ft::TempDir dir_;
  ft::EnvOverrides env_ = ft::fake_cuda_env(dir_.path());

  ft::RunResult doctor(std::vector<std::string> args) {
    args.insert(args.begin(), {ft::kForkguard, "doctor"});
    return ft::run(args, env_);
  }
  json doctor_json(pid_t pid, int expect_exit) {
    auto r = doctor({"--pid", std::to_string(pid), "--json"});
    EXPECT_EQ(r.exit_code, expect_exit) << r.out << r.err;
    return json::parse(r.out);
  }
};

const std::string kOpenMpPool = FORKGUARD_HELPER_DIR "/openmp_pool";
const std::string kTorchCudaStandIn = FORKGUARD_HELPER_DIR "/torch_stand_in/libtorch_cuda.so";

std::string helper_verdict(ft::Interactive& h) {
  std::istringstream in(h.ask("probe"));
  std::string word, verdict;
  in >> word >> verdict;
  return verdict;
}

}  // namespace

TEST_F(Doctor, SelfIsCleanAndForkSafe) {
  auto r = doctor({"--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = json::parse(r.out);
  EXPECT_EQ(j["verdict"], "clean");
  EXPECT_EQ(j["fork_safe"], true);
  EXPECT_TRUE(j["evidence"].is_array());
  EXPECT_FALSE(j["advice"].empty());
  for (const char* key : {"pid", "verdict", "fork_safe", "evidence", "advice", "environment"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
}

TEST_F(Doctor, AgreesWithTheProcessesOwnProbeAtEveryStage) {
  ft::Interactive h({ft::kCudaStage}, env_);
  struct Stage {
    const char* command;
    const char* verdict;
    int exit;
  } stages[] = {{nullptr, "clean", 0},
                {"load", "driver_loaded", 0},
                {"init", "initialized", 3},
                {"ctx", "context_active", 3}};
  for (const auto& s : stages) {
    if (s.command != nullptr) {
      ASSERT_EQ(h.ask(s.command), "ok") << s.command;
    }
    auto j = doctor_json(h.pid(), s.exit);
    EXPECT_EQ(j["pid"], h.pid());
    EXPECT_EQ(j["verdict"], s.verdict);
    EXPECT_EQ(j["verdict"], helper_verdict(h)) << "doctor --pid and probe::self disagree";
    EXPECT_EQ(j["fork_safe"], s.exit == 0);
  }
}

TEST_F(Doctor, PoisonedChildNamesItsParentAndTheCure) {
  ft::Interactive h({ft::kCudaStage}, env_);
  ASSERT_EQ(h.ask("init"), "ok");
  pid_t parent = h.pid();
  auto line = h.ask("fork");
  pid_t child = std::stoi(line.substr(6));
  auto r = doctor({"--pid", std::to_string(child)});
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.out.find("verdict: poisoned (fork UNSAFE)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("forked from a parent (PID " + std::to_string(parent) + ")"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("CUDA_ERROR_NOT_INITIALIZED"), std::string::npos);
  EXPECT_NE(r.out.find("inherited_file"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("spawn"), std::string::npos) << r.out;
  h.send("exit");
  EXPECT_EQ(h.read_line(), "parent 0");
}

// In the middle of cuInit (device files open, driver thread not yet started) a process is not
// poisoned: doctor said so, naming its innocent parent.
TEST_F(Doctor, ProcessInsideCuInitIsNotCalledPoisoned) {
  ft::CuInitGate gate(dir_.path());
  ft::Interactive h({ft::kCudaStage}, gate.env(env_));
  h.send("init");
  gate.wait_until_held();
  auto r = doctor({"--pid", std::to_string(h.pid())});
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.out.find("verdict: initialized (fork UNSAFE)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("forked from a parent"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("note: nvidia-uvm is open but the CUDA driver's threads are not running"),
            std::string::npos)
      << r.out;
  gate.release();
  EXPECT_EQ(h.read_line(), "ok");
}

TEST_F(Doctor, PoisonedGrandchildNamesTheInitializedProcess) {
  ft::Interactive h({ft::kCudaStage}, env_);
  ASSERT_EQ(h.ask("init"), "ok");
  pid_t child = std::stoi(h.ask("fork").substr(6));
  pid_t grandchild = std::stoi(h.ask("fork").substr(6));
  auto r = doctor({"--pid", std::to_string(grandchild)});
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.out.find("forked from a parent (PID " + std::to_string(child) +
                       ") that descends from PID " + std::to_string(h.pid()) +
                       ", which had initialized CUDA"),
            std::string::npos)
      << r.out;
  auto j = doctor_json(grandchild, 3);
  EXPECT_EQ(j["poisoned_by"], h.pid());
  h.send("exit");
  EXPECT_EQ(h.read_line(), "parent 0");
  h.send("exit");
  EXPECT_EQ(h.read_line(), "parent 0");
}

TEST_F(Doctor, InitializedTextGivesEvidenceAndEveryCure) {
  ft::Interactive h({ft::kCudaStage}, env_);
  ASSERT_EQ(h.ask("init"), "ok");
  auto r = doctor({"--pid", std::to_string(h.pid())});
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_NE(r.out.find("verdict: initialized (fork UNSAFE)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("driver_thread"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("nvidia-uvm"), std::string::npos) << r.out;
  for (const char* cure : {"--start-method spawn", "PYTORCH_NVML_BASED_CUDA_CHECK=1", "CPU-only",
                           "after the launch"}) {
    EXPECT_NE(r.out.find(cure), std::string::npos) << cure << "\n" << r.out;
  }
}

// A live GNU OpenMP pool (tests/helpers/openmp_pool.cpp, Debian's libgomp): a forked child hangs.
TEST_F(Doctor, ALiveOpenMpPoolIsForkUnsafeWithItsCures) {
  ft::Interactive h({kOpenMpPool}, env_);
  const auto ran = h.ask("parallel 2");
  if (ran.rfind("error", 0) == 0) GTEST_SKIP() << "no libgomp.so.1 here: " << ran;
  ASSERT_EQ(ran, "ran 2");
  auto r = doctor({"--pid", std::to_string(h.pid())});
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.out.find("verdict: openmp_pool (fork UNSAFE)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("hangs for ever at its first parallel region"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("- openmp_pool"), std::string::npos) << r.out;
  for (const char* cure : {"OMP_NUM_THREADS=1", "torch.set_num_threads(1)", "--start-method"}) {
    EXPECT_NE(r.out.find(cure), std::string::npos) << cure << "\n" << r.out;
  }
  auto j = doctor_json(h.pid(), 3);
  EXPECT_EQ(j["verdict"], "openmp_pool");
  EXPECT_EQ(j["fork_safe"], false);
  EXPECT_EQ(j["fork_safety"], "unsafe");
}

// torch's own fork poison is a byte in the process's memory: from outside, a CUDA build of torch
// mapped (a stand-in libtorch_cuda.so here) leaves fork safety unknown, not "safe" (it was exit 0,
// "driver_loaded (fork safe)", for a process whose forked children fail).
TEST_F(Doctor, ACudaBuildOfTorchMappedIsUnknownFromOutside) {
  ft::Interactive h({kOpenMpPool}, env_);
  ASSERT_EQ(h.ask("dlopen " + kTorchCudaStandIn), "ok");
  auto r = doctor({"--pid", std::to_string(h.pid())});
  EXPECT_EQ(r.exit_code, 4) << r.out << r.err;
  EXPECT_NE(r.out.find("verdict: driver_loaded (fork safety unknown: torch's own fork poison "
                       "(libtorch_cuda.so is mapped) is not visible from another process)"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("fork safe)"), std::string::npos) << r.out;
  auto j = doctor_json(h.pid(), 4);
  EXPECT_EQ(j["verdict"], "driver_loaded");
  EXPECT_EQ(j["fork_safety"], "unknown");
  ASSERT_EQ(j["unseen_hazards"].size(), 1u) << j.dump();
  // Its own doctor (inside the process) has nothing unseen: that one says safe or unsafe.
  auto self = doctor({"--json"});
  EXPECT_EQ(json::parse(self.out)["fork_safety"], "safe");
}

TEST_F(Doctor, EnvironmentListsGpusAndCallsOutVisibleDeviceMismatches) {
  ft::Interactive h({ft::kCudaStage}, [&] {
    auto env = env_;
    env["CUDA_VISIBLE_DEVICES"] = "1,5";
    return env;
  }());
  ASSERT_EQ(h.ask("pid"), "pid " + std::to_string(h.pid()));  // exec'd: /proc shows its environ
  auto j = doctor_json(h.pid(), 0);
  const auto& e = j["environment"];
  EXPECT_EQ(e["gpus"].size(), 2u);
  EXPECT_EQ(e["gpus"][1]["uuid"], "GPU-fa4e0000-0000-4000-8000-000000000001");
  EXPECT_EQ(e["driver_version"], "999.99-fake");
  EXPECT_EQ(e["cuda_visible_devices"]["value"], "1,5");
  EXPECT_EQ(e["cuda_visible_devices"]["visible"], json::array({1}));
  ASSERT_EQ(e["cuda_visible_devices"]["problems"].size(), 1u);
  EXPECT_NE(
      e["cuda_visible_devices"]["problems"][0].get<std::string>().find("\"5\" is out of range"),
      std::string::npos);
  auto text = doctor({"--pid", std::to_string(h.pid())});
  EXPECT_NE(text.out.find("mismatch: CUDA_VISIBLE_DEVICES entry 1 \"5\""), std::string::npos)
      << text.out;
}

// An environment is bytes: a value that is not UTF-8 is written as U+FFFD, not an abort (nlohmann's
// type_error 316 escaped: exit 134, no output).
TEST_F(Doctor, JsonCarriesAnEnvironmentThatIsNotUtf8) {
  ft::Interactive h({ft::kCudaStage}, [&] {
    auto env = env_;
    env["CUDA_VISIBLE_DEVICES"] = "0,\xff";
    return env;
  }());
  ASSERT_EQ(h.ask("pid"), "pid " + std::to_string(h.pid()));
  auto r = doctor({"--pid", std::to_string(h.pid()), "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const auto j = json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["environment"]["cuda_visible_devices"]["value"], "0,\xef\xbf\xbd");  // U+FFFD
  auto text = doctor({"--pid", std::to_string(h.pid())});
  EXPECT_NE(text.out.find("0,\xff"), std::string::npos) << text.out;  // the text keeps the bytes
}

// With --json, errors are JSON objects on stdout too (the message also goes to stderr).
TEST_F(Doctor, JsonErrorsAreJsonObjects) {
  auto missing = doctor({"--pid", "99999999", "--json"});
  EXPECT_EQ(missing.exit_code, 2);
  auto j = json::parse(missing.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << missing.out;
  EXPECT_NE(j["error"].get<std::string>().find("no process with PID 99999999"), std::string::npos)
      << j.dump();
  EXPECT_EQ(j["exit_code"], 2);
  EXPECT_NE(missing.err.find("no process with PID 99999999"), std::string::npos) << missing.err;
  for (const auto& args :
       std::vector<std::vector<std::string>>{{"--json", "--pid", "abc"}, {"--json", "--bogus"}}) {
    auto r = doctor(args);
    EXPECT_EQ(r.exit_code, 2);
    auto e = json::parse(r.out, nullptr, false);
    ASSERT_TRUE(e.is_object()) << args[1] << ": " << r.out;
    EXPECT_FALSE(e["error"].get<std::string>().empty());
    EXPECT_EQ(e["exit_code"], 2);
  }
}

TEST_F(Doctor, DoctorsOwnNvmlDoesNotTaintItsVerdict) {
  auto r = doctor({});
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("verdict: clean"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("GPUs from nvml"), std::string::npos) << r.out;
}

TEST_F(Doctor, WithoutNvmlSaysWhereItLooked) {
  env_["FORKGUARD_NVML_LIBRARY"] = "/nonexistent/libnvidia-ml.so.1";
  auto j = json::parse(doctor({"--json"}).out);
  EXPECT_NE(j["environment"]["gpu_notes"].dump().find("/nonexistent/libnvidia-ml.so.1"),
            std::string::npos)
      << j.dump();
}

TEST_F(Doctor, MissingPidIsExit2NamingIt) {
  auto r = doctor({"--pid", "99999999"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("no process with PID 99999999"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty());
}

TEST_F(Doctor, UsageErrorsAreExit2) {
  EXPECT_EQ(doctor({"--pid", "abc"}).exit_code, 2);
  EXPECT_EQ(doctor({"--bogus"}).exit_code, 2);
  EXPECT_EQ(ft::run({ft::kForkguard}).exit_code, 2);
  auto help = ft::run({ft::kForkguard, "doctor", "--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("--pid"), std::string::npos);
  EXPECT_NE(help.out.find("4 fork safety unknown"), std::string::npos) << help.out;
}

// CLI11's PositiveNumber answered "abc" with the double range spelled out (308 digits).
TEST_F(Doctor, ABadPidIsAShortMessage) {
  for (const char* bad : {"abc", "0", "-5", "99999999999", "12x"}) {
    auto r = doctor({"--pid", bad});
    EXPECT_EQ(r.exit_code, 2) << bad;
    EXPECT_NE(
        r.err.find(std::string("--pid: a PID is a whole number from 1 to 2147483647, not \"") +
                   bad + "\""),
        std::string::npos)
        << r.err;
    EXPECT_LT(r.err.size(), 300u) << r.err;
  }
}

// A kernel thread has no user memory: "clean" was a verdict on nothing.
TEST_F(Doctor, AKernelThreadIsNotAUserProcess) {
  std::ifstream stat("/proc/2/stat");
  std::string line;
  std::getline(stat, line);
  auto close = line.rfind(')');
  unsigned long flags = 0;
  int fields[5];
  char state = 0;
  if (line.rfind("2 (kthreadd)", 0) != 0 ||
      std::sscanf(line.c_str() + close + 1, " %c %d %d %d %d %d %lu", &state, &fields[0],
                  &fields[1], &fields[2], &fields[3], &fields[4], &flags) != 7 ||
      !(flags & 0x00200000)) {
    GTEST_SKIP() << "no kernel thread kthreadd as PID 2 in this PID namespace: " << line;
  }
  auto r = doctor({"--pid", "2"});
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.err.find("PID 2 (kthreadd) is a kernel thread, not a user process"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("clean"), std::string::npos) << r.out;
}

TEST_F(Doctor, AZombieIsSaidToBeOne) {
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  siginfo_t info{};
  // Waits for the exit without reaping: the child is a zombie from here on, no sleep needed.
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT), 0);
  auto r = doctor({"--pid", std::to_string(child)});
  auto j = doctor_json(child, 2);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.err.find("PID " + std::to_string(child) +
                       " (doctor_test) is a zombie: it has exited and its parent (PID " +
                       std::to_string(::getpid()) + ") has not reaped it yet"),
            std::string::npos)
      << r.err;
  EXPECT_NE(j["error"].get<std::string>().find("is a zombie"), std::string::npos) << j;
}

TEST_F(Doctor, PermissionDeniedIsExit2SayingWhy) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run the doctor as another user";
  auto probe = ft::run({"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        ft::kForkguard, "--version"});
  if (probe.exit_code != 0) {
    GTEST_SKIP() << "user 65534 cannot run " << ft::kForkguard << ": " << probe.err;
  }
  auto r = ft::run({"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                    ft::kForkguard, "doctor", "--pid", std::to_string(::getpid())});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("not allowed to inspect PID " + std::to_string(::getpid())),
            std::string::npos)
      << r.err;
}
