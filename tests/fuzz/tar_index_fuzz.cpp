// Tar shards (ustar, GNU long names and base-256 sizes, pax): the bytes as one shard, indexed by
// TarShards' constructor (every header walked), then every sample read. Errors are DataError.
#include <cstddef>
#include <cstdint>

#include "forkguard/data/error.hpp"
#include "forkguard/data/tar_shards.hpp"
#include "memfd.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static forkguard::fuzz::MemFile file;
  const std::string path = file.set(data, size);
  try {
    forkguard::data::TarShards shards(path);
    for (size_t i = 0; i < shards.size(); ++i) {
      (void)shards.key(i);
      try {
        (void)shards.read(i);
      } catch (const forkguard::data::DataError&) {
        // a bad sample (no image, no label, a label that is not an integer): reported per sample
      }
    }
  } catch (const forkguard::Error&) {
  }
  return 0;
}
