// Slurm host lists (SLURM_JOB_NODELIST): HostList::parse on any bytes, then its invariants: the
// count parse() gives is the number of hosts expand() makes (checked when small enough to expand
// quickly), and first() is expand()'s first host.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "forkguard/launch/hostlist.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using forkguard::launch::HostList;
  const std::string_view list(reinterpret_cast<const char*>(data), size);
  try {
    const HostList hosts = HostList::parse(list, "SLURM_JOB_NODELIST");
    if (hosts.size() == 0) std::abort();  // parse() refuses a list without hosts
    const std::string first = hosts.first();
    if (hosts.size() <= 4096) {
      const auto all = hosts.expand();
      if (all.size() != hosts.size() || all.front() != first) std::abort();
    }
  } catch (const forkguard::launch::HostListError&) {
    // an expected rejection, with its message
  }
  return 0;
}
