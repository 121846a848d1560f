// Signals taken out of their default action for a while and read from a signalfd instead, so a
// poll loop can act on them (forward them to children, stop ranks) rather than die of them.
//
//   SignalCapture signals({SIGINT, SIGTERM, SIGHUP});   // blocked for this thread
//   poll on signals.fd(); signals.each([](const signalfd_siginfo& i) { ... });
//
// The old mask comes back at destruction. Thread-safety: one owner; the mask is the calling
// thread's.
#pragma once

#include <pthread.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <initializer_list>

#include "detail/fd.hpp"
#include "forkguard/error.hpp"

namespace forkguard::detail {

class SignalCapture {
 public:
  explicit SignalCapture(std::initializer_list<int> signals) {
    sigset_t set;
    sigemptyset(&set);
    for (int s : signals) sigaddset(&set, s);
    ::pthread_sigmask(SIG_BLOCK, &set, &old_);
    fd_.reset(::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK));
    if (!fd_) {
      int err = errno;
      ::pthread_sigmask(SIG_SETMASK, &old_, nullptr);
      throw SystemError("signalfd", err);
    }
  }
  ~SignalCapture() {
    fd_.reset();
    ::pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SignalCapture(const SignalCapture&) = delete;
  SignalCapture& operator=(const SignalCapture&) = delete;

  int fd() const { return fd_.get(); }
  const sigset_t& saved_mask() const { return old_; }  // for a child that should get it back

  // Calls f for every signal that arrived since the last call.
  template <class F>
  void each(F&& f) {
    signalfd_siginfo info;
    while (::read(fd_.get(), &info, sizeof info) == sizeof info) f(info);
  }

 private:
  UniqueFd fd_;
  sigset_t old_{};
};

}  // namespace forkguard::detail
