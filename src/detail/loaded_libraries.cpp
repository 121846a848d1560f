#include "detail/loaded_libraries.hpp"

#include <dlfcn.h>
#include <link.h>

namespace forkguard::detail {

std::vector<std::string> loaded_libraries() {
  std::vector<std::string> out;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        if (info->dlpi_name != nullptr && info->dlpi_name[0] != '\0') {
          static_cast<std::vector<std::string>*>(data)->emplace_back(info->dlpi_name);
        }
        return 0;
      },
      &out);
  return out;
}

std::optional<std::string> loaded_path_of(void* handle) {
  link_map* map = nullptr;
  if (::dlinfo(handle, RTLD_DI_LINKMAP, &map) != 0 || map == nullptr || map->l_name == nullptr) {
    return std::nullopt;
  }
  return std::string(map->l_name);
}

std::string_view basename_of(std::string_view path) {
  auto slash = path.rfind('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

bool is_cuda_driver_library(std::string_view path) {
  auto base = basename_of(path);
  return base.substr(0, 10) == "libcuda.so";
}

bool cuda_driver_mapped() {
  bool found = false;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        if (info->dlpi_name != nullptr && is_cuda_driver_library(info->dlpi_name)) {
          *static_cast<bool*>(data) = true;
          return 1;  // stops the walk
        }
        return 0;
      },
      &found);
  return found;
}

bool is_gnu_openmp_library(std::string_view path) {
  return basename_of(path).substr(0, 7) == "libgomp";
}

ForkHazardLibraries fork_hazard_libraries() {
  ForkHazardLibraries found;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        auto* f = static_cast<ForkHazardLibraries*>(data);
        if (info->dlpi_name == nullptr) return 0;
        const auto base = basename_of(info->dlpi_name);  // once, for both prefixes
        if (base.substr(0, 10) == "libcuda.so") f->cuda_driver = true;
        if (base.substr(0, 7) == "libgomp") f->gnu_openmp = true;
        return f->cuda_driver && f->gnu_openmp ? 1 : 0;
      },
      &found);
  return found;
}

std::vector<CodeRange> gnu_openmp_code() {
  std::vector<CodeRange> out;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        if (info->dlpi_name == nullptr || !is_gnu_openmp_library(info->dlpi_name)) return 0;
        for (ElfW(Half) i = 0; i < info->dlpi_phnum; ++i) {
          const auto& ph = info->dlpi_phdr[i];
          if (ph.p_type != PT_LOAD || (ph.p_flags & PF_X) == 0) continue;
          const std::uintptr_t start = info->dlpi_addr + ph.p_vaddr;
          static_cast<std::vector<CodeRange>*>(data)->push_back({start, start + ph.p_memsz});
        }
        return 0;
      },
      &out);
  return out;
}

}  // namespace forkguard::detail
