// What the two command-line programs (forkguard and forkguard-bench) share.
#pragma once

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <string>

namespace forkguard::cli {

// A whole number from lo to hi, said in a short message. CLI11's PositiveNumber/NonNegativeNumber
// refused "abc" with the whole double range ("not in range 0 to 1.79769e+308" spelled out: 308
// digits).
inline CLI::Validator whole_number(const char* what, long lo, long hi) {
  return CLI::Validator(
      [what, lo, hi](std::string& s) -> std::string {
        long v = 0;
        auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (ec == std::errc() && end == s.data() + s.size() && v >= lo && v <= hi) return {};
        return fmt::format("{} is a whole number from {} to {}, not \"{}\"", what, lo, hi, s);
      },
      fmt::format("{}..{}", lo, hi));
}

}  // namespace forkguard::cli
