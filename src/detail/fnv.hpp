// FNV-1a, 64-bit: the digests of the loader's bench (`--digest`) and of a dataset's file list.
// Not cryptographic; stable across runs and machines.
#pragma once

#include <cstddef>
#include <cstdint>

namespace forkguard::detail {

inline constexpr uint64_t kFnvOffset = 1469598103934665603ull;

// `h` continued over `n` bytes at `data`.
inline uint64_t fnv1a(const void* data, size_t n, uint64_t h = kFnvOffset) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace forkguard::detail
