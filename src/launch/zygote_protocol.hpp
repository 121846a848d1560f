// The fork server's messages as structs (detail/message_fields.hpp), each with one field list that
// drives its encoder and its decoder: the zygote decodes what the program sends before it forks
// anything, and tests/fuzz/zygote_message_fuzz.cpp feeds the decoders arbitrary fields. On the
// wire (fields of one SOCK_SEQPACKET datagram, detail/seqpacket.hpp; python/forkguard/_server.py
// speaks it too, so it does not change):
//
//   program -> zygote
//     entry NAME RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE NODE_RANK RESTART NARGS ARGS... ENV...
//     exec NARGV ARGV... ENV...        (ENV: "K=V" strings, every field left)
//     call FUNCTION                    (the function's fd is the third fd attached)
//     each with the child's stdout and stderr attached as the first two fds
//   zygote -> program
//     started PID | error MESSAGE      (the reply to each request)
//     exit PID STATUS                  (for each child reaped: its raw wait status)
//
//   auto fields = encode(ExitReport{.pid = 12, .status = 0});   // {"exit", "12", "0"}
//   ZygoteReply reply = decode_zygote_reply(fields);             // holds that ExitReport
//
// A malformed message throws forkguard::Error naming the message and the field:
//   zygote request "entry": field "local_rank": "12x" is not a whole number
//
// Thread-safety: pure functions.
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "detail/message_fields.hpp"
#include "forkguard/launch/entry.hpp"

namespace forkguard::launch::detail {

using forkguard::detail::at_least;

// Fork a rank running the registered entry function `name`.
struct EntryRequest {
  static constexpr std::string_view kKind = "entry";
  std::string name;              // the registered entry function
  RankContext ctx;               // with its args
  std::vector<std::string> env;  // the complete environment, "K=V"

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("name", m.name);
    v("rank", m.ctx.rank, at_least(0));
    v("local_rank", m.ctx.local_rank, at_least(0));
    v("world_size", m.ctx.world_size, at_least(1));
    v("local_world_size", m.ctx.local_world_size, at_least(1));
    v("node_rank", m.ctx.node_rank, at_least(0));
    v("restart_count", m.ctx.restart_count, at_least(0));
    v("args", m.ctx.args);
    v.rest("env", m.env);
  }
  bool operator==(const EntryRequest&) const = default;
};

// Fork and execute a command.
struct ExecRequest {
  static constexpr std::string_view kKind = "exec";
  std::vector<std::string> argv;  // at least one element
  std::vector<std::string> env;   // "K=V"

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("argv", m.argv, 1);
    v.rest("env", m.env);
  }
  bool operator==(const ExecRequest&) const = default;
};

// Fork a child running the zygote function `function` (register_zygote_function) on the fd sent.
struct CallRequest {
  static constexpr std::string_view kKind = "call";
  std::string function;

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("function", m.function);
  }
  bool operator==(const CallRequest&) const = default;
};

struct StartedReply {
  static constexpr std::string_view kKind = "started";
  pid_t pid = 0;  // the child forked

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("pid", m.pid, at_least<pid_t>(1));
  }
  bool operator==(const StartedReply&) const = default;
};

struct ErrorReply {
  static constexpr std::string_view kKind = "error";
  std::string message;  // why nothing was started

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("message", m.message);
  }
  bool operator==(const ErrorReply&) const = default;
};

// Not a reply: sent whenever the zygote reaps a child.
struct ExitReport {
  static constexpr std::string_view kKind = "exit";
  pid_t pid = 0;
  int status = 0;  // the raw wait status

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("pid", m.pid, at_least<pid_t>(1));
    v("status", m.status);
  }
  bool operator==(const ExitReport&) const = default;
};

using ZygoteRequest = std::variant<EntryRequest, ExecRequest, CallRequest>;
using ZygoteReply = std::variant<StartedReply, ErrorReply, ExitReport>;

// ---------------------------------------------------------------- the interpreter fork server
// python/forkguard/_server.py (served by _native.serve_zygote) takes `entry` (notebook ranks) and
// `call` (DataLoader workers) as above, and these; each request that starts a child is answered
// as above (`started` with the child's pidfd attached, or `error`), the others as noted.
//
//   server -> caller  ready PID PRELOADED_JSON ERRORS_JSON   (first, once its modules are loaded)
//   caller -> server  preload MODULES_JSON      -> preloaded PRELOADED_JSON ERRORS_JSON
//   caller -> server  hold_fds + fds            -> held COUNT   (inherited by the ranks started
//                                                  until release_fds)
//   caller -> server  release_fds               -> released
//   caller -> server  dataloader_hold KEY + fds -> held COUNT   (inherited by DataLoader workers
//                                                  until dataloader_release KEY)
//   caller -> server  dataloader_release KEY    -> released
//   caller -> server  guard_start NAME + fds    (a rerouted multiprocessing Process)

