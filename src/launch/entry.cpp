#include "forkguard/launch/entry.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "detail/decimal.hpp"
#include "detail/registry.hpp"
#include "forkguard/init.hpp"
#include "launch/fork_server.hpp"
#include "launch/init_state.hpp"

namespace forkguard {
namespace launch {
namespace {

// Function-local static: registration runs during static initialization, in any order.
forkguard::detail::Registry<EntryFunction>& registry() {
  static forkguard::detail::Registry<EntryFunction> entries("entry function", "FORKGUARD_ENTRY");
  return entries;
}

// A rank's number from the environment the launcher gave it; a value that is not a whole number
// (the launcher never writes one) stops the rank with a message naming the variable.
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  const auto n = forkguard::detail::parse_decimal<int>(v);
  if (!n || *n < 0) {
    const std::string why =
        n ? fmt::format("\"{}\" is negative", v) : forkguard::detail::decimal_problem<int>(v);
    std::fprintf(stderr, "forkguard: the rank's %s: %s\n", name, why.c_str());
    std::exit(2);
  }
  return *n;
}

}  // namespace

bool register_entry(const char* name, EntryFunction fn, const char* file, int line) {
  return registry().add(name, fn, file, line);
}

EntryFunction find_entry(std::string_view name) {
  return registry().find(name).value_or(nullptr);
}

std::vector<std::string> entry_names() {
  return registry().names();
}

namespace detail {

InitState& init_state() {
  static InitState state;
  return state;
}

std::string unknown_entry(std::string_view name) {
  return registry().unknown(name);
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
      std::fprintf(stderr, "forkguard: %s: %s\n", state.argv0.c_str(),
                   launch::detail::unknown_entry(entry).c_str());
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
