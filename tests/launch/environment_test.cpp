#include "forkguard/launch/environment.hpp"

#include "forkguard/error.hpp"

#include <gtest/gtest.h>

namespace fl = forkguard::launch;

TEST(Placement, DefaultsToOneNode) {
  auto p = fl::resolve_placement({}, 4, {});
  EXPECT_EQ(p.nnodes, 1);
  EXPECT_EQ(p.node_rank, 0);
  EXPECT_EQ(p.world_size(), 4);
  EXPECT_EQ(p.master_addr, "127.0.0.1");
  EXPECT_EQ(p.master_port, 29500);
  EXPECT_EQ(p.source, "defaults");
}

TEST(Placement, SlurmThenOpenMpiThenPmi) {
  auto slurm = fl::resolve_placement({}, 2,
                                     {{"SLURM_NNODES", "3"},
                                      {"SLURM_NODEID", "2"},
                                      {"OMPI_COMM_WORLD_SIZE", "9"},
                                      {"OMPI_COMM_WORLD_RANK", "8"}});
  EXPECT_EQ(slurm.source, "slurm");
  EXPECT_EQ(slurm.nnodes, 3);
  EXPECT_EQ(slurm.node_rank, 2);
  auto mpi =
      fl::resolve_placement({}, 2, {{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "1"}});
  EXPECT_EQ(mpi.source, "open mpi");
  EXPECT_EQ(mpi.node_rank, 1);
  EXPECT_EQ(mpi.world_size(), 4);
  auto pmi = fl::resolve_placement({}, 1, {{"PMI_SIZE", "4"}, {"PMI_RANK", "3"}});
  EXPECT_EQ(pmi.source, "pmi");
  EXPECT_EQ(pmi.node_rank, 3);
}

TEST(Placement, OptionsWinOverTheScheduler) {
  fl::NodeOptions n;
  n.nnodes = 2;
  n.node_rank = 0;
  n.master_addr = "node0";
  n.master_port = 1234;
  auto p = fl::resolve_placement(n, 8, {{"SLURM_NNODES", "3"}, {"SLURM_NODEID", "2"}});
  EXPECT_EQ(p.source, "options");
  EXPECT_EQ(p.nnodes, 2);
  EXPECT_EQ(p.master_addr, "node0");
  EXPECT_EQ(p.master_port, 1234);
}

TEST(Placement, MasterFromTheEnvironmentWhenNotGiven) {
  auto p = fl::resolve_placement({}, 1, {{"MASTER_ADDR", "head"}, {"MASTER_PORT", "777"}});
  EXPECT_EQ(p.master_addr, "head");
  EXPECT_EQ(p.master_port, 777);
}

TEST(Placement, BadNumbersAreErrorsNamingThem) {
  fl::NodeOptions n;
  n.nnodes = 2;
  n.node_rank = 2;
  EXPECT_THROW(fl::resolve_placement(n, 1, {}), forkguard::Error);
  EXPECT_THROW(fl::resolve_placement({}, 0, {}), forkguard::Error);
  try {
    fl::resolve_placement({}, 1, {{"SLURM_NNODES", "x"}, {"SLURM_NODEID", "0"}});
    FAIL();
  } catch (const forkguard::Error& e) {
    EXPECT_STREQ(e.what(), "SLURM_NNODES=x is not a valid number");
  }
}

TEST(Placement, StandalonePicksAFreeLoopbackPort) {
  fl::NodeOptions n;
  n.standalone = true;
  auto p = fl::resolve_placement(n, 2, {});
  EXPECT_GT(p.master_port, 0);
  EXPECT_NE(p.master_port, 29500);
}

TEST(RankEnvironment, FollowsTorchrunsContract) {
  fl::Placement p;
  p.nnodes = 2;
  p.node_rank = 1;
  p.nproc = 4;
  p.master_addr = "head";
  p.master_port = 555;
  fl::Options o;
  o.max_restarts = 3;
  o.env = {{"EXTRA", "yes"}};
  auto env = fl::rank_environment(p, 2, 1, o);
  const std::map<std::string, std::string> want = {{"RANK", "6"},
                                                   {"LOCAL_RANK", "2"},
                                                   {"GROUP_RANK", "1"},
                                                   {"ROLE_RANK", "6"},
                                                   {"WORLD_SIZE", "8"},
                                                   {"LOCAL_WORLD_SIZE", "4"},
                                                   {"GROUP_WORLD_SIZE", "2"},
                                                   {"ROLE_WORLD_SIZE", "8"},
                                                   {"ROLE_NAME", "default"},
                                                   {"MASTER_ADDR", "head"},
                                                   {"MASTER_PORT", "555"},
                                                   {"TORCHELASTIC_RESTART_COUNT", "1"},
                                                   {"TORCHELASTIC_MAX_RESTARTS", "3"},
                                                   {"TORCHELASTIC_RUN_ID", "none"},
                                                   {"EXTRA", "yes"}};
  EXPECT_EQ(env, want);
}
