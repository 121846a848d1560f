// Process workers' messages: the bytes as one datagram, split into fields by the socket layer's
// decode(), then given to the request and reply decoders. A message that decodes must come back
// the same through its encoder and the socket layer (decode(encode(x)) == x), and so must a task
// result made of the fields (any bytes in its message, key and skipped samples, as a bad file name
// gives).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <variant>

#include "data/worker_protocol.hpp"
#include "detail/seqpacket.hpp"
#include "forkguard/error.hpp"
#include "round_trip.hpp"

namespace {

using namespace forkguard::data::detail;

using forkguard::fuzz::check_round_trip;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto f = forkguard::detail::decode(reinterpret_cast<const char*>(data), size);
  try {
    check_round_trip(decode_worker_request(f), &decode_worker_request);
  } catch (const forkguard::Error&) {
  }
  try {
    check_round_trip(decode_worker_reply(f), &decode_worker_reply);
  } catch (const forkguard::Error&) {
  }

  DoneReply done{.batch = 42, .slot = 3, .result = {}, .idle_ns = 99};
  done.result.kind = TaskResult::Kind::kData;
  done.result.message = f.empty() ? "" : f[0];
  done.result.key = f.size() < 2 ? "" : f[1];
  done.result.index = size;
  for (size_t i = 2; i + 1 < f.size(); i += 2) {
    done.result.skipped.push_back(
        {.position = i, .index = i * 7, .key = f[i], .reason = f[i + 1], .substitute = i + 1});
  }
  check_round_trip(WorkerReply(done), &decode_worker_reply);
  check_round_trip(WorkerReply(FailedReply{.message = done.result.message}), &decode_worker_reply);
  return 0;
}
