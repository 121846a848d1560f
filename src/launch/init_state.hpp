// What forkguard::init() recorded, for the launcher.
#pragma once

#include <string>

namespace forkguard::launch::detail {

inline constexpr const char* kEntryVariable = "FORKGUARD_ENTRY";

struct InitState {
  bool called = false;
  std::string argv0;
};

InitState& init_state();

// "a, b, c", or "none": for messages about an unknown entry name.
std::string registered_entries();

}  // namespace forkguard::launch::detail
