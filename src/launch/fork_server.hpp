// The fork server (zygote): a process forked by forkguard::init() while the program is still
// clean, which forks ranks on request. Driven over a SOCK_SEQPACKET socketpair (no path anyone
// else can connect to); the ranks' stdout/stderr travel with each request by SCM_RIGHTS. It
// re-probes itself before every fork, reaps its children and reports each exit status.
#pragma once

#include <sys/types.h>

#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "detail/fd.hpp"
#include "forkguard/launch/entry.hpp"

namespace forkguard::launch::detail {

class ForkServer {
 public:
  // The server init() started, or nullptr.
  static ForkServer* get();
  // Forks the zygote. Called by init() only.
  static void start();

  // Asks the zygote to fork a rank running `entry`, or to fork+exec argv; `env` is the complete
  // environment ("K=V"). Returns the rank's PID; throws SpawnError with the zygote's reason.
  pid_t start_entry(const std::string& entry, const RankContext& ctx,
                    const std::vector<std::string>& env, int stdout_fd, int stderr_fd);
  pid_t start_exec(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                   int stdout_fd, int stderr_fd);

  int fd() const { return sock_.get(); }
  pid_t pid() const { return pid_; }
  // Exit reports received so far (PID, wait status); reads what is pending without blocking.
  std::vector<std::pair<pid_t, int>> take_exits();

 private:
  ForkServer(pid_t pid, int sock) : pid_(pid), sock_(sock) {}
  pid_t request(const std::vector<std::string>& fields, int stdout_fd, int stderr_fd);
  bool read_one(bool block);  // one message: exit reports are queued, a reply is stored

  pid_t pid_;
  forkguard::detail::UniqueFd sock_;
  std::mutex mutex_;
  std::vector<std::pair<pid_t, int>> exits_;
  std::vector<std::string> reply_;
  bool have_reply_ = false;
};

// Message framing, shared by both ends: fields as (u32 length, bytes) in one datagram.
std::string encode(const std::vector<std::string>& fields);
std::vector<std::string> decode(const char* data, size_t len);

}  // namespace forkguard::launch::detail
