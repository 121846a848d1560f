// One name -> factory registry, used by every registry forkguard keeps: dataset types, transform
// types, entry functions, worker init hooks and zygote functions. One rule for all of them:
// - a duplicate name keeps the first registration; the second is refused (add() returns false)
//   with a line on stderr naming both places;
// - an unknown name's error lists the names registered and how to register one:
//   no dataset type named "x" (registered: file_list, synthetic); register it with
//   FORKGUARD_REGISTER_DATASET
//
//   Registry<DatasetFactory>& datasets() {   // a function-local static: registration runs during
//     static Registry<DatasetFactory> r("dataset type", "FORKGUARD_REGISTER_DATASET");
//     return r;                               // static initialization, in any order
//   }
//
// Registration normally happens at static-initialization time (so the fork server, a fork of the
// program made in init(), has every entry too); it may also happen later.
// Thread-safety: every member may be called from any thread.
#pragma once

#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace forkguard::detail {

template <class Factory>
class Registry {
 public:
  // `what` names an entry in messages ("dataset type"); `how` says how to register one
  // ("FORKGUARD_REGISTER_DATASET").
  Registry(std::string what, std::string how) : what_(std::move(what)), how_(std::move(how)) {}
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Registers `factory` as `name`, unless the name is taken: then the first registration stays,
  // a line on stderr names both places, and false is returned. The place defaults to the caller's
  // (__builtin_FILE/__builtin_LINE, which GCC and Clang both take: clang 14 has no
  // std::source_location).
  bool add(std::string_view name, Factory factory, const char* file = __builtin_FILE(),
           int line = __builtin_LINE()) {
    std::lock_guard lock(mutex_);
    auto [it, added] =
        entries_.try_emplace(std::string(name), Entry{std::move(factory), file, line});
    if (!added) {
      const Entry& first = it->second;
      std::fprintf(stderr,
                   "forkguard: %s \"%s\" is registered twice (at %s:%d, then at %s:%d); the first "
                   "is kept\n",
                   what_.c_str(), it->first.c_str(), first.file, first.line, file, line);
    }
    return added;
  }

  // The factory registered as `name`, or nullopt.
  std::optional<Factory> find(std::string_view name) const {
    std::lock_guard lock(mutex_);
    auto it = entries_.find(name);
    if (it == entries_.end()) return std::nullopt;
    return it->second.factory;
  }

  // The names registered, sorted.
  std::vector<std::string> names() const {
    std::lock_guard lock(mutex_);
    std::vector<std::string> out;
    out.reserve(entries_.size());
    for (const auto& [name, entry] : entries_) out.push_back(name);
    return out;
  }

  // "a, b", or "none".
  std::string name_list() const {
    std::string out;
    for (const auto& n : names()) out += (out.empty() ? "" : ", ") + n;
    return out.empty() ? "none" : out;
  }

  // The message for a name nobody registered.
  std::string unknown(std::string_view name) const {
    return "no " + what_ + " named \"" + std::string(name) + "\" (registered: " + name_list() +
           "); register it with " + how_;
  }

 private:
  struct Entry {
    Factory factory;
    const char* file;  // where it was registered: a string literal (__builtin_FILE)
    int line;
  };

  const std::string what_;
  const std::string how_;
  mutable std::mutex mutex_;
  std::map<std::string, Entry, std::less<>> entries_;
};

}  // namespace forkguard::detail
