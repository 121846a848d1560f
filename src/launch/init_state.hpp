// What forkguard::init() recorded, for the launcher.
#pragma once

#include <string>
#include <string_view>

namespace forkguard::launch::detail {

inline constexpr const char* kEntryVariable = "FORKGUARD_ENTRY";

struct InitState {
  bool called = false;
  std::string argv0;
};

InitState& init_state();

// The registry's message for an entry name nobody registered: "no entry function named \"x\"
// (registered: a, b); register it with FORKGUARD_ENTRY".
std::string unknown_entry(std::string_view name);

}  // namespace forkguard::launch::detail
