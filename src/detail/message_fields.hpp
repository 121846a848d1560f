// Typed messages over detail/seqpacket.hpp's string fields: each message is a struct that names its
// kind and lists its fields once, and that one list drives both its encoder and its decoder, so
// the two cannot drift apart.
//
//   struct ExitReport {
//     static constexpr std::string_view kKind = "exit";
//     pid_t pid = 0;
//     int status = 0;
//     template <class V, class M>
//     static void fields(V& v, M& m) {  // M: ExitReport or const ExitReport
//       v("pid", m.pid, at_least<pid_t>(1));
//       v("status", m.status);
//     }
//   };
//   encode_message(ExitReport{12, 0})  -> {"exit", "12", "0"}
//   decode_message<ExitReport>(f, "zygote reply", raise)
//
// Field types and their text: integers in decimal (read whole with std::from_chars, in the type's
// range and the field's bounds), enums as their integer, bools as "0"/"1", strings as they are
// (any bytes). A std::vector<std::string> is a count followed by that many fields; a vector of
// records is a count followed by each record's fields; v.rest(...) takes every field left (only
// last). A malformed message is an error naming the message and the field:
//   zygote request "entry": field "local_rank": "12x" is not a whole number
//   zygote request "entry": field "local_rank" is missing
//   zygote reply "exit": 1 field too many after "status"
//
// Thread-safety: pure functions.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "detail/decimal.hpp"

namespace forkguard::detail {

// The values a number field may take (both included).
template <class T>
struct Bounds {
  T lo = std::numeric_limits<T>::min();
  T hi = std::numeric_limits<T>::max();
};
template <class T>
constexpr Bounds<T> at_least(T lo) {
  return {lo, std::numeric_limits<T>::max()};
}

template <class T>
concept Number = std::integral<T> && !std::same_as<T, bool>;
template <class T>
concept Enum = std::is_enum_v<T>;

// Throws the caller's error type with the full message.
using RaiseError = void (*)(const std::string& message);

// Appends a message's fields.
class FieldWriter {
 public:
  std::vector<std::string> out;

  void operator()(const char*, const std::string& v) { out.push_back(v); }
  void operator()(const char*, bool v) { out.emplace_back(v ? "1" : "0"); }
  template <Number T>
  void operator()(const char*, T v, Bounds<T> = {}) {
    out.push_back(std::to_string(v));
  }
  template <Enum E>
  void operator()(const char*, E v, Bounds<E>) {
    out.push_back(std::to_string(static_cast<std::underlying_type_t<E>>(v)));
  }
  void operator()(const char*, const std::vector<std::string>& v, size_t = 0) {
    out.push_back(std::to_string(v.size()));
    out.insert(out.end(), v.begin(), v.end());
  }
  template <class R, class Fields>
  requires(!std::same_as<R, std::string>) void operator()(const char*, const std::vector<R>& v,
                                                          Fields record_fields) {
    out.push_back(std::to_string(v.size()));
    for (const R& r : v) record_fields(*this, r);
  }
  void rest(const char*, const std::vector<std::string>& v) {
    out.insert(out.end(), v.begin(), v.end());
  }
};

// Reads a message's fields in the order its field list names them.
class FieldReader {
 public:
  // `what`: the message, as errors name it ("zygote request \"entry\""); f[0] is its kind.
  FieldReader(const std::vector<std::string>& f, std::string what, RaiseError raise)
      : f_(f), what_(std::move(what)), raise_(raise) {}

  void operator()(const char* name, std::string& v) { v = next(name); }
  void operator()(const char* name, bool& v) {
    const std::string& s = next(name);
    if (s != "0" && s != "1") fail(name, fmt::format("\"{}\" is not 0 or 1", s));
    v = s == "1";
  }
  template <Number T>
  void operator()(const char* name, T& v, Bounds<T> b = {}) {
    v = number<T>(name, b);
  }
  template <Enum E>
  void operator()(const char* name, E& v, Bounds<E> b) {
    using U = std::underlying_type_t<E>;
    v = static_cast<E>(number<U>(name, {static_cast<U>(b.lo), static_cast<U>(b.hi)}));
  }
  void operator()(const char* name, std::vector<std::string>& v, size_t min_count = 0) {
    const size_t n = count(name, 1);
    if (n < min_count) fail(name, fmt::format("{} fields, at least {} expected", n, min_count));
    v.assign(f_.begin() + static_cast<std::ptrdiff_t>(at_),
             f_.begin() + static_cast<std::ptrdiff_t>(at_ + n));
    at_ += n;
  }
  template <class R, class Fields>
  requires(!std::same_as<R, std::string>) void operator()(const char* name, std::vector<R>& v,
                                                          Fields record_fields) {
    FieldWriter width;
    const R blank{};
    record_fields(width, blank);
    const size_t n = count(name, width.out.size());
    v.clear();
    v.reserve(n);
    for (size_t i = 0; i < n; ++i) record_fields(*this, v.emplace_back());
  }
  void rest(const char* name, std::vector<std::string>& v) {
    v.assign(f_.begin() + static_cast<std::ptrdiff_t>(std::min(at_, f_.size())), f_.end());
    at_ = f_.size();
    last_ = name;
  }

