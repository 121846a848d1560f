// Stacks for libforkguard_trace.so: native return addresses captured cheaply at an event,
// symbolized later (function, library+offset, file:line where debug info exists), and the Python
// frames of the calling thread when the process is a Python interpreter.
//
// Nothing here may be called between fork() and exec() in a child or from a signal handler:
// capture_pcs() is allocation-free, everything else allocates.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace forkguard::trace::detail {

struct NativeFrame {
  std::string function;  // demangled; empty when unknown
  std::string library;   // path of the object
  uintptr_t offset = 0;  // of the return address in that object
  std::string file;      // source file, when the object has debug info
  int line = 0;
};

struct PythonFrame {
  std::string file;
  std::string function;
  int line = 0;
};

struct RawStack {
  static constexpr int kMax = 48;
  uintptr_t pcs[kMax];
  int size = 0;
};

struct Stack {
  std::vector<NativeFrame> native;  // innermost first, our own frames and libc's fork removed
  std::vector<PythonFrame> python;  // innermost first
  std::string python_note;          // why there are no Python frames, when it matters
};

// Return addresses of the calling thread (no allocation, no lock but the unwinder's).
void capture_pcs(RawStack& out);
// Symbolized frames, without those of libforkguard_trace.so itself and the libc frames on top.
std::vector<NativeFrame> symbolize(const RawStack& raw);

enum class GilPolicy {
  kIfHeld,  // read Python frames only when this thread already holds the GIL
  kMayTake  // this thread holds no lock of ours or the driver's: it may wait for the GIL
};
// Fills stack.python (or stack.python_note) when the process runs a Python interpreter.
void python_frames(Stack& stack, GilPolicy policy);
bool is_python_process();

// The path of the object that contains `address` (empty when none).
std::string object_of(const void* address);
// This library's own path.
const std::string& self_path();

}  // namespace forkguard::trace::detail
