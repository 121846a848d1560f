// Process workers' messages, without a socket: every message the loader and a worker send each
// other round-trips through its one encoder and decoder, and malformed messages
// (tests/fuzz/worker_message_fuzz.cpp) are DataErrors naming the message and the field, not
// exceptions from a JSON parser or a negative slot.
#include "data/worker_protocol.hpp"

#include <gtest/gtest.h>

#include <functional>

#include "detail/seqpacket.hpp"
#include "forkguard/data/error.hpp"

namespace fd = forkguard::data::detail;
using forkguard::data::detail::TaskResult;
using Fields = std::vector<std::string>;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const forkguard::data::DataError& e) {
    return e.what();
  }
  return "no error";
}

// Through the socket layer's encoding, as the peer receives it.
Fields wire(const Fields& f) {
  const std::string bytes = forkguard::detail::encode(f);
  return forkguard::detail::decode(bytes.data(), bytes.size());
}

template <class M>
M request_round_trip(const M& m) {
  const auto back = fd::decode_worker_request(wire(fd::encode(m)));
  EXPECT_TRUE(std::holds_alternative<M>(back));
  return std::get<M>(back);
}

template <class M>
M reply_round_trip(const M& m) {
  const auto back = fd::decode_worker_reply(wire(fd::encode(m)));
  EXPECT_TRUE(std::holds_alternative<M>(back));
  return std::get<M>(back);
}

}  // namespace

TEST(WorkerProtocol, RequestsRoundTrip) {
  const fd::SetupMessage setup{.bytes = 123456789012, .worker = 7};
  EXPECT_EQ(request_round_trip(setup), setup);
  const fd::SlotMessage slot{.slot = 3, .bytes = 1 << 20};
  EXPECT_EQ(request_round_trip(slot), slot);
  const fd::TaskMessage task{
      .epoch = 2, .batch = 17, .slot = 3, .count = 64, .shared = true, .fresh = false};
  EXPECT_EQ(request_round_trip(task), task);
  EXPECT_EQ(fd::encode(task), (Fields{"task", "2", "17", "3", "64", "1", "0"}));
}

// Keys and reasons are file names: any bytes, UTF-8 or not, must come back as they were.
TEST(WorkerProtocol, RepliesRoundTripAnyBytes) {
  EXPECT_EQ(reply_round_trip(fd::ReadyReply{}), fd::ReadyReply{});
  EXPECT_EQ(fd::encode(fd::ReadyReply{}), Fields{"ready"});
  const fd::FailedReply failed{.message = "its init hook \"x\" threw: caf\xe9"};
  EXPECT_EQ(reply_round_trip(failed), failed);
  fd::DoneReply done{.batch = 17, .slot = 3, .result = {}, .idle_ns = 99};
  done.result.kind = TaskResult::Kind::kData;
  done.result.message = "bad sample";
  done.result.index = 5;
  done.result.key = "caf\xe9.jpg";
  done.result.position = 2;
  done.result.read_ns = 10;
  done.result.transform_ns = 20;
  done.result.skipped.push_back({.position = 1,
                                 .index = 9,
                                 .key = "d\xff/x.jpg",
                                 .reason = "d\xff/x.jpg: corrupt JPEG",
                                 .substitute = 10});
  done.result.skipped.push_back(
      {.position = 4, .index = 0, .key = "", .reason = "", .substitute = 0});
  EXPECT_EQ(reply_round_trip(done), done);
  const auto e = done.event(4);
  EXPECT_EQ(e.kind, fd::WorkerEvent::Kind::kDone);
  EXPECT_EQ(e.worker, 4);
  EXPECT_EQ(e.batch, 17u);
  EXPECT_EQ(e.slot, 3);
  EXPECT_EQ(e.idle_ns, 99u);
  EXPECT_EQ(e.result, done.result);
}

TEST(WorkerProtocol, MalformedMessagesAreDataErrorsNamingTheField) {
  EXPECT_EQ(error_of([] {
              fd::decode_worker_request({"task", "1", "x", "3", "64", "0", "1"});
            }),
            "process worker request \"task\": field \"batch\": \"x\" is not a whole number");
  EXPECT_EQ(error_of([] {
              fd::decode_worker_request({"task", "1", "2", "-3", "64", "0", "1"});
            }),
            "process worker request \"task\": field \"slot\": -3 is below 0");
  EXPECT_EQ(error_of([] {
              fd::decode_worker_request({"task", "1", "2", "3", "64", "0", "2"});
            }),
            "process worker request \"task\": field \"fresh\": \"2\" is not 0 or 1");
  EXPECT_EQ(error_of([] {
              fd::decode_worker_request({"slot", "1", "0"});
            }),
            "process worker request \"slot\": field \"bytes\": 0 is below 1");
  EXPECT_EQ(error_of([] {
              fd::decode_worker_request({"setup", "100"});
            }),
            "process worker request \"setup\": field \"worker\" is missing");
  EXPECT_EQ(error_of([] { fd::decode_worker_request({"done"}); }),
            "process worker request: unknown kind \"done\" (expected \"setup\", \"slot\", "
            "\"task\")");
  EXPECT_EQ(error_of([] {
              fd::decode_worker_reply({"ready", "now"});
            }),
            "process worker reply \"ready\": 1 field too many");
  EXPECT_EQ(
      error_of([] {
        fd::decode_worker_reply({"done", "1", "2", "9", "", "0", "", "0", "0", "0", "0", "0"});
      }),
      "process worker reply \"done\": field \"kind\": 9 is above 4");
  EXPECT_EQ(error_of([] {
              fd::decode_worker_reply(
                  {"done", "1", "2", "1", "", "0", "", "0", "0", "0", "0", "2", "1", "2"});
            }),
            "process worker reply \"done\": field \"skipped\": 2 items of 5 fields, but 2 "
            "fields follow");
}
