// Decimal integers in message fields and /proc files, read strictly: the whole text, in the
// type's range, or nullopt. std::atoi reads "12abc" as 12 and "" as 0, and is undefined past
// INT_MAX: a negative or wrapped count then indexed past a vector's end.
#pragma once

#include <charconv>
#include <optional>
#include <string_view>
#include <system_error>

namespace forkguard::detail {

template <class T>
std::optional<T> parse_decimal(std::string_view s) {
  T v{};
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}

}  // namespace forkguard::detail
