// Where the build put the programs and the test driver (set by tests/CMakeLists.txt).
#pragma once

#include <string>

#include "process.hpp"

namespace forkguard::testing {

inline const std::string kFakeCudaDir = FORKGUARD_FAKE_CUDA_DIR;
inline const std::string kFakeCuda = kFakeCudaDir + "/libcuda.so.1";
inline const std::string kFakeNvml = kFakeCudaDir + "/libnvidia-ml.so.1";
inline const std::string kForkguard = FORKGUARD_BIN_DIR "/forkguard";
inline const std::string kCudaStage = FORKGUARD_HELPER_DIR "/cuda_stage";
inline const std::string kNotebookStyle = FORKGUARD_BIN_DIR "/notebook_style";

// The environment that points forkguard and the helpers at the test driver, with device files
// and the call log in `dir`.
inline EnvOverrides fake_cuda_env(const std::string& dir) {
  return {{"FORKGUARD_CUDA_DRIVER", kFakeCuda}, {"FORKGUARD_NVML_LIBRARY", kFakeNvml},
          {"FAKE_CUDA_DEV_DIR", dir + "/dev"},  {"FAKE_CUDA_LOG", dir + "/calls.log"},
          {"FAKE_CUDA_DEVICES", std::nullopt},  {"CUDA_VISIBLE_DEVICES", std::nullopt}};
}

}  // namespace forkguard::testing