  // After the last field: none may be left over.
  void finish() const {
    if (at_ >= f_.size()) return;
    const size_t extra = f_.size() - at_;
    raise_(fmt::format("{}: {} field{} too many{}", what_, extra, extra == 1 ? "" : "s",
                       last_ == nullptr ? "" : fmt::format(" after \"{}\"", last_)));
  }

 private:
  [[noreturn]] void fail(const char* name, const std::string& why) const {
    raise_(fmt::format("{}: field \"{}\": {}", what_, name, why));
    std::abort();  // raise_ throws
  }

  const std::string& next(const char* name) {
    if (at_ >= f_.size()) {
      raise_(fmt::format("{}: field \"{}\" is missing", what_, name));
      std::abort();
    }
    last_ = name;
    return f_[at_++];
  }

  template <class T>
  T number(const char* name, Bounds<T> b) {
    const std::string& s = next(name);
    const auto v = parse_decimal<T>(s);
    if (!v) fail(name, decimal_problem<T>(s));
    if (*v < b.lo) fail(name, fmt::format("{} is below {}", *v, b.lo));
    if (*v > b.hi) fail(name, fmt::format("{} is above {}", *v, b.hi));
    return *v;
  }

  // A count of the items that follow, each `width` fields: at most what the message holds.
  size_t count(const char* name, size_t width) {
    const auto n = number<size_t>(name, {});
    const size_t left = f_.size() - at_;
    if (width > 0 && n > left / width) {
      const std::string follow =
          fmt::format("{} field{}", left, left == 1 ? " follows" : "s follow");
      fail(name, width == 1 ? fmt::format("{} items, but {}", n, follow)
                            : fmt::format("{} items of {} fields, but {}", n, width, follow));
    }
    return n;
  }

  const std::vector<std::string>& f_;
  std::string what_;
  RaiseError raise_;
  size_t at_ = 1;  // f_[0] is the kind
  const char* last_ = nullptr;
};

template <class M>
std::vector<std::string> encode_message(const M& m) {
  FieldWriter w;
  w.out.emplace_back(M::kKind);
  M::fields(w, m);
  return std::move(w.out);
}

// `protocol`: "zygote request"; the caller has checked f[0] == M::kKind.
template <class M>
M decode_message(const std::vector<std::string>& f, std::string_view protocol, RaiseError raise) {
  M m;
  FieldReader r(f, fmt::format("{} \"{}\"", protocol, M::kKind), raise);
  M::fields(r, m);
  r.finish();
  return m;
}

// One of the messages a std::variant lists, chosen by f[0]; an empty message or an unknown kind is
// an error naming the kinds expected.
template <class Variant>
Variant decode_one_of(const std::vector<std::string>& f, std::string_view protocol,
                      RaiseError raise) {
  if (f.empty()) {
    raise(fmt::format("{}: an empty message", protocol));
    std::abort();
  }
  std::optional<Variant> out;
  std::string kinds;
  [&]<size_t... I>(std::index_sequence<I...>) {
    (
        [&] {
          using M = std::variant_alternative_t<I, Variant>;
          kinds += fmt::format("{}\"{}\"", I == 0 ? "" : ", ", M::kKind);
          if (!out && f[0] == M::kKind) out.emplace(decode_message<M>(f, protocol, raise));
        }(),
        ...);
  }
  (std::make_index_sequence<std::variant_size_v<Variant>>());
  if (!out) {
    raise(fmt::format("{}: unknown kind \"{}\" (expected {})", protocol, f[0], kinds));
    std::abort();
  }
  return std::move(*out);
}

}  // namespace forkguard::detail
