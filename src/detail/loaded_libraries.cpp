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

}  // namespace forkguard::detail
