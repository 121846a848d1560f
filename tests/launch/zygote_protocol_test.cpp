// The fork server's messages, without a socket: every request and reply round-trips through its
// one encoder and decoder, the wire stays what python/forkguard/_server.py speaks, and a malformed
// message (found by tests/fuzz/zygote_message_fuzz.cpp) is an error naming the message and the
// field instead of an out-of-range iterator.
#include "launch/zygote_protocol.hpp"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/socket.h>
#include <unistd.h>

#include <functional>
#include <thread>

#include "detail/seqpacket.hpp"
#include "forkguard/error.hpp"
#include "launch/fork_server.hpp"

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

// Through the socket layer's encoding, as the peer receives it.
Fields wire(const Fields& f) {
  const std::string bytes = forkguard::detail::encode(f);
  return forkguard::detail::decode(bytes.data(), bytes.size());
}

template <class M>
M request_round_trip(const M& m) {
  const auto back = fl::decode_zygote_request(wire(fl::encode(m)));
  EXPECT_TRUE(std::holds_alternative<M>(back));
  return std::get<M>(back);
}

template <class M>
M reply_round_trip(const M& m) {
  const auto back = fl::decode_zygote_reply(wire(fl::encode(m)));
  EXPECT_TRUE(std::holds_alternative<M>(back));
  return std::get<M>(back);
}

}  // namespace

TEST(ZygoteProtocol, EveryMessageRoundTrips) {
  const fl::EntryRequest entry{.name = "train",
                               .ctx = {3, 1, 8, 2, 1, 4, {"--lr", "0.1", ""}},
                               .env = {"PATH=/usr/bin", "RANK=3", "K=caf\xe9"}};
  EXPECT_EQ(request_round_trip(entry), entry);
  const fl::ExecRequest exec{.argv = {"/bin/echo", "hi"}, .env = {"A=1"}};
  EXPECT_EQ(request_round_trip(exec), exec);
  const fl::ExecRequest no_env{.argv = {"/bin/true"}, .env = {}};
  EXPECT_EQ(request_round_trip(no_env), no_env);
  const fl::CallRequest call{.function = "forkguard.data.worker"};
  EXPECT_EQ(request_round_trip(call), call);
  EXPECT_EQ(reply_round_trip(fl::StartedReply{.pid = 4242}), fl::StartedReply{.pid = 4242});
  EXPECT_EQ(reply_round_trip(fl::ErrorReply{.message = "no\nluck"}),
            fl::ErrorReply{.message = "no\nluck"});
  EXPECT_EQ(reply_round_trip(fl::ExitReport{.pid = 12, .status = 256}),
            (fl::ExitReport{.pid = 12, .status = 256}));
}

// The fields the Python fork server reads and writes: the same as before the messages were typed.
TEST(ZygoteProtocol, WireFormatIsUnchanged) {
  forkguard::launch::RankContext ctx{3, 1, 8, 2, 1, 4, {"--lr", "0.1"}};
  EXPECT_EQ(
      fl::encode(fl::EntryRequest{.name = "train", .ctx = ctx, .env = {"A=1", "B=2"}}),
      (Fields{"entry", "train", "3", "1", "8", "2", "1", "4", "2", "--lr", "0.1", "A=1", "B=2"}));
  EXPECT_EQ(fl::encode(fl::ExecRequest{.argv = {"/bin/echo", "hi"}, .env = {"A=1"}}),
            (Fields{"exec", "2", "/bin/echo", "hi", "A=1"}));
  EXPECT_EQ(fl::encode(fl::CallRequest{.function = "f"}), (Fields{"call", "f"}));
  EXPECT_EQ(fl::encode(fl::StartedReply{.pid = 77}), (Fields{"started", "77"}));
  EXPECT_EQ(fl::encode(fl::ErrorReply{.message = "why"}), (Fields{"error", "why"}));
  EXPECT_EQ(fl::encode(fl::ExitReport{.pid = 77, .status = 9}), (Fields{"exit", "77", "9"}));
}

