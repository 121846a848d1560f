// Where this node sits in the job, and the environment each rank gets (torchrun's contract).
//
//   auto place = forkguard::launch::resolve_placement(opts.nodes, opts.nproc, current_env());
//   auto env = forkguard::launch::rank_environment(place, local_rank, restart, opts);
//
// Placement comes from the options first, then from Slurm (SLURM_NNODES, SLURM_NODEID), Open MPI
// (OMPI_COMM_WORLD_SIZE/RANK) or PMI (PMI_SIZE/PMI_RANK), so `srun` or `mpirun` place the nodes
// and forkguard fans out the ranks on each.
//
// Thread-safety: pure functions.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "forkguard/launch/options.hpp"

namespace forkguard::launch {

using EnvMap = std::map<std::string, std::string>;

struct Placement {
  int nnodes = 1;
  int node_rank = 0;
  int nproc = 1;  // ranks per node
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "defaults";  // "options", "slurm", "open mpi", "pmi", "defaults"
  int world_size() const { return nnodes * nproc; }
};

// Throws forkguard::Error when the numbers do not fit (node_rank >= nnodes, nproc < 1, ...).
Placement resolve_placement(const NodeOptions& nodes, int nproc, const EnvMap& env);

// The variables forkguard sets for one rank (not the inherited environment).
EnvMap rank_environment(const Placement& place, int local_rank, int restart_count,
                        const Options& options);

EnvMap current_environment();

// A free TCP port on 127.0.0.1 (bound and released; torchrun --standalone does the same).
int free_loopback_port();

}  // namespace forkguard::launch
