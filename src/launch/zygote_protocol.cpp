#include "launch/zygote_protocol.hpp"

#include <fmt/format.h>

#include "detail/decimal.hpp"
#include "forkguard/error.hpp"

namespace forkguard::launch::detail {
namespace {

using forkguard::detail::parse_decimal;

int field_int(const std::vector<std::string>& f, size_t i, const char* request, const char* what) {
  const auto v = parse_decimal<int>(f[i]);
  if (!v) {
    throw Error(fmt::format("malformed {} request: {} (field {}) is \"{}\", not an int", request,
                            what, i, f[i]));
  }
  return *v;
}

// A count of the fields that follow `at`: non-negative, and at most the fields left.
size_t field_count(const std::vector<std::string>& f, size_t i, size_t at, const char* request,
                   const char* what) {
  const int n = field_int(f, i, request, what);
  if (n < 0 || static_cast<size_t>(n) > f.size() - at) {
    throw Error(fmt::format("malformed {} request: {} {} with {} field{} after it", request, what,
                            n, f.size() - at, f.size() - at == 1 ? "" : "s"));
  }
  return static_cast<size_t>(n);
}

}  // namespace

std::vector<std::string> encode_entry_request(const std::string& name, const RankContext& ctx,
                                              const std::vector<std::string>& env) {
  std::vector<std::string> f = {"entry",
                                name,
                                std::to_string(ctx.rank),
                                std::to_string(ctx.local_rank),
                                std::to_string(ctx.world_size),
                                std::to_string(ctx.local_world_size),
                                std::to_string(ctx.node_rank),
                                std::to_string(ctx.restart_count),
                                std::to_string(ctx.args.size())};
  f.insert(f.end(), ctx.args.begin(), ctx.args.end());
  f.insert(f.end(), env.begin(), env.end());
  return f;
}

std::vector<std::string> encode_exec_request(const std::vector<std::string>& argv,
                                             const std::vector<std::string>& env) {
  std::vector<std::string> f = {"exec", std::to_string(argv.size())};
  f.insert(f.end(), argv.begin(), argv.end());
  f.insert(f.end(), env.begin(), env.end());
  return f;
}

EntryRequest decode_entry_request(const std::vector<std::string>& f) {
  if (f.size() < 9 || f[0] != "entry") {
    throw Error(fmt::format("malformed entry request: {} fields, at least 9 expected", f.size()));
  }
  EntryRequest r;
  r.name = f[1];
  r.ctx.rank = field_int(f, 2, "entry", "RANK");
  r.ctx.local_rank = field_int(f, 3, "entry", "LOCAL_RANK");
  r.ctx.world_size = field_int(f, 4, "entry", "WORLD_SIZE");
  r.ctx.local_world_size = field_int(f, 5, "entry", "LOCAL_WORLD_SIZE");
  r.ctx.node_rank = field_int(f, 6, "entry", "GROUP_RANK");
  r.ctx.restart_count = field_int(f, 7, "entry", "restart count");
  const size_t nargs = field_count(f, 8, 9, "entry", "argument count");
  r.ctx.args.assign(f.begin() + 9, f.begin() + 9 + static_cast<std::ptrdiff_t>(nargs));
  r.env.assign(f.begin() + 9 + static_cast<std::ptrdiff_t>(nargs), f.end());
  return r;
}

ExecRequest decode_exec_request(const std::vector<std::string>& f) {
  if (f.size() < 3 || f[0] != "exec") {
    throw Error(fmt::format("malformed exec request: {} fields, at least 3 expected", f.size()));
  }
  const size_t nargv = field_count(f, 1, 2, "exec", "argv count");
  if (nargv == 0) throw Error("malformed exec request: an empty argv");
  ExecRequest r;
  r.argv.assign(f.begin() + 2, f.begin() + 2 + static_cast<std::ptrdiff_t>(nargv));
  r.env.assign(f.begin() + 2 + static_cast<std::ptrdiff_t>(nargv), f.end());
  return r;
}

std::optional<std::pair<pid_t, int>> decode_exit_report(const std::vector<std::string>& f) {
  if (f.size() != 3 || f[0] != "exit") return std::nullopt;
  const auto pid = parse_decimal<pid_t>(f[1]);
  const auto status = parse_decimal<int>(f[2]);
  if (!pid || *pid <= 0 || !status) return std::nullopt;
  return std::make_pair(*pid, *status);
}

}  // namespace forkguard::launch::detail
