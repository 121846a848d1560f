// poll()'s timeout for waiting until a deadline.
#pragma once

#include <algorithm>
#include <chrono>
#include <optional>

namespace forkguard::detail {

// Milliseconds until `deadline`, rounded up (a wait never ends early) and at least 0; -1 (no
// limit) without one.
inline int poll_ms(std::optional<std::chrono::steady_clock::time_point> deadline) {
  if (!deadline) return -1;
  return static_cast<int>(std::max<long>(
      0, std::chrono::ceil<std::chrono::milliseconds>(*deadline - std::chrono::steady_clock::now())
             .count()));
}

}  // namespace forkguard::detail