// atoi read "-1" as a count that wrapped to SIZE_MAX, passed the bounds check (9 + count wrapped
// too) and built a vector from a reversed iterator range.
TEST(ZygoteProtocol, NegativeOrOversizedCountsAreRefused) {
  EXPECT_EQ(error_of([] {
              fl::decode_zygote_request({"entry", "f", "0", "0", "1", "1", "0", "0", "-1"});
            }),
            "zygote request \"entry\": field \"args\": \"-1\" is negative");
  EXPECT_EQ(error_of([] {
              fl::decode_zygote_request({"entry", "f", "0", "0", "1", "1", "0", "0", "2", "a"});
            }),
            "zygote request \"entry\": field \"args\": 2 items, but 1 field follows");
  EXPECT_EQ(error_of([] {
              fl::decode_zygote_request({"exec", "-1", "/bin/true"});
            }),
            "zygote request \"exec\": field \"argv\": \"-1\" is negative");
  EXPECT_EQ(error_of([] {
              fl::decode_zygote_request({"exec", "0", "A=1"});
            }),
            "zygote request \"exec\": field \"argv\": 0 fields, at least 1 expected");
}

TEST(ZygoteProtocol, ErrorsNameTheMessageAndTheField) {
  EXPECT_EQ(error_of([] {
              fl::decode_zygote_request({"entry", "f", "0", "12x", "1", "1", "0", "0", "0"});
            }),
            "zygote request \"entry\": field \"local_rank\": \"12x\" is not a whole number");
  EXPECT_EQ(
      error_of([] {
        fl::decode_zygote_request({"entry", "f", "0", "0", "99999999999", "1", "0", "0", "0"});
      }),
      "zygote request \"entry\": field \"world_size\": \"99999999999\" is out of range "
      "(-2147483648 to 2147483647)");
  EXPECT_EQ(error_of([] {
              fl::decode_zygote_request({"entry", "f", "0", "0", "0", "1", "0", "0", "0"});
            }),
            "zygote request \"entry\": field \"world_size\": 0 is below 1");
  EXPECT_EQ(error_of([] {
              fl::decode_zygote_request({"entry", "f"});
            }),
            "zygote request \"entry\": field \"rank\" is missing");
  EXPECT_EQ(error_of([] {
              fl::decode_zygote_request({"call", "f", "g"});
            }),
            "zygote request \"call\": 1 field too many after \"function\"");
  EXPECT_EQ(error_of([] {
              fl::decode_zygote_request({"fork", "now"});
            }),
            "zygote request: unknown kind \"fork\" (expected \"entry\", \"exec\", \"call\")");
  EXPECT_EQ(error_of([] { fl::decode_zygote_request({}); }), "zygote request: an empty message");
  EXPECT_EQ(error_of([] {
              fl::decode_zygote_request({"entry", "f", " 1", "0", "1", "1", "0", "0", "0"});
            }),
            "zygote request \"entry\": field \"rank\": \" 1\" is not a whole number");
}

TEST(ZygoteProtocol, RepliesAreCheckedToo) {
  EXPECT_EQ(error_of([] {
              fl::decode_zygote_reply({"exit", "-1", "0"});
            }),
            "zygote reply \"exit\": field \"pid\": -1 is below 1");
  EXPECT_EQ(error_of([] {
              fl::decode_zygote_reply({"exit", "12", ""});
            }),
            "zygote reply \"exit\": field \"status\": \"\" is not a whole number");
  EXPECT_EQ(error_of([] { fl::decode_zygote_reply({"started"}); }),
            "zygote reply \"started\": field \"pid\" is missing");
  EXPECT_EQ(error_of([] {
              fl::decode_zygote_reply({"entry", "f"});
            }),
            "zygote reply: unknown kind \"entry\" (expected \"started\", \"error\", \"exit\")");
}

// The zygote functions follow the one registry rule: the first of two registrations keeps the
// name, and an unknown name's message lists those registered and how to register one.
TEST(ZygoteProtocol, ZygoteFunctionsFollowTheRegistryRule) {
  auto first = [](int) { return 1; };
  auto second = [](int) { return 2; };
  EXPECT_TRUE(fl::register_zygote_function("test.zygote_rule", first));
  testing::internal::CaptureStderr();
  EXPECT_FALSE(fl::register_zygote_function("test.zygote_rule", second));
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("zygote function \"test.zygote_rule\" is registered twice"),
            std::string::npos)
      << said;
  EXPECT_NE(said.find("zygote_protocol_test.cpp"), std::string::npos) << "names the places";
  ASSERT_NE(fl::find_zygote_function("test.zygote_rule"), nullptr);
  EXPECT_EQ(fl::find_zygote_function("test.zygote_rule")(-1), 1) << "the first is kept";
  EXPECT_EQ(fl::find_zygote_function("nope"), nullptr);
  EXPECT_EQ(fl::unknown_zygote_function("nope"),
            "no zygote function named \"nope\" (registered: forkguard.data.worker, "
            "test.zygote_rule); register it with register_zygote_function");
}

