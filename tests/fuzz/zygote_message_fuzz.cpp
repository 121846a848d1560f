// The fork server's messages: the bytes as one datagram, split into fields by the socket layer's
// decode() (detail/seqpacket.hpp), then given to every request and report decoder the zygote and
// the program use. A well-formed request must encode back to the same fields.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "detail/seqpacket.hpp"
#include "forkguard/error.hpp"
#include "launch/zygote_protocol.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace forkguard::launch::detail;
  const auto f = forkguard::detail::decode(reinterpret_cast<const char*>(data), size);
  try {
    const EntryRequest r = decode_entry_request(f);
    if (encode_entry_request(r.name, r.ctx, r.env).size() != f.size()) std::abort();
  } catch (const forkguard::Error&) {
  }
  try {
    const ExecRequest r = decode_exec_request(f);
    if (r.argv.empty() || encode_exec_request(r.argv, r.env).size() != f.size()) std::abort();
  } catch (const forkguard::Error&) {
  }
  if (auto exit = decode_exit_report(f); exit && exit->first <= 0) std::abort();
  return 0;
}
