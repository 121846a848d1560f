// forkguard doctor: the probe's verdict, its evidence, the cure that fits it, and the GPU
// environment (driver version, GPUs from NVML, CUDA_VISIBLE_DEVICES), as text or JSON.
//
//   auto report = forkguard::doctor::diagnose(forkguard::probe::pid(1234));
//   std::cout << forkguard::doctor::to_text(report);
//   return forkguard::doctor::exit_code(report);   // 0 fork-safe, 3 not, 4 unknown
//
// "unknown" is a fork-safe verdict with hazards the probe could not see (the state's
// unseen_hazards: from another process, torch's own fork poison, or GNU OpenMP's pool where the
// threads' syscall files cannot be read): the verdict line says "fork safety unknown: ...".
//
// The environment is gathered in the calling process through NVML, which never makes fork
// unsafe; the probed process's own CUDA_VISIBLE_DEVICES is used when it is another process.
//
// Thread-safety: diagnose() may run on any thread; reports are plain values.
#pragma once

#include <string>
#include <vector>

#include "forkguard/cuda/nvml.hpp"
#include "forkguard/cuda/visible_devices.hpp"
#include "forkguard/probe/cuda_state.hpp"

namespace forkguard::doctor {

struct Options {
  bool environment = true;  // gather the GPU inventory (NVML or /proc) and CUDA_VISIBLE_DEVICES
};

struct Report {
  probe::CudaState state;
  std::string summary;              // one sentence: what the verdict means for fork
  std::vector<std::string> advice;  // the cures that fit the verdict, most direct first
  bool environment_checked = false;
  cuda::GpuInventory gpus;
  cuda::VisibleDevices visible;
  cuda::VisibleResolution resolution;
};

Report diagnose(probe::CudaState state, const Options& options = {});
std::string to_text(const Report& report);
// One object, pretty-printed; bytes that are not UTF-8 (an environment value, a file name) are
// written as U+FFFD.
std::string to_json(const Report& report);
// 0 when fork is safe, 3 when it is not, 4 when what was seen is safe but a hazard was unseen.
int exit_code(const Report& report);

inline constexpr int kExitForkSafe = 0;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitForkUnsafe = 3;
inline constexpr int kExitForkUnknown = 4;

}  // namespace forkguard::doctor
