// The supervisor (launch/supervisor.hpp) as notebook_launch drives it: output and notices through
// an OutputSink instead of fd 1 and 2, an interrupt hook instead of a signalfd, and the rank
// environment built in one place (rank_process_environment). Real processes (sh), each test
// checking that no fd, zombie or child is left.
#include "launch/supervisor.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "forkguard/launch/environment.hpp"
#include "forkguard/launch/launcher.hpp"
#include "launch/init_state.hpp"
#include "process.hpp"

namespace fl = forkguard::launch;
using namespace std::chrono_literals;

namespace {

struct Recorded : fl::detail::OutputSink {
  std::string out, err, notices;
  void rank_output(int, bool is_err, std::string_view text) override {
    (is_err ? err : out) += text;
  }
  void notice(std::string_view text) override {
    notices += text;
    notices += '\n';
  }
};

class SupervisorTest : public ::testing::Test {
 protected:
  void SetUp() override { fds_ = forkguard::testing::open_fds(); }
  void TearDown() override {
    EXPECT_EQ(forkguard::testing::open_fds(), fds_) << "an fd leaked";
    EXPECT_TRUE(forkguard::testing::children_of(::getpid()).empty()) << "a child was left";
  }
  std::vector<int> fds_;
};

fl::detail::Job command(std::string script) {
  fl::detail::Job job;
  job.argv = {"/bin/sh", "-c", std::move(script)};
  return job;
}

TEST_F(SupervisorTest, RankOutputAndNoticesGoToTheSinkWithThePrefix) {
  Recorded sink;
  auto r = fl::detail::supervise({.nproc = 2, .start = fl::StartMethod::kSpawn},
                                 command("echo out $RANK; echo err $RANK >&2"), {.sink = &sink});
  EXPECT_TRUE(r.success());
  EXPECT_NE(sink.out.find("[rank0]:out 0\n"), std::string::npos) << sink.out;
  EXPECT_NE(sink.out.find("[rank1]:out 1\n"), std::string::npos) << sink.out;
  EXPECT_NE(sink.err.find("[rank1]:err 1\n"), std::string::npos) << sink.err;
  EXPECT_NE(sink.notices.find("setting OMP_NUM_THREADS=1"), std::string::npos) << sink.notices;
}

TEST_F(SupervisorTest, QuietKeepsNoticesFromTheSink) {
  Recorded sink;
  fl::detail::supervise({.nproc = 2, .start = fl::StartMethod::kSpawn, .quiet = true},
                        command("true"), {.sink = &sink});
  EXPECT_EQ(sink.notices, "");
}

TEST_F(SupervisorTest, TheInterruptHookForwardsItsSignalAndStopsEveryRank) {
  Recorded sink;
  std::atomic<int> polls{0};
  auto hook = [&] { return ++polls >= 3 ? SIGINT : 0; };
  const auto t0 = std::chrono::steady_clock::now();
  try {
    fl::detail::supervise({.nproc = 2, .start = fl::StartMethod::kSpawn, .stop = {.grace = 5s}},
                          command("exec sleep 30"), {.sink = &sink, .interrupted = hook});
    FAIL() << "an interrupted launch throws RankFailedError";
  } catch (const fl::RankFailedError& e) {
    EXPECT_EQ(e.result().interrupted_by, SIGINT);
    EXPECT_EQ(e.result().exit_code(), 128 + SIGINT);
    for (const auto& rank : e.result().ranks) {
      EXPECT_EQ(rank.status.signal, SIGINT) << rank.status.to_string();
    }
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s) << "polled every kInterruptPoll";
  EXPECT_NE(sink.notices.find("received SIGINT, forwarding it to every rank"), std::string::npos)
      << sink.notices;
}

TEST_F(SupervisorTest, RestartsAreSaidThroughTheSinkAndCountedInTheEnvironment) {
  Recorded sink;
  auto r = fl::detail::supervise(
      {.nproc = 1, .start = fl::StartMethod::kSpawn, .max_restarts = 1},
      command("echo attempt $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS; "
              "test $TORCHELASTIC_RESTART_COUNT = 1"),
      {.sink = &sink});
  EXPECT_TRUE(r.success());
  EXPECT_EQ(r.restarts, 1);
  EXPECT_NE(sink.out.find("[rank0]:attempt 0 of 1\n[rank0]:attempt 1 of 1\n"), std::string::npos)
      << sink.out;
  EXPECT_NE(sink.notices.find("rank 0 exited with code 1: restarting the group (1 of 1)"),
            std::string::npos)
      << sink.notices;
}

TEST_F(SupervisorTest, EveryTorchrunVariableComesFromTheOnePlaceThatBuildsThem) {
  Recorded sink;
  fl::Options o{.nproc = 2, .start = fl::StartMethod::kSpawn};
  o.nodes = {.nnodes = 2, .node_rank = 1, .master_addr = "127.0.0.1", .master_port = 29123};
  fl::detail::supervise(o,
                        command("echo $RANK $LOCAL_RANK $GROUP_RANK $ROLE_RANK $WORLD_SIZE "
                                "$LOCAL_WORLD_SIZE $GROUP_WORLD_SIZE $ROLE_WORLD_SIZE $ROLE_NAME "
                                "$MASTER_ADDR $MASTER_PORT"),
                        {.sink = &sink});
  EXPECT_NE(sink.out.find("[rank2]:2 0 1 2 4 2 2 4 default 127.0.0.1 29123\n"), std::string::npos)
      << sink.out;
  EXPECT_NE(sink.out.find("[rank3]:3 1 1 3 4 2 2 4 default 127.0.0.1 29123\n"), std::string::npos)
      << sink.out;
}

TEST(RankProcessEnvironment, IsTheBaseWithTheRankVariablesOmpAndTheGpu) {
  fl::Options o{.nproc = 2, .max_restarts = 3};
  o.env = {{"EXTRA", "x"}};
  auto place = fl::resolve_placement(o.nodes, o.nproc, {});
  fl::EnvMap base = {{"PATH", "/bin"}, {fl::detail::kEntryVariable, "inherited"}, {"RANK", "9"}};
  auto env = fl::rank_process_environment(base, place, 1, 2, o, "GPU-1");
  EXPECT_EQ(env.count(fl::detail::kEntryVariable), 0u) << "an inherited entry is not this rank's";
  EXPECT_EQ(env["PATH"], "/bin");
  EXPECT_EQ(env["RANK"], "1");
  EXPECT_EQ(env["EXTRA"], "x");
  EXPECT_EQ(env["OMP_NUM_THREADS"], "1");
  EXPECT_EQ(env["CUDA_VISIBLE_DEVICES"], "GPU-1");
  EXPECT_EQ(env["TORCHELASTIC_RESTART_COUNT"], "2");
  EXPECT_EQ(env["TORCHELASTIC_MAX_RESTARTS"], "3");
  base["OMP_NUM_THREADS"] = "8";
  EXPECT_EQ(fl::rank_process_environment(base, place, 0, 0, o, std::nullopt)["OMP_NUM_THREADS"],
            "8");
  EXPECT_EQ(fl::rank_process_environment(base, place, 0, 0, o, std::nullopt)
                .count("CUDA_VISIBLE_DEVICES"),
            0u);
}

}  // namespace