struct PreloadRequest {
  static constexpr std::string_view kKind = "preload";
  std::string modules;  // a JSON list of module names

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("modules", m.modules);
  }
  bool operator==(const PreloadRequest&) const = default;
};

struct HoldFdsRequest {
  static constexpr std::string_view kKind = "hold_fds";
  template <class V, class M>
  static void fields(V&, M&) {}
  bool operator==(const HoldFdsRequest&) const = default;
};

struct ReleaseFdsRequest {
  static constexpr std::string_view kKind = "release_fds";
  template <class V, class M>
  static void fields(V&, M&) {}
  bool operator==(const ReleaseFdsRequest&) const = default;
};

struct DataLoaderHoldRequest {
  static constexpr std::string_view kKind = "dataloader_hold";
  std::string key;  // the loader's: its workers' spec names it

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("key", m.key);
  }
  bool operator==(const DataLoaderHoldRequest&) const = default;
};

struct DataLoaderReleaseRequest {
  static constexpr std::string_view kKind = "dataloader_release";
  std::string key;

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("key", m.key);
  }
  bool operator==(const DataLoaderReleaseRequest&) const = default;
};

struct GuardStartRequest {
  static constexpr std::string_view kKind = "guard_start";
  std::string name;  // the Process's name

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("name", m.name);
  }
  bool operator==(const GuardStartRequest&) const = default;
};

struct ReadyReply {
  static constexpr std::string_view kKind = "ready";
  pid_t pid = 0;          // the server's
  std::string preloaded;  // a JSON list of the modules it imported
  std::string errors;     // a JSON object: module -> why it could not be imported

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("pid", m.pid, at_least<pid_t>(1));
    v("preloaded", m.preloaded);
    v("errors", m.errors);
  }
  bool operator==(const ReadyReply&) const = default;
};

struct PreloadedReply {
  static constexpr std::string_view kKind = "preloaded";
  std::string preloaded;
  std::string errors;

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("preloaded", m.preloaded);
    v("errors", m.errors);
  }
  bool operator==(const PreloadedReply&) const = default;
};

struct HeldReply {
  static constexpr std::string_view kKind = "held";
  int count = 0;  // the fds now held

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("count", m.count, at_least(0));
  }
  bool operator==(const HeldReply&) const = default;
};

struct ReleasedReply {
  static constexpr std::string_view kKind = "released";
  template <class V, class M>
  static void fields(V&, M&) {}
  bool operator==(const ReleasedReply&) const = default;
};

using ServerRequest =
    std::variant<EntryRequest, CallRequest, PreloadRequest, HoldFdsRequest, ReleaseFdsRequest,
                 DataLoaderHoldRequest, DataLoaderReleaseRequest, GuardStartRequest>;
using ServerReply = std::variant<ReadyReply, PreloadedReply, HeldReply, ReleasedReply>;

std::vector<std::string> encode(const EntryRequest& m);
std::vector<std::string> encode(const ExecRequest& m);
std::vector<std::string> encode(const CallRequest& m);
std::vector<std::string> encode(const StartedReply& m);
std::vector<std::string> encode(const ErrorReply& m);
std::vector<std::string> encode(const ExitReport& m);

// Throw forkguard::Error ("zygote request ...", "zygote reply ...") for an empty message, an
// unknown kind, and a missing, extra or malformed field.
ZygoteRequest decode_zygote_request(const std::vector<std::string>& f);
ZygoteReply decode_zygote_reply(const std::vector<std::string>& f);
std::vector<std::string> encode(const PreloadRequest& m);
std::vector<std::string> encode(const HoldFdsRequest& m);
std::vector<std::string> encode(const ReleaseFdsRequest& m);
std::vector<std::string> encode(const DataLoaderHoldRequest& m);
std::vector<std::string> encode(const DataLoaderReleaseRequest& m);
std::vector<std::string> encode(const GuardStartRequest& m);
std::vector<std::string> encode(const ReadyReply& m);
std::vector<std::string> encode(const PreloadedReply& m);
std::vector<std::string> encode(const HeldReply& m);
std::vector<std::string> encode(const ReleasedReply& m);

// The same for the interpreter server ("interpreter server request ...", "... reply ...").
ServerRequest decode_server_request(const std::vector<std::string>& f);
ServerReply decode_server_reply(const std::vector<std::string>& f);

}  // namespace forkguard::launch::detail
