// Slurm's host list syntax, expanded without calling `scontrol show hostnames`.
//
//   auto hosts = forkguard::launch::HostList::parse("n[01-03,07],gpu-a[1-2]",
//   "SLURM_JOB_NODELIST"); hosts.size();    // 6 hosts.first();   // "n01" hosts.expand();  // n01
//   n02 n03 n07 gpu-a1 gpu-a2
//
// The forms Slurm documents and prints: hosts separated by commas; a bracket holds numbers and
// ranges separated by commas (`[1-3,7]`); a range keeps the zero padding of its lower bound
// (`[01-10]` -> 01 ... 10); text may follow a bracket (`n[1-2]-ib`), and a name may hold several
// brackets, expanded left to right (`r[1-2]n[1-2]` -> r1n1 r1n2 r2n1 r2n2).
//
// Parsing counts the hosts without making them: a list that names more than `kMaxHosts` (Slurm's
// own limit on a node range) is an error before anything is allocated for it. Every error names
// where the list came from (the variable), the list and the place in it.
//
// Thread-safety: a parsed HostList is an immutable value.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "forkguard/error.hpp"

namespace forkguard::launch {

class HostListError : public Error {
 public:
  using Error::Error;
};

class HostList {
 public:
  static constexpr size_t kMaxHosts = 65536;

  // `source` names the list in errors ("SLURM_JOB_NODELIST"). Throws HostListError.
  static HostList parse(std::string_view list, std::string_view source = "host list");

  size_t size() const noexcept { return count_; }
  std::string first() const;  // the first host, without expanding the rest
  std::vector<std::string> expand() const;

 private:
  struct Range {
    unsigned long lo = 0;
    unsigned long hi = 0;
    int width = 0;  // zero padding, from the lower bound's digits
  };
  struct Segment {
    std::string text;           // literal text before the ranges
    std::vector<Range> ranges;  // empty: a literal only
    size_t count() const;
  };
  using Name = std::vector<Segment>;

  std::string make(const Name& name, size_t index) const;

  std::vector<Name> names_;
  size_t count_ = 0;
};

}  // namespace forkguard::launch
