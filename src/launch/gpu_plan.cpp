#include "forkguard/launch/gpu_plan.hpp"

#include <fmt/format.h>

namespace forkguard::launch {
namespace {

// The identifiers a rank's CUDA_VISIBLE_DEVICES should hold: what the user wrote (index, UUID or
// MIG id) for every entry the driver would keep, in order.
std::vector<std::string> visible_ids(const cuda::GpuInventory& inv, const cuda::VisibleDevices& vis,
                                     const cuda::VisibleResolution& res) {
  std::vector<std::string> ids;
  if (!vis.set) {
    for (const auto& g : inv.gpus) ids.push_back(std::to_string(g.index));
    return ids;
  }
  // resolve_visible_devices keeps a prefix of the entries (MIG ones included), in order.
  size_t keep = res.visible.size() + static_cast<size_t>(res.mig_instances);
  for (size_t i = 0; i < vis.selectors.size() && ids.size() < keep; ++i) {
    ids.push_back(vis.selectors[i].text);
  }
  return ids;
}

}  // namespace

int count_visible_gpus(const cuda::GpuInventory& inventory, const cuda::VisibleDevices& visible) {
  auto res = cuda::resolve_visible_devices(visible, inventory.gpus);
  return static_cast<int>(res.visible.size()) + res.mig_instances;
}

GpuPlan plan_gpus(const GpuPlanOptions& options, int nproc, const cuda::GpuInventory& inventory,
                  const cuda::VisibleDevices& visible) {
  auto res = cuda::resolve_visible_devices(visible, inventory.gpus);
  auto ids = visible_ids(inventory, visible, res);
  GpuPlan plan;
  plan.visible = static_cast<int>(ids.size());
  plan.description =
      fmt::format("{} GPU{} visible ({} from {}; CUDA_VISIBLE_DEVICES{})", plan.visible,
                  plan.visible == 1 ? "" : "s", inventory.gpus.size(), inventory.source,
                  visible.set ? "=\"" + visible.value + "\"" : std::string(" unset"));
  plan.rank_visible_devices.resize(static_cast<size_t>(nproc));
  if (!options.bind) return plan;
  if (plan.visible == 0) {
    throw GpuPlanError(fmt::format("gpus.bind: no GPU is visible: {}", plan.description));
  }
  if (nproc > plan.visible && !options.allow_sharing) {
    throw GpuPlanError(fmt::format(
        "gpus.bind with {} ranks per node needs {} GPUs, but only {} {} visible ({} from {}; "
        "CUDA_VISIBLE_DEVICES{}). Use fewer ranks, or gpus.allow_sharing to share GPUs "
        "round-robin.",
        nproc, nproc, plan.visible, plan.visible == 1 ? "is" : "are", inventory.gpus.size(),
        inventory.source, visible.set ? "=\"" + visible.value + "\"" : std::string(" unset")));
  }
  for (int r = 0; r < nproc; ++r) {
    plan.rank_visible_devices[static_cast<size_t>(r)] = ids[static_cast<size_t>(r) % ids.size()];
  }
  return plan;
}

}  // namespace forkguard::launch
