// The loop of a fork server, one for both: the C++ zygote's (launch/fork_server.cpp) and the
// interpreter fork server's (python/forkguard/_server.py, through _native.serve_zygote in
// python/src/process.cpp). It reads each request from the server's socket and has its handler
// start a child or answer; it keeps every child started as a Child until its pidfd says it
// exited, then reaps it through the handle and reports it as `exit PID STATUS` (the exact wait
// status, launch/zygote_protocol.hpp). A started child is replied `started PID` with its pidfd
// attached (start_child opened it before the child could be reaped), so the requester holds a
// handle that names that child for good (ServerChild). An exit report never precedes the
// `started` reply of its child.
//
//   class Mine : public ZygoteHandler { ... handle(...) { return start_child({...}); } };
//   std::map<pid_t, Child> children;    // outlives the loop: the owner decides their end
//   serve_zygote(sock, mine, children);  // returns at EOF
//
// Thread-safety: one thread serves a socket.
#pragma once

#include <poll.h>
#include <sys/types.h>

#include <map>
#include <string>
#include <variant>
#include <vector>

#include "launch/child.hpp"

namespace forkguard::launch::detail {

class ZygoteHandler {
 public:
  virtual ~ZygoteHandler() = default;
  // One request. `fds` came with it: what the handler keeps it removes from the vector, and the
  // loop closes the rest. `own`: the loop's fds, which no child may keep (the socket, the other
  // children's pidfds). A child it started, or the reply's fields (an error reply included).
  virtual std::variant<Child, std::vector<std::string>> handle(
      const std::vector<std::string>& fields, std::vector<int>& fds,
      const std::vector<int>& own) = 0;
  // Waits until one of `fds` is ready (poll(), no timeout): the result and errno of poll(). A
  // Python server's lets other threads run meanwhile and raises what its signal handlers raise.
  virtual int wait(pollfd* fds, size_t count);
};

// Serves `sock` until EOF or a reply that cannot be sent (the program is gone: returns), or an
// error receiving or polling (throws SystemError).
// `children`: the children started and not yet reaped, when it returns or throws.
void serve_zygote(int sock, ZygoteHandler& handler, std::map<pid_t, Child>& children);

}  // namespace forkguard::launch::detail
