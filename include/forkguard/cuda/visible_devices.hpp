// CUDA_VISIBLE_DEVICES, parsed and resolved against the GPU inventory as the driver does.
//
//   auto vis = forkguard::cuda::parse_visible_devices(getenv("CUDA_VISIBLE_DEVICES"));
//   auto res = forkguard::cuda::resolve_visible_devices(vis,
//   forkguard::cuda::discover_gpus().gpus); for (auto& p : res.problems) fmt::print("warning:
//   {}\n", p);
//
// The driver's rules: entries are comma-separated indices, `GPU-` UUIDs (a unique prefix is
// enough) or `MIG-` identifiers; the first entry that is invalid, out of range, unknown or
// repeated hides itself and every entry after it; an empty value hides every GPU; unset shows all.
//
// Thread-safety: pure functions.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "forkguard/cuda/nvml.hpp"

namespace forkguard::cuda {

struct DeviceSelector {
  enum class Kind { kIndex, kUuid, kMig, kInvalid };
  Kind kind = Kind::kInvalid;
  int index = -1;    // for kIndex
  std::string text;  // the entry as written, trimmed
};

struct VisibleDevices {
  bool set = false;                       // the variable is present in the environment
  std::string value;                      // its raw value
  std::vector<DeviceSelector> selectors;  // every entry, in order (invalid ones included)
};

struct VisibleResolution {
  std::vector<GpuInfo> visible;       // the GPUs CUDA will show, in CUDA's order
  std::vector<std::string> problems;  // entries the driver will ignore, and why
  bool uses_mig = false;              // some entry is a MIG instance (not checked against NVML)
  int mig_instances = 0;              // number of MIG entries kept
};

VisibleDevices parse_visible_devices(std::optional<std::string_view> value);
VisibleDevices visible_devices_from_env();
VisibleResolution resolve_visible_devices(const VisibleDevices& vis,
                                          const std::vector<GpuInfo>& gpus);

}  // namespace forkguard::cuda
