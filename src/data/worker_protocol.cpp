#include "data/worker_protocol.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include "forkguard/data/error.hpp"
#include "forkguard/error.hpp"

namespace forkguard::data::detail {
namespace {

using forkguard::detail::decode_one_of;
using forkguard::detail::encode_message;

[[noreturn]] void raise(const std::string& message) {
  throw DataError(message);
}

}  // namespace

WorkerEvent DoneReply::event(int worker) const {
  WorkerEvent e;
  e.kind = WorkerEvent::Kind::kDone;
  e.worker = worker;
  e.batch = batch;
  e.slot = slot;
  e.result = result;
  e.idle_ns = idle_ns;
  return e;
}

std::vector<std::string> encode(const SetupMessage& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const SlotMessage& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const TaskMessage& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const ReadyReply& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const FailedReply& m) {
  return encode_message(m);
}
std::vector<std::string> encode(const DoneReply& m) {
  return encode_message(m);
}

WorkerRequest decode_worker_request(const std::vector<std::string>& f) {
  return decode_one_of<WorkerRequest>(f, "process worker request", &raise);
}

WorkerReply decode_worker_reply(const std::vector<std::string>& f) {
  return decode_one_of<WorkerReply>(f, "process worker reply", &raise);
}

forkguard::detail::UniqueFd setup_memfd(const std::string& setup) {
  forkguard::detail::UniqueFd fd(
      ::memfd_create("forkguard-setup", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) throw SystemError("memfd_create for the process workers' setup", errno);
  for (size_t done = 0; done < setup.size();) {
    const ssize_t n =
        ::pwrite(fd.get(), setup.data() + done, setup.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw SystemError(
          fmt::format("writing the process workers' setup ({} bytes) to a memfd", setup.size()),
          n < 0 ? errno : ENOSPC);
    }
    done += static_cast<size_t>(n);
  }
  // Sealed: every worker reads the same bytes, and none can change them for the others.
  ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
  return fd;
}

std::string read_setup(int fd, size_t size) {
  std::string out(size, '\0');
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::pread(fd, out.data() + done, size - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw SystemError(fmt::format("reading the worker's setup ({} bytes)", size),
                        n < 0 ? errno : EIO);
    }
    done += static_cast<size_t>(n);
  }
  return out;
}

std::optional<ReceivedSetup> receive_setup(int sock) {
  ReceivedSetup out;
  int fds[kMaxFds];
  if (!recv_message(sock, out.fields, fds)) return std::nullopt;
  out.memfd = UniqueFd(fds[0]);
  for (int k = 1; k < kMaxFds; ++k) {
    if (fds[k] >= 0) ::close(fds[k]);
  }
  return out;
}

}  // namespace forkguard::data::detail
