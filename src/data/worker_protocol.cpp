#include "data/worker_protocol.hpp"

#include "forkguard/data/error.hpp"

namespace forkguard::data::detail {
namespace {

using forkguard::detail::decode_one_of;
using forkguard::detail::encode_message;

[[noreturn]] void raise(const std::string& message) {
  throw DataError(message);
}

}  // namespace

WorkerEvent DoneReply::event(int worker) const {
  WorkerEvent e;
  e.kind = WorkerEvent::Kind::kDone;
  e.worker = worker;
  e.batch = batch;
  e.slot = slot;
  e.result = result;
  e.idle_ns = idle_ns;
  return e;
}

std::vector<std::string> encode(const SetupMessage& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const SlotMessage& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const TaskMessage& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const ReadyReply& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const FailedReply& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const DoneReply& m) {
  return encode_message(m);
}

WorkerRequest decode_worker_request(const std::vector<std::string>& f) {
  return decode_one_of<WorkerRequest>(f, "process worker request", &raise);
}

WorkerReply decode_worker_reply(const std::vector<std::string>& f) {
  return decode_one_of<WorkerReply>(f, "process worker reply", &raise);
}

}  // namespace forkguard::data::detail
