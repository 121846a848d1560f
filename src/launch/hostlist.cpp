#include "forkguard/launch/hostlist.hpp"

#include <fmt/format.h>

namespace forkguard::launch {
namespace {

constexpr std::string_view kSeparators = ", \t\n";
constexpr size_t kMaxDigits = 18;  // fits an unsigned long with room for hi - lo + 1

class Parser {
 public:
  Parser(std::string_view list, std::string_view source) : list_(list), source_(source) {}

  [[noreturn]] void fail(size_t pos, std::string_view why) const {
    throw HostListError(
        fmt::format("{}=\"{}\": {} (at character {})", source_, list_, why, pos + 1));
  }
  [[noreturn]] void fail(std::string_view why) const {
    throw HostListError(fmt::format("{}=\"{}\": {}", source_, list_, why));
  }

  // One number of a bracket, with its digit count for the padding.
  unsigned long number(size_t& pos, int& width) const {
    size_t start = pos;
    unsigned long v = 0;
    while (pos < list_.size() && list_[pos] >= '0' && list_[pos] <= '9') {
      if (pos - start == kMaxDigits) fail(start, "a number in brackets has too many digits");
      v = v * 10 + static_cast<unsigned long>(list_[pos] - '0');
      ++pos;
    }
    if (pos == start) {
      fail(pos, pos < list_.size()
                    ? fmt::format("expected a number in brackets, found '{}'", list_[pos])
                    : std::string("expected a number in brackets, found the end"));
    }
    width = static_cast<int>(pos - start);
    return v;
  }

 private:
  std::string_view list_;
  std::string_view source_;
};

}  // namespace

size_t HostList::Segment::count() const {
  if (ranges.empty()) return 1;
  size_t n = 0;
  for (const auto& r : ranges) n += r.hi - r.lo + 1;
  return n;
}

HostList HostList::parse(std::string_view list, std::string_view source) {
  Parser p(list, source);
  HostList out;
  size_t pos = 0;
  auto add = [&](size_t& total, size_t n, size_t at) {
    // Both factors are at most kMaxHosts, so the products below cannot overflow.
    if (n > kMaxHosts || total + n > kMaxHosts) {
      p.fail(at, fmt::format("names more than {} hosts", kMaxHosts));
    }
    total += n;
  };
  while (pos < list.size()) {
    if (kSeparators.find(list[pos]) != std::string_view::npos) {
      ++pos;
      continue;
    }
    const size_t name_start = pos;
    Name name;
    size_t name_count = 1;
    while (pos < list.size() && kSeparators.find(list[pos]) == std::string_view::npos) {
      Segment seg;
      while (pos < list.size() && list[pos] != '[' &&
             kSeparators.find(list[pos]) == std::string_view::npos) {
        if (list[pos] == ']') p.fail(pos, "']' without a '['");
        seg.text += list[pos++];
      }
      if (pos < list.size() && list[pos] == '[') {
        const size_t open = pos++;
        size_t seg_count = 0;
        for (;;) {
          if (pos >= list.size()) p.fail(open, "'[' is not closed");
          if (list[pos] == '[') p.fail(pos, "'[' inside brackets");
          Range r;
          int hi_width = 0;
          const size_t range_start = pos;
          r.lo = p.number(pos, r.width);
          r.hi = r.lo;
          if (pos < list.size() && list[pos] == '-') {
            ++pos;
            r.hi = p.number(pos, hi_width);
            if (r.hi < r.lo) {
              p.fail(range_start, fmt::format("range {}-{} goes down", r.lo, r.hi));
            }
          }
          if (r.hi - r.lo >= kMaxHosts) {
            p.fail(range_start, fmt::format("range {}-{} names {} hosts, more than {}", r.lo, r.hi,
                                            r.hi - r.lo + 1, kMaxHosts));
          }
          add(seg_count, r.hi - r.lo + 1, range_start);
          seg.ranges.push_back(r);
          if (pos >= list.size()) p.fail(open, "'[' is not closed");
          if (list[pos] == ']') {
            ++pos;
            break;
          }
          if (list[pos] != ',') {
            p.fail(pos, fmt::format("expected ',', '-' or ']' in brackets, found '{}'", list[pos]));
          }
          ++pos;
        }
        if (name_count * seg_count > kMaxHosts) {
          p.fail(name_start, fmt::format("names more than {} hosts", kMaxHosts));
        }
        name_count *= seg_count;
      }
      name.push_back(std::move(seg));
    }
    add(out.count_, name_count, name_start);
    out.names_.push_back(std::move(name));
  }
  if (out.count_ == 0) p.fail("names no host");
  return out;
}

std::string HostList::make(const Name& name, size_t index) const {
  // Mixed radix, the last bracket varying fastest (as Slurm expands r[1-2]n[1-2]).
  std::vector<std::string> parts(name.size());
  for (size_t s = name.size(); s-- > 0;) {
    const Segment& seg = name[s];
    parts[s] = seg.text;
    if (seg.ranges.empty()) continue;
    const size_t n = seg.count();
    size_t digit = index % n;
    index /= n;
    for (const auto& r : seg.ranges) {
      const size_t span = r.hi - r.lo + 1;
      if (digit < span) {
        parts[s] += fmt::format("{:0{}}", r.lo + digit, r.width);
        break;
      }
      digit -= span;
    }
  }
  std::string host;
  for (const auto& part : parts) host += part;
  return host;
}

std::string HostList::first() const {
  return make(names_.front(), 0);
}

std::vector<std::string> HostList::expand() const {
  std::vector<std::string> hosts;
  hosts.reserve(count_);
  for (const auto& name : names_) {
    size_t n = 1;
    for (const auto& seg : name) n *= seg.count();
    for (size_t i = 0; i < n; ++i) hosts.push_back(make(name, i));
  }
  return hosts;
}

}  // namespace forkguard::launch
