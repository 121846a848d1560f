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
                                      {"SLURM_STEP_ID", "0"},
                                      {"OMPI_COMM_WORLD_SIZE", "9"},
                                      {"OMPI_COMM_WORLD_RANK", "8"}});
  EXPECT_EQ(slurm.source, "slurm");
  EXPECT_EQ(slurm.nnodes, 3);
  EXPECT_EQ(slurm.node_rank, 2);
  auto mpi = fl::resolve_placement({}, 2,
                                   {{"OMPI_COMM_WORLD_SIZE", "2"},
                                    {"OMPI_COMM_WORLD_RANK", "1"},
                                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(mpi.source, "open mpi");
  EXPECT_EQ(mpi.node_rank, 1);
  EXPECT_EQ(mpi.world_size(), 4);
  auto pmi =
      fl::resolve_placement({}, 1, {{"PMI_SIZE", "4"}, {"PMI_RANK", "3"}, {"MASTER_ADDR", "head"}});
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

namespace {

// What srun gives each task of `srun -N 2 --ntasks-per-node 1` in job 4242 (the node's index
// and the step's list; the job's list is the allocation's).
fl::EnvMap srun_task(int node) {
  return {{"SLURM_JOB_ID", "4242"},
          {"SLURM_JOB_NODELIST", "n[1-3]"},
          {"SLURM_NNODES", "3"},
          {"SLURM_STEP_ID", "0"},
          {"SLURM_STEP_NODELIST", "n[2-3]"},
          {"SLURM_STEP_NUM_NODES", "2"},
          {"SLURM_STEP_NUM_TASKS", "2"},
          {"SLURM_NODEID", std::to_string(node)}};
}

std::string placement_error(const fl::NodeOptions& n, const fl::EnvMap& env) {
  try {
    fl::resolve_placement(n, 2, env);
  } catch (const fl::PlacementError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(Placement, UnderSrunTheMasterIsTheFirstHostOfTheStepAndThePortComesFromTheJob) {
  for (int node : {0, 1}) {
    auto p = fl::resolve_placement({}, 2, srun_task(node));
    EXPECT_EQ(p.source, "slurm");
    EXPECT_EQ(p.nnodes, 2) << "the step's nodes, not the allocation's";
    EXPECT_EQ(p.node_rank, node);
    EXPECT_EQ(p.master_addr, "n2");
    EXPECT_EQ(p.master_addr_from, "the first host of SLURM_STEP_NODELIST=n[2-3]");
    EXPECT_EQ(p.master_port, 14242);
  }
  auto env = srun_task(0);
  env.erase("SLURM_STEP_NODELIST");
  EXPECT_EQ(fl::resolve_placement({}, 2, env).master_addr, "n1");
}

TEST(Placement, TheUsersMasterWinsOverSlurms) {
  auto env = srun_task(1);
  env["MASTER_ADDR"] = "head";
  env["MASTER_PORT"] = "777";
  auto p = fl::resolve_placement({}, 2, env);
  EXPECT_EQ(p.master_addr, "head");
  EXPECT_EQ(p.master_port, 777);
  fl::NodeOptions n;
  n.master_addr = "chief";
  n.master_port = 888;
  p = fl::resolve_placement(n, 2, env);
  EXPECT_EQ(p.master_addr, "chief");
  EXPECT_EQ(p.master_port, 888);
  EXPECT_EQ(p.node_rank, 1) << "the node rank still comes from Slurm";
}

TEST(Placement, ABadNodeListIsAnErrorNamingTheVariable) {
  auto env = srun_task(0);
  env["SLURM_STEP_NODELIST"] = "n[1-";
  EXPECT_EQ(placement_error({}, env),
            "SLURM_STEP_NODELIST=\"n[1-\": expected a number in brackets, found the end (at "
            "character 5)");
}

TEST(Placement, SeveralForkguardTasksOnOneSlurmNodeAreRefused) {
  auto env = srun_task(0);
  env["SLURM_STEP_NUM_TASKS"] = "4";
  auto msg = placement_error({}, env);
  EXPECT_NE(msg.find("4 tasks share 2 nodes (SLURM_STEP_NUM_TASKS=4, SLURM_STEP_NUM_NODES=2)"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("srun --ntasks-per-node=1 forkguard run"), std::string::npos) << msg;
}

TEST(Placement, ABatchScriptOfAMultiNodeJobIsNotANode) {
  auto msg = placement_error({}, {{"SLURM_JOB_ID", "7"},
                                  {"SLURM_JOB_NODELIST", "n[1-2]"},
                                  {"SLURM_NNODES", "2"},
                                  {"SLURM_NTASKS", "8"},
                                  {"SLURM_NODEID", "0"}});
  EXPECT_NE(msg.find("batch script of a 2-node Slurm job (SLURM_NNODES=2)"), std::string::npos)
      << msg;
  // A one-node job's batch script is a whole world by itself, on loopback, whatever its tasks.
  auto p = fl::resolve_placement({}, 2,
                                 {{"SLURM_JOB_ID", "7"},
                                  {"SLURM_JOB_NODELIST", "n1"},
                                  {"SLURM_NNODES", "1"},
                                  {"SLURM_NTASKS", "4"},
                                  {"SLURM_NODEID", "0"}});
  EXPECT_EQ(p.master_addr, "127.0.0.1");
  EXPECT_EQ(p.master_port, 10007);
}

TEST(Placement, MultiHostMpiWithoutAMasterIsAnErrorNotLocalhost) {
  auto msg = placement_error({}, {{"OMPI_COMM_WORLD_SIZE", "4"},
                                  {"OMPI_COMM_WORLD_RANK", "1"},
                                  {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_NE(msg.find("started by mpirun (Open MPI) as node 1 of 4 (OMPI_COMM_WORLD_SIZE=4, "
                     "OMPI_COMM_WORLD_LOCAL_SIZE=2)"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("nodes.master_addr = HOST"), std::string::npos) << msg;
  EXPECT_NE(placement_error({}, {{"PMI_SIZE", "2"}, {"PMI_RANK", "0"}}).find("a PMI launcher"),
            std::string::npos);
  fl::NodeOptions n;
  n.master_addr = "head";
  EXPECT_EQ(fl::resolve_placement(n, 2,
                                  {{"OMPI_COMM_WORLD_SIZE", "4"},
                                   {"OMPI_COMM_WORLD_RANK", "1"},
                                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}})
                .master_addr,
            "head");
}

TEST(Placement, AMasterThatDoesNotResolveIsNamedWithItsSource) {
  auto env = srun_task(0);
  env["SLURM_STEP_NODELIST"] = "no-such-node.invalid,n2";
  auto p = fl::resolve_placement({}, 2, env);
  try {
    fl::check_master_addr(p);
    FAIL() << "no-such-node.invalid resolved";
  } catch (const fl::PlacementError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("the master address \"no-such-node.invalid\" (from the first host of "
                       "SLURM_STEP_NODELIST=no-such-node.invalid,n2) does not resolve"),
              std::string::npos)
        << msg;
  }
  p.master_addr = "127.0.0.1";
  EXPECT_NO_THROW(fl::check_master_addr(p));
  p.master_addr = "localhost";
  EXPECT_NO_THROW(fl::check_master_addr(p));
}

TEST(Placement, PortsOutsideTcpAreRefused) {
  EXPECT_NE(placement_error({}, {{"MASTER_PORT", "70000"}})
                .find("master port 70000 (from "
                      "MASTER_PORT) is not a TCP port"),
            std::string::npos);
}
