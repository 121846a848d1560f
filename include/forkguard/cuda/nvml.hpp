// NVML (libnvidia-ml.so.1), loaded at run time, and the GPU inventory built from it.
//
//   auto inv = forkguard::cuda::discover_gpus();   // never throws; says where it looked
//   for (const auto& g : inv.gpus) fmt::print("{} {} {}\n", g.index, g.name, g.uuid);
//
// NVML opens /dev/nvidiactl and /dev/nvidiaN but creates no CUDA context and does not make fork
// unsafe, which is why forkguard uses it (and never the CUDA driver) to count GPUs. Without
// NVML, /proc/driver/nvidia/gpus/*/information is read instead.
// The library is `FORKGUARD_NVML_LIBRARY` when set, else `libnvidia-ml.so.1`.
//
// Thread-safety: discover_gpus() may be called from any thread; each call initializes and shuts
// down NVML (NVML reference-counts nvmlInit/nvmlShutdown).
#pragma once

#include <string>
#include <vector>

namespace forkguard::cuda {

struct GpuInfo {
  int index = 0;     // NVML / PCI order index, as CUDA_VISIBLE_DEVICES indices mean it
  std::string name;  // "NVIDIA H100 80GB HBM3"
  std::string uuid;  // "GPU-5b1e..." (empty when the source does not know it)
  int minor = -1;    // /dev/nvidiaN number, -1 when unknown
};

struct GpuInventory {
  std::string source;              // "nvml (PATH)", "/proc/driver/nvidia/gpus" or "none"
  std::string driver_version;      // "550.54.15", empty when unknown
  int cuda_driver_version = 0;     // 12040 for CUDA 12.4, 0 when unknown
  std::vector<GpuInfo> gpus;       // in index order
  std::vector<std::string> notes;  // why a source was not used ("libnvidia-ml.so.1: not found")
};

// Lists the GPUs without touching the CUDA driver. Never throws.
GpuInventory discover_gpus();

// The library discover_gpus() tries first: FORKGUARD_NVML_LIBRARY, else "libnvidia-ml.so.1".
std::string nvml_library_name();

}  // namespace forkguard::cuda
