#include "launch/zygote_loop.hpp"

#include <unistd.h>

#include <cerrno>

#include "detail/seqpacket.hpp"
#include "forkguard/error.hpp"
#include "launch/zygote_protocol.hpp"

namespace forkguard::launch::detail {

using forkguard::detail::send_message;

int ZygoteHandler::wait(pollfd* fds, size_t count) {
  return ::poll(fds, static_cast<nfds_t>(count), -1);
}

void serve_zygote(int sock, ZygoteHandler& handler, std::map<pid_t, Child>& children) {
  std::vector<pollfd> polled;
  std::vector<int> own;
  std::vector<std::string> fields;
  std::vector<int> fds;
  while (true) {
    polled.assign(1, {sock, POLLIN, 0});
    for (auto& [pid, child] : children) polled.push_back({child.pidfd(), POLLIN, 0});
    if (handler.wait(polled.data(), polled.size()) < 0) {
      if (errno == EINTR) continue;
      throw SystemError("fork server: poll", errno);
    }
    // Exits first, in PID order: a child reported here was started (and replied to) before.
    for (auto it = children.begin(); it != children.end();) {
      if (auto status = it->second.try_wait()) {
        const auto report = encode(ExitReport{.pid = it->first, .status = status->wait_status()});
        it = children.erase(it);
        if (!send_message(sock, report)) return;  // the program is gone
      } else {
        ++it;
      }
    }
    if (polled[0].revents == 0) continue;
    if (!forkguard::detail::recv_message(sock, fields, fds)) {
      if (errno == 0) return;  // EOF: the program is gone, or let go of its server
      throw SystemError("fork server: its socket", errno);
    }
    own.assign(1, sock);
    for (auto& [pid, child] : children) own.push_back(child.pidfd());
    auto outcome = handler.handle(fields, fds, own);
    for (int fd : fds) ::close(fd);
    if (auto* child = std::get_if<Child>(&outcome)) {
      const pid_t pid = child->pid();
      const int pidfd = child->pidfd();
      children.emplace(pid, std::move(*child));
      if (!send_message(sock, encode(StartedReply{.pid = pid}), &pidfd, 1)) return;
    } else if (!send_message(sock, std::get<std::vector<std::string>>(outcome))) {
      return;
    }
  }
}

}  // namespace forkguard::launch::detail
