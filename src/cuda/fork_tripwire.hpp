// The CUDA fork tripwire: makes a fork child's first driver call visible, even to a caller that
// swallows its error.
//
// In a child forked after its parent initialized the driver, cuInit (and every call after it)
// returns CUDA_ERROR_NOT_INITIALIZED (3): CUDA cannot start there (DESIGN.md's first fact). A
// library or a Dataset that catches that error goes on without the GPU, and nothing tells its
// parent. The tripwire replaces, in this process only, the entry of the mapped driver's cuInit
// with a function that counts the call and returns what the driver would have returned, 3. The
// code page is the child's own copy once written (a private file mapping): the parent and every
// other process keep the driver as it is.
//
//   if (std::string why = cuda::fork_tripwire_unavailable(); why.empty()) {  // in the parent
//     ... fork ...
//     cuda::arm_fork_tripwire();          // in the child, before any user code; throws Error
//     run_user_code();
//     if (cuda::fork_tripwire_trips() > 0) { /* its results are not to be trusted */ }
//   }
//
// Where it can be armed: x86-64, a driver already mapped (a parent that initialized CUDA has it),
// and a cuInit whose symbol is large enough for the 13-byte jump (the dynamic symbol's size).
// Not seen by it: a caller that reaches the driver through an entry point other than the exported
// cuInit (the runtime's cuGetProcAddress table: such a caller's first call after cuInit fails the
// same way, but is not counted). torch's own CUDA path raises before any driver call and is
// watched by the Python side (_torch_compat.watch_bad_fork).
//
// Thread-safety: arm once, in a single-threaded fork child; trips() may be read from any thread.
#pragma once

#include <string>

namespace forkguard::cuda {

// "" where arm_fork_tripwire() can work in a fork of this process, else why not (no driver
// mapped, another architecture, a cuInit too small to patch). Loads and calls nothing.
std::string fork_tripwire_unavailable();

// Arms the tripwire in this process. Throws Error naming the reason where it cannot (as
// fork_tripwire_unavailable, or mprotect's errno). Idempotent.
void arm_fork_tripwire();

// The calls the tripwire caught since it was armed (0 when never armed).
unsigned fork_tripwire_trips() noexcept;

}  // namespace forkguard::cuda
