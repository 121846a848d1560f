// Where this node sits in the job, and the environment each rank gets (torchrun's contract).
//
//   auto place = forkguard::launch::resolve_placement(opts.nodes, opts.nproc, current_env());
//   auto env = forkguard::launch::rank_environment(place, local_rank, restart, opts);
//
// Placement comes from the options first, then from Slurm (SLURM_NODEID of SLURM_STEP_NUM_NODES or
// SLURM_NNODES), Open MPI (OMPI_COMM_WORLD_SIZE/RANK) or PMI (PMI_SIZE/PMI_RANK), so `srun` or
// `mpirun` place the nodes and forkguard fans out the ranks on each (one forkguard per node).
//
// MASTER_ADDR: --master-addr, else MASTER_ADDR, else under Slurm the first host of the step's node
// list (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST), else 127.0.0.1 for a single host. Under
// mpirun or PMI across several hosts there is no list to take it from: an error, never a silent
// localhost. MASTER_PORT: --master-port, else MASTER_PORT, else under Slurm 10000 + the job id
// modulo 10000 (the same on every node of the job), else 29500.
//
// Thread-safety: pure functions.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "forkguard/error.hpp"
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
  std::string master_addr_from = "the default";  // where master_addr came from, for messages
  std::string master_port_from = "the default";
  int world_size() const { return nnodes * nproc; }
  // The rank formula, the one place it is written: node after node, local ranks in order.
  int rank_of(int local_rank) const { return node_rank * nproc + local_rank; }
};

// The job's placement does not fit together: numbers out of range, several forkguard tasks on
// one Slurm node, a multi-host MPI job without a master address, a host that does not resolve.
class PlacementError : public Error {
 public:
  using Error::Error;
};

// Throws PlacementError when the numbers do not fit (node_rank >= nnodes, nproc < 1, ...).
// Pure: reads only `env`, resolves no name.
Placement resolve_placement(const NodeOptions& nodes, int nproc, const EnvMap& env);

// Throws PlacementError naming the host and where it came from when master_addr does not
// resolve (getaddrinfo), so a typo or an unreachable name server fails before any rank starts.
void check_master_addr(const Placement& place);

// The variables forkguard sets for one rank (not the inherited environment).
EnvMap rank_environment(const Placement& place, int local_rank, int restart_count,
                        const Options& options);

// The whole environment of one rank, for every start method and for notebook_launch alike:
// `base` (this process's environment, current_environment()) without forkguard's own entry
// variable, then rank_environment(), then OMP_NUM_THREADS=1 when it is still unset and nproc > 1,
// then CUDA_VISIBLE_DEVICES=`visible_devices` when the GPU plan gives the rank its own.
EnvMap rank_process_environment(EnvMap base, const Placement& place, int local_rank,
                                int restart_count, const Options& options,
                                const std::optional<std::string>& visible_devices);

EnvMap current_environment();

// A free TCP port on 127.0.0.1 (bound and released; torchrun --standalone does the same).
int free_loopback_port();

}  // namespace forkguard::launch
