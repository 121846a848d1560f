// Registered entry functions: what a rank runs when it is a function rather than a command.
//
//   FORKGUARD_ENTRY(train) {                      // int train(const
//   forkguard::launch::RankContext&)
//     fmt::print("rank {} of {}\n", ctx.rank, ctx.world_size);
//     return 0;                                   // the rank's exit code
//   }
//   int main(int argc, char** argv) {
//     forkguard::init(argc, argv);               // first line: dispatches spawned ranks
//     forkguard::launch::launch({.nproc = 4}, "train", {"--lr", "0.1"});
//   }
//
// Registration happens at static-initialization time; the registry is read-only afterwards.
// Thread-safety: find_entry() may be called from any thread once main() runs.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace forkguard::launch {

struct RankContext {
  int rank = 0;              // global rank (RANK)
  int local_rank = 0;        // rank on this node (LOCAL_RANK)
  int world_size = 1;        // WORLD_SIZE
  int local_world_size = 1;  // LOCAL_WORLD_SIZE
  int node_rank = 0;         // GROUP_RANK
  int restart_count = 0;     // TORCHELASTIC_RESTART_COUNT
  std::vector<std::string> args;
  bool operator==(const RankContext&) const = default;
};

using EntryFunction = int (*)(const RankContext&);

// Registers fn under name; returns true (so it can initialize a static). A name registered twice
// keeps its first function: the second call returns false and says so on stderr, naming both
// places.
bool register_entry(const char* name, EntryFunction fn, const char* file = __builtin_FILE(),
                    int line = __builtin_LINE());
EntryFunction find_entry(std::string_view name);  // nullptr when unknown
std::vector<std::string> entry_names();

}  // namespace forkguard::launch

#define FORKGUARD_ENTRY(name)                                                     \
  static int forkguard_entry_##name(const ::forkguard::launch::RankContext& ctx); \
  [[maybe_unused]] static const bool forkguard_entry_registered_##name =          \
      ::forkguard::launch::register_entry(#name, &forkguard_entry_##name);        \
  static int forkguard_entry_##name([[maybe_unused]] const ::forkguard::launch::RankContext& ctx)
