// Process workers' messages: the bytes as one datagram, split into fields by the socket layer's
// decode(), then given to the slot, task and done decoders. And the other way: a task result made
// of the fields (any bytes in its message, key and skipped samples, as a bad file name gives)
// must survive encode_done() -> encode() -> decode() -> decode_done() unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "data/worker_protocol.hpp"
#include "detail/seqpacket.hpp"
#include "forkguard/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace forkguard::data;
  using namespace forkguard::data::detail;
  const auto f = forkguard::detail::decode(reinterpret_cast<const char*>(data), size);
  try {
    (void)decode_slot(f);
  } catch (const forkguard::Error&) {
  }
  try {
    (void)decode_task(f);
  } catch (const forkguard::Error&) {
  }
  try {
    (void)decode_done(0, f);
  } catch (const forkguard::Error&) {
  }

  TaskResult r;
  r.kind = TaskResult::Kind::kData;
  r.message = f.empty() ? "" : f[0];
  r.key = f.size() < 2 ? "" : f[1];
  r.index = size;
  for (size_t i = 2; i + 1 < f.size(); i += 2) {
    r.skipped.push_back(
        {.position = i, .index = i * 7, .key = f[i], .reason = f[i + 1], .substitute = i + 1});
  }
  const std::string wire = forkguard::detail::encode(encode_done(42, 3, r, 99));
  const auto back = decode_done(5, forkguard::detail::decode(wire.data(), wire.size()));
  if (!back || back->batch != 42 || back->slot != 3 || back->idle_ns != 99 ||
      back->result.message != r.message || back->result.key != r.key ||
      back->result.skipped.size() != r.skipped.size()) {
    std::abort();
  }
  for (size_t i = 0; i < r.skipped.size(); ++i) {
    if (back->result.skipped[i].key != r.skipped[i].key ||
        back->result.skipped[i].reason != r.skipped[i].reason) {
      std::abort();
    }
  }
  return 0;
}
