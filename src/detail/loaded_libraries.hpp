// Which shared objects this process has mapped, from the dynamic loader (dl_iterate_phdr).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace forkguard::detail {

// Paths of every object the dynamic loader has loaded, in load order (the main program excluded).
std::vector<std::string> loaded_libraries();
// The path of the object behind a dlopen handle.
std::optional<std::string> loaded_path_of(void* handle);

std::string_view basename_of(std::string_view path);
// libcuda.so, libcuda.so.1, libcuda.so.550.54.15 (the real driver or the test driver).
bool is_cuda_driver_library(std::string_view path);
// Whether a CUDA driver is mapped here: the loaded_libraries() walk without copying a name
// (a few microseconds with PyTorch's 300 libraries mapped, not 40).
bool cuda_driver_mapped();

// libgomp.so.1, libgomp.so.1.0.0, libgomp-a34b3233.so.1 (a wheel's hashed copy): GNU OpenMP.
bool is_gnu_openmp_library(std::string_view path);

// The libraries whose state does not survive fork, as one loader walk finds them.
struct ForkHazardLibraries {
  bool cuda_driver = false;
  bool gnu_openmp = false;
};
ForkHazardLibraries fork_hazard_libraries();

// [start, end) of each executable segment of the GNU OpenMP libraries mapped here.
struct CodeRange {
  std::uintptr_t start = 0;
  std::uintptr_t end = 0;
};
std::vector<CodeRange> gnu_openmp_code();

}  // namespace forkguard::detail
