#include "forkguard/launch/environment.hpp"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "detail/fd.hpp"
#include "forkguard/error.hpp"
#include "forkguard/launch/hostlist.hpp"
#include "launch/init_state.hpp"

extern char** environ;

namespace forkguard::launch {
namespace {

std::optional<int> int_var(const EnvMap& env, const char* name) {
  auto it = env.find(name);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(it->second.c_str(), &end, 10);
  if (*end != '\0' || errno == ERANGE || v < 0 || v > 1'000'000'000) {
    throw PlacementError(fmt::format("{}={} is not a valid number", name, it->second));
  }
  return static_cast<int>(v);
}

const std::string* str_var(const EnvMap& env, const char* name) {
  auto it = env.find(name);
  return it == env.end() || it->second.empty() ? nullptr : &it->second;
}

// The first of several names that is set, with its name.
std::optional<std::pair<const char*, int>> first_int(const EnvMap& env,
                                                     std::initializer_list<const char*> names) {
  for (const char* n : names) {
    if (auto v = int_var(env, n)) return std::pair{n, *v};
  }
  return std::nullopt;
}

// Under srun each task sees the step's node count and its node's index in the step; in a batch
// script (no step of its own) the job's.
void place_by_slurm(Placement& p, const EnvMap& env) {
  auto nodes = first_int(env, {"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"});
  auto tasks = first_int(env, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"});
  p.nnodes = nodes->second;
  p.node_rank = *int_var(env, "SLURM_NODEID");
  p.source = "slurm";
  if (str_var(env, "SLURM_STEP_ID") == nullptr && str_var(env, "SLURM_STEPID") == nullptr) {
    // The batch script itself: one node is a whole world on loopback; more are not.
    if (p.nnodes > 1) {
      throw PlacementError(fmt::format(
          "this is the batch script of a {}-node Slurm job ({}={}), not a task of a step: "
          "forkguard run here would be node 0 of {} waiting for nodes that never start. Start "
          "it on every node with srun --ntasks-per-node=1 forkguard run ...",
          p.nnodes, nodes->first, p.nnodes, p.nnodes));
    }
    return;
  }
  if (tasks && tasks->second > nodes->second) {
    throw PlacementError(fmt::format(
        "under Slurm, {} tasks share {} node{} ({}={}, {}={}): forkguard run starts every rank "
        "of its node itself, so it must run once per node. Start it with one task per node: "
        "srun --ntasks-per-node=1 forkguard run --nproc-per-node N ... (or #SBATCH "
        "--ntasks-per-node=1)",
        tasks->second, nodes->second, nodes->second == 1 ? "" : "s", tasks->first, tasks->second,
        nodes->first, nodes->second));
  }
}

// A multi-host job started by mpirun (or a PMI launcher) names no host to rendezvous at.
void require_master_for_mpi(const Placement& p, const EnvMap& env) {
  if (p.nnodes < 2) return;
  const char* local = p.source == "open mpi" ? "OMPI_COMM_WORLD_LOCAL_SIZE" : "MPI_LOCALNRANKS";
  const char* size = p.source == "open mpi" ? "OMPI_COMM_WORLD_SIZE" : "PMI_SIZE";
  auto local_size = int_var(env, local);
  if (local_size && *local_size == p.nnodes) return;  // every task on this host: loopback is right
  throw PlacementError(fmt::format(
      "started by {} as node {} of {} ({}={}, {}={}), possibly on several hosts, and no master "
      "address is given: every node would rendezvous at its own 127.0.0.1. Give the host of node "
      "rank 0: nodes.master_addr = HOST (or MASTER_ADDR=HOST, e.g. mpirun -x MASTER_ADDR=HOST "
      "...)",
      p.source == "open mpi" ? "mpirun (Open MPI)" : "a PMI launcher", p.node_rank, p.nnodes, size,
      p.nnodes, local, local_size ? std::to_string(*local_size) : std::string("unset")));
}

}  // namespace

EnvMap current_environment() {
  EnvMap env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return env;
}

Placement resolve_placement(const NodeOptions& nodes, int nproc, const EnvMap& env) {
  Placement p;
  p.nproc = nproc;
  if (nproc < 1) throw PlacementError(fmt::format("nproc must be at least 1, not {}", nproc));
  if (nodes.nnodes || nodes.node_rank) {
    p.nnodes = nodes.nnodes.value_or(1);
    p.node_rank = nodes.node_rank.value_or(0);
    p.source = "options";
  } else if (int_var(env, "SLURM_NODEID") &&
             first_int(env, {"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"})) {
    place_by_slurm(p, env);
  } else {
    struct Source {
      const char* name;
      const char* size;
      const char* rank;
    };
    for (const Source& s : {Source{"open mpi", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"},
                            Source{"pmi", "PMI_SIZE", "PMI_RANK"}}) {
      auto size = int_var(env, s.size);
      auto rank = int_var(env, s.rank);
      if (size && rank) {
        p.nnodes = *size;
        p.node_rank = *rank;
        p.source = s.name;
        break;
      }
    }
  }
  if (p.nnodes < 1)
    throw PlacementError(fmt::format("nnodes must be at least 1, not {}", p.nnodes));
  if (p.node_rank < 0 || p.node_rank >= p.nnodes) {
    throw PlacementError(fmt::format("node rank {} is outside 0..{} (nnodes {}, from {})",
                                     p.node_rank, p.nnodes - 1, p.nnodes, p.source));
  }
  if (static_cast<long>(p.nnodes) * nproc > 1'000'000) {
    throw PlacementError(
        fmt::format("{} nodes of {} ranks make a world larger than a million", p.nnodes, nproc));
  }

  if (!nodes.master_addr.empty()) {
    p.master_addr = nodes.master_addr;
    p.master_addr_from = "nodes.master_addr";
  } else if (const auto* addr = str_var(env, "MASTER_ADDR")) {
    p.master_addr = *addr;
    p.master_addr_from = "MASTER_ADDR";
  } else if (p.source == "slurm" && p.nnodes > 1) {
    for (const char* var : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
      if (const auto* list = str_var(env, var)) {
        try {
          p.master_addr = HostList::parse(*list, var).first();
        } catch (const HostListError& e) {
          throw PlacementError(e.what());
        }
        p.master_addr_from = fmt::format("the first host of {}={}", var, *list);
        break;
      }
    }
  } else if (p.source == "open mpi" || p.source == "pmi") {
    require_master_for_mpi(p, env);
  }

  if (nodes.standalone) {
    if (p.nnodes != 1) {
      throw PlacementError("nodes.standalone is for a single node, but nnodes is " +
                           std::to_string(p.nnodes));
    }
    p.master_port = nodes.master_port.value_or(free_loopback_port());
    p.master_port_from = nodes.master_port ? "nodes.master_port" : "a free port (nodes.standalone)";
  } else if (nodes.master_port) {
    p.master_port = *nodes.master_port;
    p.master_port_from = "nodes.master_port";
  } else if (auto port = int_var(env, "MASTER_PORT")) {
    p.master_port = *port;
    p.master_port_from = "MASTER_PORT";
  } else if (p.source == "slurm") {
    if (auto job = first_int(env, {"SLURM_JOB_ID", "SLURM_JOBID"})) {
      // The common recipe: stable on every node of the job, different for concurrent jobs
      // (unless their ids end in the same four digits).
      p.master_port = 10000 + job->second % 10000;
      p.master_port_from = fmt::format("10000 + {}={} modulo 10000", job->first, job->second);
    }
  }
  if (p.master_port < 1 || p.master_port > 65535) {
    throw PlacementError(fmt::format("master port {} (from {}) is not a TCP port (1-65535)",
                                     p.master_port, p.master_port_from));
  }
  return p;
}

void check_master_addr(const Placement& place) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(place.master_addr.c_str(), nullptr, &hints, &res);
  if (rc == 0) {
    ::freeaddrinfo(res);
    return;
  }
  throw PlacementError(fmt::format(
      "the master address \"{}\" (from {}) does not resolve: {}. Every rank would fail to "
      "rendezvous there; give a host that resolves on every node: nodes.master_addr = HOST or "
      "MASTER_ADDR=HOST",
      place.master_addr, place.master_addr_from,
      rc == EAI_SYSTEM ? std::strerror(errno) : ::gai_strerror(rc)));
}

EnvMap rank_environment(const Placement& place, int local_rank, int restart_count,
                        const Options& options) {
  const int rank = place.rank_of(local_rank);
  EnvMap env = options.env;
  auto set = [&env](const char* k, auto v) { env[k] = fmt::format("{}", v); };
  set("RANK", rank);
  set("LOCAL_RANK", local_rank);
  set("GROUP_RANK", place.node_rank);
  set("ROLE_RANK", rank);
  set("WORLD_SIZE", place.world_size());
  set("LOCAL_WORLD_SIZE", place.nproc);
  set("GROUP_WORLD_SIZE", place.nnodes);
  set("ROLE_WORLD_SIZE", place.world_size());
  set("ROLE_NAME", "default");
  set("MASTER_ADDR", place.master_addr);
  set("MASTER_PORT", place.master_port);
  set("TORCHELASTIC_RESTART_COUNT", restart_count);
  set("TORCHELASTIC_MAX_RESTARTS", options.max_restarts);
  set("TORCHELASTIC_RUN_ID", "none");
  return env;
}

EnvMap rank_process_environment(EnvMap base, const Placement& place, int local_rank,
                                int restart_count, const Options& options,
                                const std::optional<std::string>& visible_devices) {
  EnvMap env = std::move(base);
  env.erase(
      launch::detail::kEntryVariable);  // set again by the spawn starter, for its own ranks only
  for (auto& [k, v] : rank_environment(place, local_rank, restart_count, options)) env[k] = v;
  if (options.nproc > 1 && env.count("OMP_NUM_THREADS") == 0) env["OMP_NUM_THREADS"] = "1";
  if (visible_devices) env["CUDA_VISIBLE_DEVICES"] = *visible_devices;
  return env;
}

int free_loopback_port() {
  forkguard::detail::UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) throw SystemError("socket(AF_INET)", errno);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    throw SystemError("bind(127.0.0.1:0)", errno);
  }
  socklen_t len = sizeof addr;
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw SystemError("getsockname", errno);
  }
  return ntohs(addr.sin_port);
}

}  // namespace forkguard::launch
