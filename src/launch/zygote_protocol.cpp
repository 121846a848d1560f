#include "launch/zygote_protocol.hpp"

#include "forkguard/error.hpp"

namespace forkguard::launch::detail {
namespace {

using forkguard::detail::decode_one_of;
using forkguard::detail::encode_message;

[[noreturn]] void raise(const std::string& message) {
  throw Error(message);
}

}  // namespace

std::vector<std::string> encode(const EntryRequest& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const ExecRequest& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const CallRequest& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const StartedReply& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const ErrorReply& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const ExitReport& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const PreloadRequest& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const HoldFdsRequest& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const ReleaseFdsRequest& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const DataLoaderHoldRequest& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const DataLoaderReleaseRequest& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const GuardStartRequest& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const ReadyReply& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const PreloadedReply& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const HeldReply& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const ReleasedReply& m) {
  return encode_message(m);
}

ZygoteRequest decode_zygote_request(const std::vector<std::string>& f) {
  return decode_one_of<ZygoteRequest>(f, "zygote request", &raise);
}

ZygoteReply decode_zygote_reply(const std::vector<std::string>& f) {
  return decode_one_of<ZygoteReply>(f, "zygote reply", &raise);
}

ServerRequest decode_server_request(const std::vector<std::string>& f) {
  return decode_one_of<ServerRequest>(f, "interpreter server request", &raise);
}

ServerReply decode_server_reply(const std::vector<std::string>& f) {
  return decode_one_of<ServerReply>(f, "interpreter server reply", &raise);
}

}  // namespace forkguard::launch::detail
