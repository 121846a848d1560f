// Process workers' messages, without a socket: what the loader and a worker send each other
// round-trips, and malformed messages (tests/fuzz/worker_message_fuzz.cpp) are DataErrors naming
// the field, not exceptions from a JSON parser or a negative slot.
#include "data/worker_protocol.hpp"

#include <gtest/gtest.h>

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

}  // namespace

TEST(WorkerProtocol, SlotAndTaskRoundTrip) {
  const auto slot = fd::decode_slot(wire(fd::encode_slot({.slot = 3, .bytes = 1 << 20})));
  ASSERT_TRUE(slot);
  EXPECT_EQ(slot->slot, 3);
  EXPECT_EQ(slot->bytes, 1u << 20);
  const auto task = fd::decode_task(wire(fd::encode_task(
      {.epoch = 2, .batch = 17, .slot = 3, .count = 64, .shared = true, .fresh = false})));
  ASSERT_TRUE(task);
  EXPECT_EQ(task->epoch, 2u);
  EXPECT_EQ(task->batch, 17u);
  EXPECT_EQ(task->slot, 3);
  EXPECT_EQ(task->count, 64u);
  EXPECT_TRUE(task->shared);
  EXPECT_FALSE(task->fresh);
  EXPECT_FALSE(fd::decode_task({"slot", "1", "2"}));
}

// Keys and reasons are file names: any bytes, UTF-8 or not, must come back as they were.
TEST(WorkerProtocol, DoneRoundTripsAnyBytes) {
  TaskResult r;
  r.kind = TaskResult::Kind::kData;
  r.message = "bad sample";
  r.index = 5;
  r.key = "caf\xe9.jpg";
  r.position = 2;
  r.skipped.push_back({.position = 1,
                       .index = 9,
                       .key = "d\xff/x.jpg",
                       .reason = "d\xff/x.jpg: corrupt JPEG",
                       .substitute = 10});
  const auto e = fd::decode_done(4, wire(fd::encode_done(17, 3, r, 99)));
  ASSERT_TRUE(e);
  EXPECT_EQ(e->worker, 4);
  EXPECT_EQ(e->batch, 17u);
  EXPECT_EQ(e->slot, 3);
  EXPECT_EQ(e->idle_ns, 99u);
  EXPECT_EQ(e->result.kind, TaskResult::Kind::kData);
  EXPECT_EQ(e->result.key, r.key);
  EXPECT_EQ(e->result.position, 2u);
  ASSERT_EQ(e->result.skipped.size(), 1u);
  EXPECT_EQ(e->result.skipped[0].key, "d\xff/x.jpg");
  EXPECT_EQ(e->result.skipped[0].reason, "d\xff/x.jpg: corrupt JPEG");
  EXPECT_EQ(e->result.skipped[0].substitute, 10u);
}

TEST(WorkerProtocol, MalformedMessagesAreDataErrors) {
  EXPECT_EQ(error_of([] {
              fd::decode_task({"task", "1", "x", "3", "64", "0", "1"});
            }),
            "malformed process worker \"task\" message: field 2 is \"x\"");
  EXPECT_EQ(error_of([] {
              fd::decode_task({"task", "1", "2", "-3", "64", "0", "1"});
            }),
            "malformed process worker \"task\" message: slot -3");
  EXPECT_EQ(error_of([] {
              fd::decode_slot({"slot", "1", "0"});
            }),
            "malformed process worker \"slot\" message: 0 bytes");
  EXPECT_EQ(error_of([] {
              fd::decode_done(0, {"done", "1", "2", "9", "", "0", "", "0", "0", "0", "0", "0"});
            }),
            "malformed process worker \"done\" message: result kind 9");
}
