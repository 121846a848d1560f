// The probe: does a process hold CUDA driver state (or another runtime that fork cannot copy), and
// is it safe to fork it?
//
//   auto state = forkguard::probe::self();         // this process
//   auto other = forkguard::probe::pid(1234);      // another one (same user, or root)
//   if (!state.fork_safe) fmt::print("{}\n", forkguard::probe::to_string(state.verdict));
//   for (const auto& e : state.evidence) fmt::print("{}: {} [{}]\n", e.kind, e.detail, e.source);
//
// The probe never initializes CUDA. It reads /proc, lists the loader's libraries, and calls the
// driver only when it is already mapped in this process, and then only calls that initialize
// nothing (cuDriverGetVersion, cuDeviceGetCount; cuDevicePrimaryCtxGetState and cuCtxGetCurrent
// once the driver reports itself initialized). Probing a clean process leaves it clean.
//
// A child forked from an initialized parent ("poisoned") cannot use CUDA at all. It is called so
// only on proof: the mapped driver, none of the driver's threads, and device-file descriptions it
// shares (kcmp) with its parent while that parent is itself initialized (its driver threads run;
// through poisoned ancestors that share them too, up to the one that is). Device files open
// without that proof (a process in the middle of cuInit, an orphan whose parent has exited) give
// `initialized`, with a note.
//
// Fork hazards beyond CUDA (docs/probe.md, "Fork hazards beyond CUDA"), from each thread's
// /proc/PID/task/TID/syscall (its user-space PC, mapped to the file whose code holds it):
//   - A live GNU OpenMP pool makes fork_safe false: a thread other than the calling one (self) or
//     the main one (another PID) blocked with its PC in libgomp's code (libgomp*.so*). A child
//     fork()ed from such a process hangs at its first parallel region. Verdict kOpenMpPool where
//     CUDA's verdict is fork-safe; where it is not, CUDA's verdict stands and the pool is added as
//     evidence. Threads still running with libgomp mapped are read again (at most 5 times, 2 ms
//     apart) to let spinning workers block; if some still run, they are taken for the pool only
//     where the process's environment makes GNU OpenMP's workers spin for ever
//     (OMP_WAIT_POLICY=active, GOMP_SPINCOUNT=infinite); otherwise a note and an unseen hazard.
//   - Other live threads are evidence (kLiveThread, the first 8) and a note only: they never
//     change fork_safe (every Jupyter kernel has some). CUDA's driver threads are kDriverThread.
// What cannot be seen is listed in `unseen_hazards` (fork_safe stays what was seen): from another
// process, torch's own fork poison, and the OpenMP pool where the syscall files cannot be read
// (they need ptrace attach permission). `forkguard doctor` then says "fork safety unknown".
//
// Thread-safety: self() and pid() may be called from any thread concurrently.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "forkguard/error.hpp"

namespace forkguard::probe {

// Ordered by how far the process has gone; fork is safe up to and including kNvmlOpen.
enum class Verdict {
  kClean,          // no CUDA library mapped, no NVIDIA device file open
  kDriverLoaded,   // a CUDA library is mapped, the driver is not initialized: fork is safe
  kNvmlOpen,       // NVIDIA control/GPU device files open (NVML), no CUDA init: fork is safe
  kInitialized,    // cuInit has succeeded here: a forked child cannot use CUDA
  kContextActive,  // and a context exists
  kPoisoned,       // forked from an initialized parent: CUDA cannot work in this process
  // Not CUDA: only where CUDA's verdict is fork-safe.
  kOpenMpPool,  // GNU OpenMP's thread pool is live: a forked child hangs at its first parallel op
};

enum class EvidenceKind {
  kLibraryMapped,     // a CUDA library in the address space
  kDeviceFileOpen,    // an fd on /dev/nvidia* (or the test driver's files of the same names)
  kDeviceFileMapped,  // a mapping of a GPU device file (what contexts create)
  kDriverThread,      // a thread the driver starts at cuInit (cuda-EvtHandlr)
  kInheritedFile,     // a device-file description shared with the parent process (kcmp)
  kDriverState,       // what the driver itself answered
  kEnvironment,       // a variable that changes how CUDA or PyTorch behaves
  kOpenMpPool,        // GNU OpenMP worker threads blocked in libgomp (or spinning, as configured)
  kLiveThread,        // another live thread, with the library it is blocked in: a note only
};

struct Evidence {
  EvidenceKind kind;
  std::string detail;  // "libcuda.so.1 (/usr/lib/x86_64-linux-gnu/libcuda.so.1)"
  std::string source;  // where it was seen: "/proc/42/fd/7", "dl_iterate_phdr", "cuDeviceGetCount"
};

struct CudaState {
  pid_t pid = 0;
  pid_t parent_pid = 0;
  pid_t poisoned_by = 0;  // kPoisoned: the initialized process whose device files this one shares
  Verdict verdict = Verdict::kClean;
  bool fork_safe = true;
  std::vector<Evidence> evidence;
  std::vector<std::string> notes;  // what could not be checked, and why
  // Hazards that could not be seen, one phrase each ("torch's own fork poison (...)"): where
  // fork_safe is true, it is true of what was seen only, and the doctor says "unknown".
  std::vector<std::string> unseen_hazards;

  bool has(EvidenceKind kind) const;
};

// No such process, or not allowed to inspect it; the message names the PID and the cause.
class ProbeError : public Error {
 public:
  ProbeError(pid_t pid, std::string message, bool permission_denied);
  pid_t pid() const noexcept { return pid_; }
  bool permission_denied() const noexcept { return permission_denied_; }

 private:
  pid_t pid_;
  bool permission_denied_;
};

CudaState self();
CudaState pid(pid_t pid);  // pid == getpid() gives self()

// nullopt when this process is fork-safe, else self(). Answered in microseconds when neither a CUDA
// driver nor GNU OpenMP is mapped here (the common case: every unsafe verdict needs one of them in
// the address space). With libgomp mapped and no driver, only the threads are looked at (tens of
// microseconds; up to 50 ms more while threads keep running), and self() is taken only when a
// pool is seen.
std::optional<CudaState> self_if_fork_unsafe();

// nullopt unless this process holds CUDA state a fork child cannot use (a verdict of
// kInitialized, kContextActive or kPoisoned), else self() without the thread hazards. For forks
// whose children run only forkguard's own C++ code (the fork server, the image loader's process
// workers, its CUDA check of a sample): a live GNU OpenMP pool is no hazard to them, since they
// run no OpenMP region. Microseconds when no CUDA driver is mapped; threads are never waited on.
std::optional<CudaState> self_if_cuda_unsafe();

std::string_view to_string(Verdict verdict);
std::string_view to_string(EvidenceKind kind);
bool is_fork_safe(Verdict verdict);

}  // namespace forkguard::probe
