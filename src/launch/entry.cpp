#include "forkguard/launch/entry.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "forkguard/init.hpp"
#include "launch/fork_server.hpp"
#include "launch/init_state.hpp"

namespace forkguard {
namespace launch {
namespace {

// Function-local static: registration runs during static initialization, in any order.
std::map<std::string, EntryFunction, std::less<>>& registry() {
  static std::map<std::string, EntryFunction, std::less<>> entries;
  return entries;
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

}  // namespace

bool register_entry(const char* name, EntryFunction fn) {
  if (!registry().emplace(name, fn).second) {
    std::fprintf(stderr, "forkguard: two entry functions are registered as \"%s\"\n", name);
    std::abort();
  }
  return true;
}

EntryFunction find_entry(std::string_view name) {
  auto it = registry().find(name);
  return it == registry().end() ? nullptr : it->second;
}

std::vector<std::string> entry_names() {
  std::vector<std::string> names;
  for (const auto& [name, fn] : registry()) names.push_back(name);
  return names;
}

namespace detail {

InitState& init_state() {
  static InitState state;
  return state;
}

std::string registered_entries() {
  std::string known;
  for (const auto& n : entry_names()) known += (known.empty() ? "" : ", ") + n;
  return known.empty() ? "none" : known;
}

}  // namespace detail
}  // namespace launch

void init(int argc, char** argv, const InitOptions& options) {
  auto& state = launch::detail::init_state();
  state.called = true;
  state.argv0 = argc > 0 && argv[0] != nullptr ? argv[0] : "forkguard-program";
  if (const char* name = std::getenv(launch::detail::kEntryVariable)) {
    // A rank started by spawn: run its entry and exit; init() does not return here.
    std::string entry = name;
    ::unsetenv(launch::detail::kEntryVariable);  // the rank's own children are not ranks
    auto fn = launch::find_entry(entry);
    if (fn == nullptr) {
      std::fprintf(stderr, "forkguard: no entry function named \"%s\" in %s (registered: %s)\n",
                   entry.c_str(), state.argv0.c_str(),
                   launch::detail::registered_entries().c_str());
      std::exit(127);
    }
    launch::RankContext ctx;
    ctx.rank = launch::env_int("RANK", 0);
    ctx.local_rank = launch::env_int("LOCAL_RANK", 0);
    ctx.world_size = launch::env_int("WORLD_SIZE", 1);
    ctx.local_world_size = launch::env_int("LOCAL_WORLD_SIZE", 1);
    ctx.node_rank = launch::env_int("GROUP_RANK", 0);
    ctx.restart_count = launch::env_int("TORCHELASTIC_RESTART_COUNT", 0);
    for (int i = 1; i < argc; ++i) ctx.args.emplace_back(argv[i]);
    std::exit(fn(ctx));
  }
  const char* no_server = std::getenv("FORKGUARD_NO_FORK_SERVER");
  if (options.fork_server && (no_server == nullptr || *no_server == '\0')) {
    launch::detail::ForkServer::start();
  }
}

}  // namespace forkguard
