// launch::Options: everything a launch can be told, as one aggregate with a default per field.
//
//   forkguard::launch::Options opts{.nproc = 4, .start =
//   forkguard::launch::StartMethod::kForkServer}; opts.gpus.bind = true;                  // each
//   rank its own GPU via CUDA_VISIBLE_DEVICES opts.stop.grace = std::chrono::seconds(5);
//
// Thread-safety: plain values.
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace forkguard::launch {

enum class StartMethod {
  kSpawn,       // fork+exec of a command, or re-exec of /proc/self/exe for a registered entry
  kForkServer,  // fork from the zygote that forkguard::init() started while the process was clean
  kFork,        // plain fork, only when probe::self() says this process is fork-safe
  kAuto,        // kFork when clean, else kForkServer, else kSpawn; says which once
};

enum class DirtyParent {
  kRefuse,    // kFork in a CUDA-initialized process throws DirtyForkError
  kFallBack,  // ... or falls back to the fork server / spawn, with one notice
};

// What happens to the other ranks when one fails, and to all on SIGINT/SIGTERM/SIGHUP.
struct StopPolicy {
  int signal = 15;                          // sent first (SIGTERM)
  std::chrono::milliseconds grace{30'000};  // then SIGKILL after this long
};

struct LogPolicy {
  bool prefix = true;                // console lines prefixed "[rankN]:" (torchrun --tee style)
  std::string log_dir{};             // when set, DIR/<restart>/rank<N>.{stdout,stderr}
  std::vector<int> console_ranks{};  // local ranks shown on the console (empty: all)
  size_t stderr_tail_lines = 10;     // last stderr lines kept per rank for the failure report
};

struct GpuPlanOptions {
  bool bind = false;           // each rank gets one visible GPU through CUDA_VISIBLE_DEVICES
  bool allow_sharing = false;  // with bind: more ranks than GPUs share them round-robin
};

// Several machines: torchrun's static rendezvous variables; forkguard does not invent one.
struct NodeOptions {
  std::optional<int> nnodes{};       // default 1, or from Slurm / MPI / PMI when started under them
  std::optional<int> node_rank{};    // default 0, or from Slurm / MPI / PMI
  std::string master_addr{};         // default 127.0.0.1
  std::optional<int> master_port{};  // default 29500
  bool standalone = false;           // pick a free port on loopback (single node)
};

struct Options {
  int nproc = 1;               // ranks on this node
  bool nproc_per_gpu = false;  // instead: one rank per visible GPU (NVML or /proc, never CUDA)
  StartMethod start = StartMethod::kAuto;              // how ranks are started
  DirtyParent dirty_parent = DirtyParent::kRefuse;     // kFork in a dirty process
  GpuPlanOptions gpus{};                               // GPU assignment
  NodeOptions nodes{};                                 // multi-node placement
  std::map<std::string, std::string> env{};            // extra variables for every rank
  LogPolicy log{};                                     // output handling
  StopPolicy stop{};                                   // stop escalation
  int max_restarts = 0;                                // group restarts after a failure
  std::optional<std::chrono::milliseconds> timeout{};  // whole job, each attempt
  bool quiet = false;                                  // no notices on stderr
};

std::string to_string(StartMethod m);
std::optional<StartMethod> parse_start_method(const std::string& s);

}  // namespace forkguard::launch
