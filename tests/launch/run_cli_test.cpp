// forkguard run as a user runs it: exit codes, GPU plan, reports, signals, a killed launcher,
// and real peers (Open MPI's mpirun).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "paths.hpp"

namespace ft = forkguard::testing;
using namespace std::chrono_literals;

namespace {

class RunCli : public ::testing::Test {
 protected:
  ft::TempDir dir_;
  ft::EnvOverrides env_ = ft::fake_cuda_env(dir_.path());
  ft::RunResult run(std::vector<std::string> args) {
    args.insert(args.begin(), {ft::kForkguard, "run"});
    return ft::run(args, env_);
  }
};

}  // namespace

TEST_F(RunCli, SuccessIsExitZeroWithPrefixedLines) {
  auto r = run({"--nproc-per-node", "2", "--", "sh", "-c", "echo hi $RANK"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("[rank0]:hi 0\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank1]:hi 1\n"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("OMP_NUM_THREADS=1"), std::string::npos) << "said once: " << r.err;
}

TEST_F(RunCli, ExitCodeAndJsonReportNameTheRootCause) {
  std::string report = dir_.path() + "/report.json";
  for (const char* method : {"spawn", "forkserver", "fork"}) {
    auto r = run({"--nproc-per-node", "3", "--start-method", method, "--grace", "5",
                  "--json-report", report, "--", "sh", "-c",
                  "if [ $RANK = 1 ]; then echo bad input >&2; exit 9; fi; exec sleep 30"});
    EXPECT_EQ(r.exit_code, 9) << method << r.err;
    EXPECT_NE(r.err.find("rank 1 (local rank 1, PID"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("| bad input"), std::string::npos) << r.err;
    auto j = nlohmann::json::parse(ft::read_file(report));
    EXPECT_EQ(j["root_cause"], 1);
    EXPECT_EQ(j["exit_code"], 9);
    EXPECT_EQ(j["success"], false);
    EXPECT_EQ(j["ranks"][0]["stopped_by_launcher"], true);
    EXPECT_EQ(j["ranks"][0]["signal"], SIGTERM);
    EXPECT_EQ(j["ranks"][1]["stderr_tail"], nlohmann::json::array({"bad input"}));
  }
}

TEST_F(RunCli, KilledRankGives128PlusSignal) {
  auto r = run({"--nproc-per-node", "1", "--", "sh", "-c", "kill -SEGV $$"});
  EXPECT_EQ(r.exit_code, 128 + SIGSEGV) << r.err;
  EXPECT_NE(r.err.find("killed by signal 11 (SIGSEGV)"), std::string::npos) << r.err;
}

TEST_F(RunCli, MoreRanksThanGpusWithBindFailsBeforeLaunch) {
  std::string marker = dir_.path() + "/started";
  auto r = run({"--nproc-per-node", "4", "--bind-gpus", "--", "touch", marker});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("with 4 ranks per node needs 4 GPUs, but only 2 are visible"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("CUDA_VISIBLE_DEVICES unset"), std::string::npos) << r.err;
  struct stat st {};
  EXPECT_NE(::stat(marker.c_str(), &st), 0) << "no rank may start";
  auto shared = run({"--nproc-per-node", "4", "--bind-gpus", "--allow-gpu-sharing", "--", "sh",
                     "-c", "echo $CUDA_VISIBLE_DEVICES"});
  EXPECT_EQ(shared.exit_code, 0) << shared.err;
  EXPECT_NE(shared.out.find("[rank3]:1\n"), std::string::npos) << shared.out;
}

TEST_F(RunCli, NprocGpuGivesOneRankPerVisibleGpu) {
  auto r = run({"--nproc-per-node", "gpu", "--bind-gpus", "--", "sh", "-c",
                "echo $LOCAL_RANK:$CUDA_VISIBLE_DEVICES:$WORLD_SIZE"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("[rank0]:0:0:2\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank1]:1:1:2\n"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("[rank2]"), std::string::npos) << r.out;
  env_["CUDA_VISIBLE_DEVICES"] = "1";
  auto one = run(
      {"--nproc-per-node", "gpu", "--bind-gpus", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"});
  EXPECT_EQ(one.out, "[rank0]:1\n") << one.out << one.err;
}

TEST_F(RunCli, RanksSeeOnlyTheirGpuThroughTheDriver) {
  // The test driver honours CUDA_VISIBLE_DEVICES as the real one does.
  auto r = run({"--nproc-per-node", "gpu", "--bind-gpus", "--", ft::kCudaStage});
  // cuda_stage reads commands from stdin; with none it exits 0. Its count is checked elsewhere.
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

TEST_F(RunCli, SigtermToTheLauncherIsForwardedToEveryRank) {
  ft::Interactive launcher(
      {ft::kForkguard, "run", "--quiet", "--nproc-per-node", "2", "--", "sh", "-c",
       "trap 'echo got TERM; exit 0' TERM; echo ready; while :; do sleep 0.02; done"},
      env_);
  std::set<std::string> ready;
  while (ready.size() < 2) ready.insert(launcher.read_line(10s));
  auto start = std::chrono::steady_clock::now();
  ::kill(launcher.pid(), SIGTERM);
  std::set<std::string> got = {launcher.read_line(10s), launcher.read_line(10s)};
  EXPECT_EQ(got, (std::set<std::string>{"[rank0]:got TERM", "[rank1]:got TERM"}));
  int status = launcher.finish();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
}

TEST_F(RunCli, NoRankSurvivesSigkillOfTheLauncher) {
  for (const char* method : {"spawn", "forkserver"}) {
    ft::Interactive launcher({ft::kForkguard, "run", "--quiet", "--start-method", method,
                              "--nproc-per-node", "3", "--", "sh", "-c", "echo $$; exec sleep 60"},
                             env_);
    std::vector<pid_t> ranks;
    for (int i = 0; i < 3; ++i) {
      auto line = launcher.read_line(10s);
      ranks.push_back(std::stoi(line.substr(line.find(':') + 1)));
    }
    ::kill(launcher.pid(), SIGKILL);
    launcher.finish();
    auto deadline = std::chrono::steady_clock::now() + 1s;
    while (std::chrono::steady_clock::now() < deadline &&
           std::any_of(ranks.begin(), ranks.end(), ft::is_alive)) {
      std::this_thread::sleep_for(10ms);
    }
    for (pid_t p : ranks)
      EXPECT_FALSE(ft::is_alive(p)) << method << ": rank " << p << " outlived the launcher";
  }
}

TEST_F(RunCli, AProgramWithAForkServerReapsItAtExit) {
  // As a subreaper, this process inherits whatever notebook_style leaves behind when it exits.
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  auto r = ft::run(
      {ft::kNotebookStyle, "--parent-touches-cuda", "--nproc", "2", "--start-method", "forkserver"},
      env_);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  auto left = ft::children_of(::getpid());
  for (pid_t p : left) ::waitpid(p, nullptr, 0);
  EXPECT_TRUE(left.empty()) << "the zygote (or a rank) outlived its program, as a zombie or alive";
  ::prctl(PR_SET_CHILD_SUBREAPER, 0);
}

TEST_F(RunCli, UsageErrors) {
  EXPECT_EQ(run({"--nproc-per-node", "0", "--", "true"}).exit_code, 2);
  EXPECT_EQ(run({"--nproc-per-node", "x", "--", "true"}).exit_code, 2);
  EXPECT_EQ(run({"--start-method", "teleport", "--", "true"}).exit_code, 2);
  EXPECT_EQ(run({}).exit_code, 2) << "a command is required";
  auto help = ft::run({ft::kForkguard, "run", "--help"});
  for (const char* flag :
       {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port",
        "--standalone", "--max-restarts", "--log-dir", "--tee", "--local-ranks-filter",
        "--start-method", "--bind-gpus", "--allow-gpu-sharing", "--grace", "--json-report"}) {
    EXPECT_NE(help.out.find(flag), std::string::npos) << flag;
  }
}

TEST_F(RunCli, MissingCommandSaysSo) {
  auto r = run({"--", "/nonexistent/train"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("failed to execute /nonexistent/train: No such file or directory"),
            std::string::npos)
      << r.err;
}

TEST_F(RunCli, UnderMpirunEachNodeFansOutItsRanks) {
  struct stat st {};
  if (::stat("/usr/bin/mpirun", &st) != 0)
    GTEST_SKIP() << "Open MPI (openmpi-bin) is not installed";
  auto env = env_;
  env["OMPI_ALLOW_RUN_AS_ROOT"] = "1";
  env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1";
  auto r = ft::run({"/usr/bin/mpirun", "--oversubscribe", "-np", "2", ft::kForkguard, "run",
                    "--quiet", "--nproc-per-node", "2", "--no-prefix", "--", "printenv", "RANK"},
                   env, 60s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  std::multiset<std::string> ranks;
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) ranks.insert(line);
  EXPECT_EQ(ranks, (std::multiset<std::string>{"0", "1", "2", "3"})) << r.out << r.err;
}

TEST_F(RunCli, RealTorchDistributedGlooAllReduce) {
  if (ft::run({"/usr/bin/python3", "-c", "import torch.distributed"}).exit_code != 0) {
    GTEST_SKIP() << "Debian's python3-torch is not installed";
  }
  auto r = ft::run({ft::kForkguard, "run", "--quiet", "--standalone", "--nproc-per-node", "2", "--",
                    "/usr/bin/python3", FORKGUARD_SOURCE_DIR "/examples/ddp_gloo.py"},
                   env_, 120s);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[rank0]:rank 0/2: all_reduce = 3 (expected 3)"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("[rank1]:rank 1/2: all_reduce = 3 (expected 3)"), std::string::npos)
      << r.out;
}
