// Which GPU each rank gets, decided without touching CUDA (NVML or /proc, then
// CUDA_VISIBLE_DEVICES as the driver reads it).
//
//   auto plan = forkguard::launch::plan_gpus(opts.gpus, opts.nproc, cuda::discover_gpus(),
//                                            cuda::visible_devices_from_env());
//   plan.rank_visible_devices[r]   // the CUDA_VISIBLE_DEVICES value for local rank r, if bound
//
// Thread-safety: pure functions.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "forkguard/cuda/nvml.hpp"
#include "forkguard/cuda/visible_devices.hpp"
#include "forkguard/error.hpp"
#include "forkguard/launch/options.hpp"

namespace forkguard::launch {

struct GpuPlan {
  int visible = 0;          // GPUs CUDA will show this node's ranks
  std::string description;  // "2 GPUs from nvml (...), CUDA_VISIBLE_DEVICES unset"
  std::vector<std::optional<std::string>> rank_visible_devices;  // per local rank, when bound
};

// More ranks than GPUs with bind (and no sharing): thrown before anything starts.
class GpuPlanError : public Error {
 public:
  using Error::Error;
};

GpuPlan plan_gpus(const GpuPlanOptions& options, int nproc, const cuda::GpuInventory& inventory,
                  const cuda::VisibleDevices& visible);

// The number of visible GPUs (for `--nproc-per-node gpu`).
int count_visible_gpus(const cuda::GpuInventory& inventory, const cuda::VisibleDevices& visible);

}  // namespace forkguard::launch