TEST(ZygoteProtocol, TheInterpreterServersMessagesAreTypedToo) {
  // What notebook_launch, the DataLoader and guard() send python/forkguard/_server.py, as its
  // native loop (_native.serve_zygote) decodes them, and what it answers: the wire stays as the
  // callers send it (lists of fields through ForkServer::exchange).
  using forkguard::detail::encode_message;
  EXPECT_EQ(std::get<fl::DataLoaderHoldRequest>(
                fl::decode_server_request(wire({"dataloader_hold", "loader-7"})))
                .key,
            "loader-7");
  EXPECT_TRUE(std::holds_alternative<fl::HoldFdsRequest>(fl::decode_server_request({"hold_fds"})));
  EXPECT_EQ(
      std::get<fl::CallRequest>(fl::decode_server_request({"call", "forkguard.dataloader_worker"}))
          .function,
      "forkguard.dataloader_worker");
  const fl::EntryRequest rank{.name = "notebook",
                              .ctx = {.rank = 1, .world_size = 2, .args = {"/tmp", "[]"}},
                              .env = {"A=1"}};
  EXPECT_EQ(std::get<fl::EntryRequest>(fl::decode_server_request(wire(fl::encode(rank)))), rank);
  EXPECT_EQ(encode_message(fl::ReadyReply{.pid = 42, .preloaded = "[\"torch\"]", .errors = "{}"}),
            (Fields{"ready", "42", "[\"torch\"]", "{}"}));
  EXPECT_EQ(encode_message(fl::HeldReply{.count = 3}), (Fields{"held", "3"}));
  EXPECT_EQ(encode_message(fl::ReleasedReply{}), Fields{"released"});
  const fl::PreloadedReply preloaded{.preloaded = "[]", .errors = "{\"x\": \"ImportError\"}"};
  EXPECT_EQ(std::get<fl::PreloadedReply>(fl::decode_server_reply(wire(encode_message(preloaded)))),
            preloaded);

  EXPECT_EQ(error_of([] {
              fl::decode_server_request({"hold_fds", "x"});
            }),
            "interpreter server request \"hold_fds\": 1 field too many");
  EXPECT_EQ(error_of([] { fl::decode_server_request({"dataloader_release"}); }),
            "interpreter server request \"dataloader_release\": field \"key\" is missing");
  EXPECT_NE(error_of([] {
              fl::decode_server_request({"exec", "1", "/bin/true"});
            }).find("interpreter server request: unknown kind \"exec\""),
            std::string::npos);
  EXPECT_NE(error_of([] {
              fl::decode_server_reply({"held", "-1"});
            }).find("field \"count\""),
            std::string::npos);
}

TEST(ZygoteProtocol, AStartedReplyWithoutTheChildsPidfdIsRefused) {
  // Both fork servers send the child's pidfd with `started`. A server that does not (here: this
  // test's thread) gives no handle to anyone: the child could be signalled only by a PID that may
  // be another process's by then.
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
  forkguard::detail::UniqueFd ours(sv[0]), theirs(sv[1]);
  std::thread server([&] {
    Fields f;
    int fds[forkguard::detail::kMaxFds];
    if (!forkguard::detail::recv_message(theirs.get(), f, fds)) return;
    for (int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
    forkguard::detail::send_message(theirs.get(), fl::encode(fl::StartedReply{.pid = 4242}));
  });
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  const std::string why = error_of([&] {
    fl::ForkServer::attach(::getpid(), ours.get())->start_call("forkguard.dataloader_worker", p[0]);
  });
  server.join();
  ::close(p[0]);
  ::close(p[1]);
  EXPECT_EQ(why, fmt::format("the fork server (PID {}) started PID 4242 without its pidfd: it "
                             "could not be signalled safely",
                             ::getpid()));
}
