#include "forkguard/launch/environment.hpp"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include "detail/fd.hpp"
#include "forkguard/error.hpp"

extern char** environ;

namespace forkguard::launch {
namespace {

std::optional<int> int_var(const EnvMap& env, const char* name) {
  auto it = env.find(name);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  char* end = nullptr;
  long v = std::strtol(it->second.c_str(), &end, 10);
  if (*end != '\0' || v < 0 || v > 1'000'000) {
    throw Error(fmt::format("{}={} is not a valid number", name, it->second));
  }
  return static_cast<int>(v);
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
  if (nproc < 1) throw Error(fmt::format("nproc must be at least 1, not {}", nproc));
  struct Source {
    const char* name;
    const char* size;
    const char* rank;
  };
  const Source sources[] = {{"slurm", "SLURM_NNODES", "SLURM_NODEID"},
                            {"open mpi", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"},
                            {"pmi", "PMI_SIZE", "PMI_RANK"}};
  if (nodes.nnodes || nodes.node_rank) {
    p.nnodes = nodes.nnodes.value_or(1);
    p.node_rank = nodes.node_rank.value_or(0);
    p.source = "options";
  } else {
    for (const auto& s : sources) {
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
  if (p.nnodes < 1) throw Error(fmt::format("nnodes must be at least 1, not {}", p.nnodes));
  if (p.node_rank < 0 || p.node_rank >= p.nnodes) {
    throw Error(fmt::format("node rank {} is outside 0..{} (nnodes {}, from {})", p.node_rank,
                            p.nnodes - 1, p.nnodes, p.source));
  }
  if (!nodes.master_addr.empty()) p.master_addr = nodes.master_addr;
  if (nodes.standalone) {
    if (p.nnodes != 1)
      throw Error("--standalone is for a single node, but nnodes is " + std::to_string(p.nnodes));
    p.master_port = nodes.master_port.value_or(free_loopback_port());
  } else if (nodes.master_port) {
    p.master_port = *nodes.master_port;
  } else if (auto port = int_var(env, "MASTER_PORT")) {
    p.master_port = *port;
  }
  if (nodes.master_addr.empty()) {
    if (auto it = env.find("MASTER_ADDR"); it != env.end() && !it->second.empty()) {
      p.master_addr = it->second;
    }
  }
  return p;
}

EnvMap rank_environment(const Placement& place, int local_rank, int restart_count,
                        const Options& options) {
  const int rank = place.node_rank * place.nproc + local_rank;
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

int free_loopback_port() {
  detail::UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
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
