// CUDA_VISIBLE_DEVICES: parse_visible_devices on any bytes, then resolved against a fixed
// inventory of four GPUs (two sharing a UUID prefix), as `forkguard doctor` does.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "forkguard/cuda/visible_devices.hpp"
#include "forkguard/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace forkguard::cuda;
  static const std::vector<GpuInfo> gpus = {
      {0, "NVIDIA H100", "GPU-5b1e0c6a-aaaa-bbbb-cccc-000000000000", 0},
      {1, "NVIDIA H100", "GPU-5b1e0c6a-aaaa-bbbb-cccc-000000000001", 1},
      {2, "NVIDIA A100", "GPU-77f0e3d2-1111-2222-3333-444444444444", 2},
      {3, "NVIDIA A100", "", 3},
  };
  const std::string_view value(reinterpret_cast<const char*>(data), size);
  try {
    const VisibleDevices vis = parse_visible_devices(value);
    const VisibleResolution res = resolve_visible_devices(vis, gpus);
    if (res.visible.size() > gpus.size()) std::abort();  // a GPU shown twice
  } catch (const forkguard::Error&) {
  }
  return 0;
}
