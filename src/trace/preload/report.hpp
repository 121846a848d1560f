// Events of libforkguard_trace.so and their two renderings: the text a user reads on stderr and
// the JSON line `forkguard trace` collects (one line per event, appended with one write(2)).
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "trace/preload/stack.hpp"

namespace forkguard::trace::detail {

enum class EventKind {
  kDriverLoaded,
  kDeviceOpened,
  kCudaInit,
  kDirtyFork,
  kPoisonedTouch,
  kOpenMpPool,  // GNU OpenMP (libgomp) started its thread pool: its first pthread_create
  kOpenMpFork,  // a fork (not followed by exec) while that pool was alive
};
std::string_view to_string(EventKind kind);

struct Event {
  EventKind kind = EventKind::kDriverLoaded;
  pid_t pid = 0;
  pid_t ppid = 0;
  double time = 0;   // seconds since the epoch
  std::string what;  // one line: the library, the device file, the call
  RawStack raw;      // captured at the event (size 0: no stack, e.g. linked at start-up)
  Stack stack;       // Python frames taken at the event; native frames once symbolized
  bool symbolized = false;
  std::vector<std::pair<std::string, std::string>> fields;  // extra JSON strings
  std::vector<std::pair<std::string, long long>> numbers;   // extra JSON integers
};

void ensure_symbolized(Event& event);

// Where, in one phrase: the innermost frame of the user's own code (Python first).
std::string headline(const Stack& stack);
// The stack as a user reads it: Python frames (most recent call last), then native frames.
std::string format_stack(const Stack& stack, std::string_view indent);
// The cures, one bullet a line: of a fork after CUDA initialization, of a fork with GNU OpenMP's
// thread pool alive.
std::string cure_text(std::string_view indent);
std::string openmp_cure_text(std::string_view indent);
// One JSON object on one line, '\n'-terminated.
std::string to_json_line(const Event& event);

}  // namespace forkguard::trace::detail
