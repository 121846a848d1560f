// The message fuzz targets' round trip: a message that decodes must come back the same through
// its encoder and the socket layer (decode(encode(x)) == x); a difference aborts (a finding).
#pragma once

#include <cstdlib>
#include <string>
#include <variant>
#include <vector>

#include "detail/seqpacket.hpp"

namespace forkguard::fuzz {

// Fields through the socket layer's framing, as one datagram carries them.
inline std::vector<std::string> wire(const std::vector<std::string>& fields) {
  const std::string bytes = forkguard::detail::encode(fields);
  return forkguard::detail::decode(bytes.data(), bytes.size());
}

// `encode` is the message's own (found with its type); `decode` the protocol's decoder.
template <class Variant, class Decode>
void check_round_trip(const Variant& v, Decode decode) {
  std::visit(
      [&](const auto& m) {
        if (decode(wire(encode(m))) != Variant(m)) std::abort();
      },
      v);
}

}  // namespace forkguard::fuzz
