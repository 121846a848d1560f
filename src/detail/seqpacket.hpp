// Messages over a SOCK_SEQPACKET socket: a list of string fields in one datagram, with up to
// kMaxFds file descriptors attached by SCM_RIGHTS. Used by the fork server and by process workers.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace forkguard::detail {

inline constexpr int kMaxFds = 3;        // received with a message
inline constexpr int kMaxSendFds = 253;  // sent with one (SCM_MAX_FD)
inline constexpr size_t kMaxMessage = 4 << 20;

// Fields as (u32 length, bytes), concatenated.
std::string encode(const std::vector<std::string>& fields);
std::vector<std::string> decode(const char* data, size_t len);

// false when the peer is gone (EPIPE, ECONNRESET) or the message is too large; errno is set.
// Up to kMaxSendFds fds travel with it.
bool send_message(int sock, const std::vector<std::string>& fields, const int* fds = nullptr,
                  int nfds = 0);
// false on EOF or error (errno set; 0 on EOF); EAGAIN with MSG_DONTWAIT and nothing pending.
// Received fds (close-on-exec) land in fds[0..kMaxFds), -1 where absent.
bool recv_message(int sock, std::vector<std::string>& fields, int fds[kMaxFds], int flags = 0);
// The same with up to kMaxSendFds fds, all of them in `fds` (empty when none came).
bool recv_message(int sock, std::vector<std::string>& fields, std::vector<int>& fds, int flags = 0);

}  // namespace forkguard::detail
