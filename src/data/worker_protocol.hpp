// The messages between the loader and its process workers as structs (detail/message_fields.hpp),
// each with one field list that drives its encoder and its decoder (tests/fuzz/
// worker_message_fuzz.cpp feeds the decoders arbitrary fields). On the wire (fields of one
// SOCK_SEQPACKET datagram, detail/seqpacket.hpp):
//
//   loader -> worker
//     setup BYTES WORKER                    with the sealed setup memfd (fork-server workers only)
//     slot SLOT BYTES                       with the slot's memfd
//     task EPOCH BATCH SLOT COUNT SHARED FRESH    (the indices are in the slot)
//   worker -> loader
//     ready | failed MESSAGE                once, after the setup
//     done BATCH SLOT KIND MESSAGE INDEX KEY READ_NS TRANSFORM_NS IDLE_NS POSITION NSKIPPED
//          then per skipped sample: POSITION INDEX KEY REASON SUBSTITUTE
//                                           after each task
//
// Both ends are this library (a worker is a fork of the program or of its fork server), so the
// wire may change with it: "done" carries POSITION before NSKIPPED (it followed it before), so
// that a count is always followed by what it counts.
//
// Keys and reasons are file names and messages naming them: any bytes, so they travel as fields
// and never as JSON (whose dump() throws on bytes that are not UTF-8, and whose parse() threw
// nlohmann's exceptions on a malformed list, found by the fuzz target).
//
// A malformed message throws DataError naming the message and the field:
//   process worker request "task": field "slot": -3 is below 0
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "data/producer.hpp"
#include "data/workers.hpp"
#include "detail/fd.hpp"
#include "detail/message_fields.hpp"
#include "detail/seqpacket.hpp"

namespace forkguard::data::detail {

// The loaders' and their workers' socket I/O (detail/seqpacket.hpp) and message fields.
using forkguard::detail::at_least;
using forkguard::detail::Bounds;
using forkguard::detail::kMaxFds;
using forkguard::detail::recv_message;
using forkguard::detail::send_message;
using forkguard::detail::UniqueFd;

// The pipeline to rebuild: a JSON description of BYTES bytes in the attached memfd.
struct SetupMessage {
  static constexpr std::string_view kKind = "setup";
  uint64_t bytes = 0;  // the description's size
  int worker = 0;      // this worker's id

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("bytes", m.bytes);
    v("worker", m.worker, at_least(0));
  }
  bool operator==(const SetupMessage&) const = default;
};

struct SlotMessage {
  static constexpr std::string_view kKind = "slot";
  int slot = 0;
  uint64_t bytes = 0;  // the memfd's size, mapped whole

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("slot", m.slot, at_least(0));
    v("bytes", m.bytes, at_least<uint64_t>(1));
  }
  bool operator==(const SlotMessage&) const = default;
};

struct TaskMessage {
  static constexpr std::string_view kKind = "task";
  uint64_t epoch = 0;
  uint64_t batch = 0;
  int slot = 0;
  uint64_t count = 0;  // indices in the slot
  bool shared = false;
  bool fresh = false;  // the slot's first task: write its images through its fd

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("epoch", m.epoch);
    v("batch", m.batch);
    v("slot", m.slot, at_least(0));
    v("count", m.count);
    v("shared", m.shared);
    v("fresh", m.fresh);
  }
  bool operator==(const TaskMessage&) const = default;
};

struct ReadyReply {
  static constexpr std::string_view kKind = "ready";

  template <class V, class M>
  static void fields(V&, M&) {}
  bool operator==(const ReadyReply&) const = default;
};

struct FailedReply {
  static constexpr std::string_view kKind = "failed";
  std::string message;  // why the worker cannot serve

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("message", m.message);
  }
  bool operator==(const FailedReply&) const = default;
};

struct DoneReply {
  static constexpr std::string_view kKind = "done";
  uint64_t batch = 0;
  int slot = 0;
  TaskResult result;
  uint64_t idle_ns = 0;  // the worker's wait for this task

  template <class V, class M>
  static void fields(V& v, M& m) {
    v("batch", m.batch);
    v("slot", m.slot, at_least(0));
    v("kind", m.result.kind,
      Bounds<TaskResult::Kind>{TaskResult::Kind::kOk, TaskResult::Kind::kCancelled});
    v("message", m.result.message);
    v("index", m.result.index);
    v("key", m.result.key);
    v("read_ns", m.result.read_ns);
    v("transform_ns", m.result.transform_ns);
    v("idle_ns", m.idle_ns);
    v("position", m.result.position);
    v("skipped", m.result.skipped, [](auto& w, auto& s) {
      w("position", s.position);
      w("index", s.index);
      w("key", s.key);
      w("reason", s.reason);
      w("substitute", s.substitute);
    });
  }
  bool operator==(const DoneReply&) const = default;

  // As the loader's event from worker `worker`.
  WorkerEvent event(int worker) const;
};

using WorkerRequest = std::variant<SetupMessage, SlotMessage, TaskMessage>;
using WorkerReply = std::variant<ReadyReply, FailedReply, DoneReply>;

std::vector<std::string> encode(const SetupMessage& m);
std::vector<std::string> encode(const SlotMessage& m);
std::vector<std::string> encode(const TaskMessage& m);
std::vector<std::string> encode(const ReadyReply& m);
std::vector<std::string> encode(const FailedReply& m);
std::vector<std::string> encode(const DoneReply& m);

// Throw DataError ("process worker request ...", "process worker reply ...") for an empty
// message, an unknown kind, and a missing, extra or malformed field.
WorkerRequest decode_worker_request(const std::vector<std::string>& f);
WorkerReply decode_worker_reply(const std::vector<std::string>& f);

// A setup travels in a sealed memfd (with SetupMessage), not in the message: a message is bounded
// by the socket's send buffer (net.core.wmem_default, about 208 KiB), and a dataset's description
// lists its files (tens of MB for a million of them). Throw SystemError.
forkguard::detail::UniqueFd setup_memfd(const std::string& setup);
std::string read_setup(int fd, size_t size);

// A worker's first message (its setup, still to be decoded) and the fd it came with (the memfd; any
// other fd is closed). nullopt: its loader closed the socket first.
struct ReceivedSetup {
  std::vector<std::string> fields;
  forkguard::detail::UniqueFd memfd;
};
std::optional<ReceivedSetup> receive_setup(int sock);

}  // namespace forkguard::data::detail
