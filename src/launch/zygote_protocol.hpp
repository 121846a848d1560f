// The fork server's requests and reports, as message fields (detail/seqpacket.hpp), encoded and
// decoded without a socket: the zygote decodes what the program sends before it forks anything,
// and tests/fuzz/zygote_message_fuzz.cpp feeds the decoders arbitrary fields.
//
//   entry NAME RANK LOCAL WORLD LOCAL_WORLD NODE RESTART NARGS ARGS... ENV...
//   exec NARGV ARGV... ENV...          (ENV: "K=V" strings)
//   exit PID STATUS                    (zygote -> program, for each child reaped)
//
// Thread-safety: pure functions.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "forkguard/launch/entry.hpp"

namespace forkguard::launch::detail {

struct EntryRequest {
  std::string name;              // the registered entry function
  RankContext ctx;               // with its args
  std::vector<std::string> env;  // the complete environment, "K=V"
};

struct ExecRequest {
  std::vector<std::string> argv;  // at least one element
  std::vector<std::string> env;   // "K=V"
};

std::vector<std::string> encode_entry_request(const std::string& name, const RankContext& ctx,
                                              const std::vector<std::string>& env);
std::vector<std::string> encode_exec_request(const std::vector<std::string>& argv,
                                             const std::vector<std::string>& env);

// Throw forkguard::Error ("malformed entry request: ...") for fields that are not one: a missing
// field, a number that is not a decimal int, a count that is negative or names more fields than
// the message holds.
EntryRequest decode_entry_request(const std::vector<std::string>& f);
ExecRequest decode_exec_request(const std::vector<std::string>& f);

// (PID, wait status) from "exit PID STATUS"; nullopt for any other message (a reply), and for an
// exit report whose PID or status is not a decimal int (then taken as a bad reply).
std::optional<std::pair<pid_t, int>> decode_exit_report(const std::vector<std::string>& f);

}  // namespace forkguard::launch::detail
