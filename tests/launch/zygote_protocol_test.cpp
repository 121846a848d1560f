// The fork server's request decoding, without a socket: well-formed requests round-trip, and
// malformed ones (found by tests/fuzz/zygote_message_fuzz.cpp) are errors naming the field instead
// of out-of-range iterators.
#include "launch/zygote_protocol.hpp"

#include <gtest/gtest.h>

#include "forkguard/error.hpp"

namespace fl = forkguard::launch::detail;
using Fields = std::vector<std::string>;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const forkguard::Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(ZygoteProtocol, EntryRequestRoundTrips) {
  forkguard::launch::RankContext ctx{3, 1, 8, 2, 1, 4, {"--lr", "0.1"}};
  const Fields env = {"PATH=/usr/bin", "RANK=3"};
  const auto r = fl::decode_entry_request(fl::encode_entry_request("train", ctx, env));
  EXPECT_EQ(r.name, "train");
  EXPECT_EQ(r.ctx.rank, 3);
  EXPECT_EQ(r.ctx.local_rank, 1);
  EXPECT_EQ(r.ctx.world_size, 8);
  EXPECT_EQ(r.ctx.local_world_size, 2);
  EXPECT_EQ(r.ctx.node_rank, 1);
  EXPECT_EQ(r.ctx.restart_count, 4);
  EXPECT_EQ(r.ctx.args, (Fields{"--lr", "0.1"}));
  EXPECT_EQ(r.env, env);
}

TEST(ZygoteProtocol, ExecRequestRoundTrips) {
  const auto r = fl::decode_exec_request(fl::encode_exec_request({"/bin/echo", "hi"}, {"A=1"}));
  EXPECT_EQ(r.argv, (Fields{"/bin/echo", "hi"}));
  EXPECT_EQ(r.env, Fields{"A=1"});
}

// atoi read "-1" as a count that wrapped to SIZE_MAX, passed the bounds check (9 + count wrapped
// too) and built a vector from a reversed iterator range.
TEST(ZygoteProtocol, NegativeOrOversizedCountsAreRefused) {
  EXPECT_EQ(error_of([] {
              fl::decode_entry_request({"entry", "f", "0", "0", "1", "1", "0", "0", "-1"});
            }),
            "malformed entry request: argument count -1 with 0 fields after it");
  EXPECT_EQ(error_of([] {
              fl::decode_entry_request({"entry", "f", "0", "0", "1", "1", "0", "0", "2", "a"});
            }),
            "malformed entry request: argument count 2 with 1 field after it");
  EXPECT_EQ(error_of([] {
              fl::decode_exec_request({"exec", "-1", "/bin/true"});
            }),
            "malformed exec request: argv count -1 with 1 field after it");
  EXPECT_EQ(error_of([] {
              fl::decode_exec_request({"exec", "0", "A=1"});
            }),
            "malformed exec request: an empty argv");
}

TEST(ZygoteProtocol, NumbersAreWholeDecimalInts) {
  EXPECT_EQ(error_of([] {
              fl::decode_entry_request({"entry", "f", "1x", "0", "1", "1", "0", "0", "0"});
            }),
            "malformed entry request: RANK (field 2) is \"1x\", not an int");
  EXPECT_EQ(error_of([] {
              fl::decode_entry_request({"entry", "f", "0", "0", "99999999999", "1", "0", "0", "0"});
            }),
            "malformed entry request: WORLD_SIZE (field 4) is \"99999999999\", not an int");
  EXPECT_EQ(error_of([] {
              fl::decode_entry_request({"entry", "f"});
            }),
            "malformed entry request: 2 fields, at least 9 expected");
}

TEST(ZygoteProtocol, ExitReports) {
  EXPECT_EQ(fl::decode_exit_report({"exit", "1234", "256"}), std::make_pair(pid_t{1234}, 256));
  EXPECT_FALSE(fl::decode_exit_report({"started", "1234"}));
  EXPECT_FALSE(fl::decode_exit_report({"exit", "-1", "0"}));
  EXPECT_FALSE(fl::decode_exit_report({"exit", "12", ""}));
}
