// The fork server's messages: the bytes as one datagram, split into fields by the socket layer's
// decode() (detail/seqpacket.hpp), then given to the request and reply decoders the zygote and the
// program use. A message that decodes must come back the same through its encoder and the socket
// layer (decode(encode(x)) == x), and so must messages built from the fields (any bytes in names,
// arguments and environment strings).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <variant>

#include "detail/seqpacket.hpp"
#include "forkguard/error.hpp"
#include "launch/zygote_protocol.hpp"
#include "round_trip.hpp"

namespace {

using namespace forkguard::launch::detail;

using forkguard::fuzz::check_round_trip;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto f = forkguard::detail::decode(reinterpret_cast<const char*>(data), size);
  try {
    check_round_trip(decode_zygote_request(f), &decode_zygote_request);
  } catch (const forkguard::Error&) {
  }
  try {
    check_round_trip(decode_zygote_reply(f), &decode_zygote_reply);
  } catch (const forkguard::Error&) {
  }
  // The interpreter fork server's (python/forkguard/_server.py, decoded by _native.serve_zygote).
  try {
    check_round_trip(decode_server_request(f), &decode_server_request);
  } catch (const forkguard::Error&) {
  }
  try {
    check_round_trip(decode_server_reply(f), &decode_server_reply);
  } catch (const forkguard::Error&) {
  }

  // Messages made of the fields, as arbitrary as names and environments get.
  const size_t half = f.size() / 2;
  EntryRequest entry;
  entry.name = f.empty() ? "" : f[0];
  entry.ctx.rank = static_cast<int>(size);
  entry.ctx.world_size = static_cast<int>(size) + 1;
  entry.ctx.args.assign(f.begin() + static_cast<std::ptrdiff_t>(std::min<size_t>(1, half)),
                        f.begin() + static_cast<std::ptrdiff_t>(half));
  entry.env.assign(f.begin() + static_cast<std::ptrdiff_t>(half), f.end());
  check_round_trip(ZygoteRequest(entry), &decode_zygote_request);
  if (!f.empty()) {
    check_round_trip(ZygoteRequest(ExecRequest{
                         .argv = {f.begin(), f.begin() + 1 + static_cast<std::ptrdiff_t>(half)},
                         .env = {f.begin() + 1 + static_cast<std::ptrdiff_t>(half), f.end()}}),
                     &decode_zygote_request);
    check_round_trip(ZygoteRequest(CallRequest{.function = f[0]}), &decode_zygote_request);
    check_round_trip(ZygoteReply(ErrorReply{.message = f[0]}), &decode_zygote_reply);
    check_round_trip(ServerRequest(DataLoaderHoldRequest{.key = f[0]}), &decode_server_request);
    check_round_trip(ServerRequest(GuardStartRequest{.name = f[0]}), &decode_server_request);
    check_round_trip(ServerReply(PreloadedReply{.preloaded = f[0], .errors = f.back()}),
                     &decode_server_reply);
  }
  return 0;
}
