// Decimal integers in message fields, environment variables and /proc files, read strictly: the
// whole text, in the type's range, or nullopt. std::atoi reads "12abc" as 12 and "" as 0, and is
// undefined past INT_MAX: a negative or wrapped count then indexed past a vector's end.
#pragma once

#include <charconv>
#include <limits>
#include <optional>
#include <string>
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

// Why `s` is not a T, for a message that quotes it: "\"12x\" is not a whole number", "\"-1\" is
// negative", "\"99999999999\" is out of range (-2147483648 to 2147483647)"; empty when it is one.
template <class T>
std::string decimal_problem(std::string_view s) {
  T v{};
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  const std::string quoted = "\"" + std::string(s) + "\"";
  if (!s.empty() && ec == std::errc() && end == s.data() + s.size()) return {};
  if (!s.empty() && ec == std::errc::result_out_of_range && end == s.data() + s.size()) {
    return quoted + " is out of range (" + std::to_string(std::numeric_limits<T>::min()) + " to " +
           std::to_string(std::numeric_limits<T>::max()) + ")";
  }
  if (std::numeric_limits<T>::is_signed == false && s.size() > 1 && s[0] == '-' &&
      parse_decimal<unsigned long long>(s.substr(1))) {
    return quoted + " is negative";
  }
  return quoted + " is not a whole number";
}

}  // namespace forkguard::detail
