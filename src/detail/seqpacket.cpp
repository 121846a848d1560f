#include "detail/seqpacket.hpp"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>

namespace forkguard::detail {

std::string encode(const std::vector<std::string>& fields) {
  size_t total = 0;
  for (const auto& f : fields) total += sizeof(uint32_t) + f.size();
  std::string out;
  out.reserve(total);
  for (const auto& f : fields) {
    uint32_t len = static_cast<uint32_t>(f.size());
    out.append(reinterpret_cast<const char*>(&len), sizeof len);
    out += f;
  }
  return out;
}

std::vector<std::string> decode(const char* data, size_t len) {
  std::vector<std::string> fields;
  size_t pos = 0;
  while (pos + sizeof(uint32_t) <= len) {
    uint32_t n;
    std::memcpy(&n, data + pos, sizeof n);
    pos += sizeof n;
    if (pos + n > len) break;
    fields.emplace_back(data + pos, n);
    pos += n;
  }
  return fields;
}

bool send_message(int sock, const std::vector<std::string>& fields, const int* fds, int nfds) {
  std::string data = encode(fields);
  iovec iov{data.data(), data.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  // Up to SCM_MAX_FD; kMaxFds of them without an allocation.
  alignas(cmsghdr) char few[CMSG_SPACE(sizeof(int) * kMaxFds)] = {};
  std::vector<cmsghdr> many;  // cmsghdr-aligned storage
  char* control = few;
  nfds = std::min(nfds, kMaxSendFds);
  if (nfds > kMaxFds) {
    many.resize(CMSG_SPACE(sizeof(int) * static_cast<size_t>(nfds)) / sizeof(cmsghdr) + 1);
    control = reinterpret_cast<char*>(many.data());
  }
  if (nfds > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * static_cast<size_t>(nfds));
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * static_cast<size_t>(nfds));
    std::memcpy(CMSG_DATA(c), fds, sizeof(int) * static_cast<size_t>(nfds));
  }
  ssize_t n;
  do {
    n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(data.size());
}

namespace {

// Up to `max_fds` (at most kMaxSendFds) received fds land in fds[0..max_fds), -1 where absent.
bool receive(int sock, std::vector<std::string>& fields, int* fds, int max_fds, int flags) {
  // One per thread, not one per message, and never cleared: zeroing 4 MiB faults in a thousand
  // pages (3 ms on a VM) before a fresh process's first message; the kernel writes only what
  // arrives.
  thread_local std::unique_ptr<char[]> buf(new char[kMaxMessage]);
  iovec iov{buf.get(), kMaxMessage};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxSendFds)] = {};
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * static_cast<size_t>(max_fds));
  ssize_t n;
  bool reset_seen = false;
  while (true) {
    n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | flags);
    if (n >= 0 || errno == EINTR) {
      if (n >= 0) break;
      continue;
    }
    // A peer that closed with messages of ours unread leaves ECONNRESET pending, and the kernel
    // reports it before the messages the peer sent us: report those first (the error is
    // cleared once read; EOF follows them).
    if (errno == ECONNRESET && !reset_seen) {
      reset_seen = true;
      continue;
    }
    break;
  }
  for (int i = 0; i < max_fds; ++i) fds[i] = -1;
  if (n <= 0) {
    if (n == 0) errno = 0;
    return false;
  }
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      std::memcpy(fds, CMSG_DATA(c),
                  sizeof(int) * std::min<size_t>(count, static_cast<size_t>(max_fds)));
    }
  }
  fields = decode(buf.get(), static_cast<size_t>(n));
  return true;
}

}  // namespace

bool recv_message(int sock, std::vector<std::string>& fields, int fds[kMaxFds], int flags) {
  return receive(sock, fields, fds, kMaxFds, flags);
}

bool recv_message(int sock, std::vector<std::string>& fields, std::vector<int>& fds, int flags) {
  int all[kMaxSendFds];
  const bool ok = receive(sock, fields, all, kMaxSendFds, flags);
  fds.clear();
  for (int fd : all) {
    if (fd < 0) break;
    fds.push_back(fd);
  }
  return ok;
}

}  // namespace forkguard::detail
