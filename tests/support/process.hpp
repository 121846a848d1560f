// Test support: run a program to completion, or drive an interactive helper line by line.
// Children are spawned with posix_spawn, never left running (killed and reaped on destruction).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace forkguard::testing {

struct RunResult {
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;
  std::string out;
  std::string err;
};

using EnvOverrides = std::map<std::string, std::optional<std::string>>;  // nullopt: unset

// Runs argv with the current environment plus overrides; kills it after `timeout`.
RunResult run(const std::vector<std::string>& argv, const EnvOverrides& env = {},
              std::chrono::milliseconds timeout = std::chrono::seconds(60));

// A helper program with a line protocol on stdin/stdout.
class Interactive {
 public:
  Interactive(const std::vector<std::string>& argv, const EnvOverrides& env = {});
  ~Interactive();
  Interactive(const Interactive&) = delete;
  Interactive& operator=(const Interactive&) = delete;

  // Sends one line; returns the next line of output (without '\n'). Throws on EOF or timeout.
  std::string ask(const std::string& line,
                  std::chrono::milliseconds timeout = std::chrono::seconds(30));
  void send(const std::string& line);
  std::string read_line(std::chrono::milliseconds timeout = std::chrono::seconds(30));
  // Everything up to and including `needle` (no line buffering: for \r-updated output).
  std::string read_until(std::string_view needle,
                         std::chrono::milliseconds timeout = std::chrono::seconds(30));
  pid_t pid() const { return pid_; }
  // Closes stdin and waits; returns the wait status.
  int finish();

 private:
  pid_t pid_ = -1;
  int in_ = -1;
  int out_ = -1;
  std::string buffer_;
};

// A fresh directory under $TMPDIR, removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The process exists and is not a zombie (dead, awaiting its reaper).
bool is_alive(pid_t pid);
std::vector<int> open_fds();            // of this process, from /proc/self/fd
std::vector<pid_t> children_of(pid_t);  // from /proc/*/stat
std::string read_file(const std::string& path);

// The resident bytes (smaps' Rss) of `pid`'s mappings whose smaps header line ("start-end perms
// offset dev inode [name]") contains `match`.
size_t mapped_bytes(pid_t pid, const std::string& match);

}  // namespace forkguard::testing
