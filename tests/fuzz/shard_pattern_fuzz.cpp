// WebDataset shard patterns (`train-{000000..001281}.tar`, `{a,b}`): expand_shard_pattern on any
// bytes that hold a brace (without one the pattern is a path, looked up on disk, not parsed).
#include <cstddef>
#include <cstdint>
#include <string>

#include "forkguard/data/error.hpp"
#include "forkguard/data/tar_shards.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string pattern(reinterpret_cast<const char*>(data), size);
  if (pattern.find_first_of("{}") == std::string::npos) return 0;
  try {
    (void)forkguard::data::expand_shard_pattern(pattern);
  } catch (const forkguard::Error&) {
  }
  return 0;
}
