// /proc readers: the bytes as the text of /proc/PID/maps, /proc/PID/stat, /proc/PID/environ and
// /proc/PID/task/TID/syscall, and as an fd link's target, through the parsers the probe uses on
// the real files.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "probe/proc_reader.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace forkguard::probe::detail;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  for (const auto& path : parse_maps(text)) {
    if (path.empty() || path[0] != '/') std::abort();
  }
  for (const auto& m : parse_exec_mappings(text)) {
    if (m.end <= m.start || m.path.empty() || m.path[0] != '/') std::abort();
  }
  if (auto s = parse_syscall(text); s && s->running && s->pc != 0) std::abort();
  (void)parse_stat_parent(text);
  for (const auto& var : parse_environ(text)) {
    if (var.empty()) std::abort();
  }
  if (strip_deleted(std::string(text)).size() > size) std::abort();
  return 0;
}
