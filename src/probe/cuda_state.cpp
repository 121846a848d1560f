#include "forkguard/probe/cuda_state.hpp"

#include <fmt/format.h>
#include <strings.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string_view>

#include "detail/loaded_libraries.hpp"
#include "forkguard/cuda/driver.hpp"
#include "probe/proc_reader.hpp"

namespace forkguard::probe {
namespace {

using forkguard::detail::basename_of;

enum class LibraryRole { kNone, kDriver, kNvml, kOther };

// Basename prefixes of libraries that mean "CUDA is in this process".
constexpr std::array<std::string_view, 17> kCudaLibraryPrefixes = {"libcuda.so",
                                                                   "libnvidia-ml.so",
                                                                   "libcudart.so",
                                                                   "libcublas.so",
                                                                   "libcublasLt.so",
                                                                   "libcudnn",
                                                                   "libnccl.so",
                                                                   "libnvrtc.so",
                                                                   "libcufft.so",
                                                                   "libcurand.so",
                                                                   "libcusparse.so",
                                                                   "libcusolver.so",
                                                                   "libnvJitLink.so",
                                                                   "libcupti.so",
                                                                   "libtorch_cuda.so",
                                                                   "libc10_cuda.so",
                                                                   "libnvidia-ptxjitcompiler.so"};

LibraryRole library_role(std::string_view path) {
  auto base = basename_of(path);
  if (forkguard::detail::is_cuda_driver_library(path)) return LibraryRole::kDriver;
  if (base.substr(0, 15) == "libnvidia-ml.so") return LibraryRole::kNvml;
  for (auto prefix : kCudaLibraryPrefixes) {
    if (base.substr(0, prefix.size()) == prefix) return LibraryRole::kOther;
  }
  return LibraryRole::kNone;
}

enum class DeviceRole { kNone, kControl, kGpu, kUvm, kOther };

// Matched by basename so the test driver's files (same names, another directory) count too.
DeviceRole device_role(std::string_view path) {
  auto base = basename_of(path);
  if (base.substr(0, 6) != "nvidia") return DeviceRole::kNone;
  auto rest = base.substr(6);
  if (rest == "ctl") return DeviceRole::kControl;
  if (rest == "-uvm") return DeviceRole::kUvm;
  if (!rest.empty() && rest.find_first_not_of("0123456789") == std::string_view::npos) {
    return DeviceRole::kGpu;
  }
  if (rest == "-uvm-tools" || rest == "-modeset" || rest.substr(0, 4) == "-cap") {
    return DeviceRole::kOther;
  }
  return DeviceRole::kNone;
}

bool is_driver_thread(std::string_view comm) {
  return comm.substr(0, 5) == "cuda-";
}

// Whether GNU OpenMP's idle workers spin for ever instead of blocking, as libgomp reads its
// environment (case-insensitive): OMP_WAIT_POLICY=active, GOMP_SPINCOUNT=infinite|infinity.
bool openmp_spins_for_ever(const std::function<std::optional<std::string>(const char*)>& env) {
  auto is = [](const std::optional<std::string>& v, const char* word) {
    return v && ::strncasecmp(v->c_str(), word, std::strlen(word)) == 0;
  };
  const auto spin = env("GOMP_SPINCOUNT");
  return is(env("OMP_WAIT_POLICY"), "active") || is(spin, "infinite") || is(spin, "infinity");
}

std::optional<std::string> self_env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::optional<std::string>(v) : std::nullopt;
}

// GNU OpenMP workers of this process once seen blocked in libgomp, by (PID, TID): libgomp keeps
// its workers for the process's life, so one found running later (spinning right after a
// parallel region) is still the pool. Lock-free (a probe may run beside a fork); a fork child has
// another PID, so its parent's entries never match there.
constexpr std::size_t kRememberedWorkers = 64;
std::array<std::atomic<std::uint64_t>, kRememberedWorkers> g_openmp_workers{};

std::uint64_t worker_key(pid_t tid) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(::getpid())) << 32) |
         static_cast<std::uint32_t>(tid);
}

void remember_openmp_worker(pid_t tid) {
  const auto key = worker_key(tid);
  for (auto& slot : g_openmp_workers) {
    std::uint64_t seen = slot.load(std::memory_order_relaxed);
    if (seen == key) return;
    if (seen == 0 && slot.compare_exchange_strong(seen, key)) return;
    if (seen == key) return;
  }
}

bool remembered_openmp_worker(pid_t tid) {
  const auto key = worker_key(tid);
  return std::any_of(g_openmp_workers.begin(), g_openmp_workers.end(), [key](const auto& slot) {
    return slot.load(std::memory_order_relaxed) == key;
  });
}

// The threads a fork would leave behind: all but the calling one (self) or the main one (another
// PID, whose fork is most likely its main thread's), and not CUDA's driver threads.
pid_t forking_thread(pid_t pid, bool is_self) {
  return is_self ? static_cast<pid_t>(::gettid()) : pid;
}

constexpr std::array<std::string_view, 8> kRelevantEnvironment = {
    "CUDA_VISIBLE_DEVICES",   "PYTORCH_NVML_BASED_CUDA_CHECK", "CUDA_DEVICE_ORDER",
    "NVIDIA_VISIBLE_DEVICES", "CUDA_MODULE_LOADING",           "CUDA_LAUNCH_BLOCKING",
    "FORKGUARD_CUDA_DRIVER",  "FORKGUARD_NVML_LIBRARY"};
// ... and where GNU OpenMP is mapped.
constexpr std::array<std::string_view, 3> kOpenMpEnvironment = {
    "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"};

// What was seen, before it is turned into a verdict.
struct Facts {
  bool driver_mapped = false;
  bool cuda_library_mapped = false;
  bool gpu_files_open = false;  // nvidiactl / nvidiaN
  bool uvm_open = false;
  bool gpu_file_mapped = false;
  bool driver_threads = false;
  bool torch_cuda_mapped = false;  // a CUDA build of torch: its own fork flag may be set
  bool inherited_files = false;    // device-file descriptions shared with the parent
  bool poisoned_proof = false;     // ... and with an initialized ancestor (see Prober::inherited)
  // Only for self(), when the driver could be asked.
  bool driver_answered = false;
  bool driver_initialized = false;
  bool context_active = false;
  // GNU OpenMP
  bool openmp_mapped = false;
  bool openmp_pool = false;  // workers seen blocked in libgomp, or spinning for ever
};

// cuInit's mark without its threads: a process in the middle of cuInit, or the child of an
// initialized parent that cannot be shown (gone, kcmp refused). Unsafe to fork either way, but
// only poisoned_proof accuses a parent.
bool init_files_without_threads(const Facts& f) {
  return f.driver_mapped && f.uvm_open && !f.driver_threads && !f.driver_initialized &&
         !f.poisoned_proof;
}

Verdict decide(const Facts& f) {
  if (f.driver_mapped) {
    if (f.driver_initialized)
      return f.context_active ? Verdict::kContextActive : Verdict::kInitialized;
    if (f.poisoned_proof && !f.driver_threads) return Verdict::kPoisoned;
    if (!f.driver_answered && f.driver_threads) {
      return f.gpu_file_mapped ? Verdict::kContextActive : Verdict::kInitialized;
    }
    if (init_files_without_threads(f)) return Verdict::kInitialized;
  }
  if (f.gpu_files_open || f.uvm_open) return Verdict::kNvmlOpen;
  if (f.cuda_library_mapped || f.driver_mapped) return Verdict::kDriverLoaded;
  return Verdict::kClean;
}

[[noreturn]] void fail(pid_t pid, const detail::ProcReadError& e) {
  if (e.err == ENOENT || e.err == ESRCH) {
    throw ProbeError(pid, fmt::format("no process with PID {}", pid), false);
  }
  if (e.err == EACCES || e.err == EPERM) {
    throw ProbeError(pid,
                     fmt::format("not allowed to inspect PID {}: {} ({}); run as the process's "
                                 "user or as root",
                                 pid, e.path, std::strerror(e.err)),
                     true);
  }
  throw ProbeError(
      pid, fmt::format("cannot inspect PID {}: {}: {}", pid, e.path, std::strerror(e.err)), false);
}

template <typename T>
T must(pid_t pid, std::optional<T> value, const detail::ProcReadError& e) {
  if (!value) fail(pid, e);
  return std::move(*value);
}

class Prober {
 public:
  // hazards: also the threads' hazards (GNU OpenMP's pool, live threads); CUDA's state always.
  explicit Prober(pid_t pid, bool is_self, bool hazards = true)
      : is_self_(is_self), hazards_(hazards) {
    state_.pid = pid;
  }

  CudaState run() {
    const pid_t pid = state_.pid;
    detail::ProcReadError err;
    // /proc/PID/stat first: it exists for every process we may see, so "no such PID" is told
    // apart from "not allowed" before anything else is read.
    auto stat = must(pid, detail::stat_of(pid, &err), err);
    state_.parent_pid = stat.parent;
    if (!is_self_) refuse_what_is_not_a_live_user_process(stat);
    libraries(err);
    auto files = must(pid, detail::open_files(pid, &err), err);
    device_files(files);
    threads(err);
    inherited(files);
    if (is_self_ && facts_.driver_mapped) driver_state();
    environment();
    if (!is_self_ && facts_.driver_threads) {
      state_.notes.push_back(
          "context state of another process is inferred from its GPU device-file mappings");
    }
    state_.verdict = decide(facts_);
    state_.fork_safe = is_fork_safe(state_.verdict);
    if (state_.fork_safe && facts_.openmp_pool) {
      state_.verdict = Verdict::kOpenMpPool;
      state_.fork_safe = false;
    }
    if (init_files_without_threads(facts_)) {
      state_.notes.push_back(
          "nvidia-uvm is open but the CUDA driver's threads are not running and no initialized "
          "parent shares these device files (kcmp): cuInit is in progress here, or the process "
          "that initialized CUDA before a fork is gone; counted as initialized, not poisoned");
    }
    if (!is_self_ && state_.fork_safe && facts_.torch_cuda_mapped) {
      // torch's flag is a byte in libtorch_python's memory, not in /proc (docs/probe.md).
      state_.notes.push_back(
          "a CUDA build of torch is loaded (libtorch_cuda.so): torch's own fork poison is not "
          "visible from another process. torch.cuda.is_available() (and device_count() where "
          "NVML cannot count, and torch's CUDA init) registers a pthread_atfork handler that "
          "puts every later fork child in a bad fork (\"Cannot re-initialize CUDA in forked "
          "subprocess\" at its first CUDA use), even with no GPU or driver; forkguard.probe() "
          "called inside that Python process reads it (evidence torch_fork_poison)");
      state_.unseen_hazards.push_back(
          "torch's own fork poison (libtorch_cuda.so is mapped) is not visible from another "
          "process");
    }
    return std::move(state_);
  }

 private:
  // Neither has memory or files to look at: "clean" would be a verdict on nothing.
  void refuse_what_is_not_a_live_user_process(const detail::ProcStat& stat) const {
    const pid_t pid = state_.pid;
    if (stat.flags & detail::kPfKthread) {
      throw ProbeError(pid,
                       fmt::format("PID {} ({}) is a kernel thread, not a user process: it has no "
                                   "user memory, so no CUDA state",
                                   pid, stat.comm),
                       false);
    }
    if (stat.state == 'Z') {
      throw ProbeError(pid,
                       fmt::format("PID {} ({}) is a zombie: it has exited and its parent (PID {}) "
                                   "has not reaped it yet; nothing of it is left to inspect",
                                   pid, stat.comm, stat.parent),
                       false);
    }
    if (stat.state == 'X') throw ProbeError(pid, fmt::format("no process with PID {}", pid), false);
  }

  void add(EvidenceKind kind, std::string detail, std::string source) {
    state_.evidence.push_back({kind, std::move(detail), std::move(source)});
  }

  std::string proc(const char* leaf) const { return fmt::format("/proc/{}/{}", state_.pid, leaf); }

  void library(const std::string& path, const std::string& source) {
    auto role = library_role(path);
    if (role == LibraryRole::kNone) return;
    facts_.cuda_library_mapped = true;
    if (role == LibraryRole::kDriver) facts_.driver_mapped = true;
    if (basename_of(path).substr(0, 16) == "libtorch_cuda.so") facts_.torch_cuda_mapped = true;
    add(EvidenceKind::kLibraryMapped, fmt::format("{} ({})", basename_of(path), path), source);
  }

  void libraries(detail::ProcReadError& err) {
    // Mappings are read for every process: they also show device files mapped by contexts.
    auto maps = must(state_.pid, detail::maps_of(state_.pid, &err), err);
    code_ = std::move(maps.exec);
    for (const auto& m : code_) {
      if (!forkguard::detail::is_gnu_openmp_library(m.path)) continue;
      facts_.openmp_mapped = true;
      if (openmp_library_.empty()) openmp_library_ = m.path;
    }
    if (is_self_) {
      for (const auto& lib : forkguard::detail::loaded_libraries()) library(lib, "dl_iterate_phdr");
    }
    std::vector<std::string> seen;
    for (const auto& path : maps.paths) {
      if (std::find(seen.begin(), seen.end(), path) != seen.end()) continue;
      seen.push_back(path);
      if (!is_self_) library(path, proc("maps"));
      auto role = device_role(path);
      if (role == DeviceRole::kGpu) {
        facts_.gpu_file_mapped = true;
        add(EvidenceKind::kDeviceFileMapped, fmt::format("{} mapped", path), proc("maps"));
      }
    }
  }

  void device_files(const std::vector<detail::OpenFile>& files) {
    for (const auto& f : files) {
      auto role = device_role(f.target);
      if (role == DeviceRole::kNone) continue;
      if (role == DeviceRole::kUvm) facts_.uvm_open = true;
      if (role == DeviceRole::kControl || role == DeviceRole::kGpu) facts_.gpu_files_open = true;
      add(EvidenceKind::kDeviceFileOpen, fmt::format("fd {} -> {}", f.fd, f.target),
          fmt::format("/proc/{}/fd/{}", state_.pid, f.fd));
    }
  }

  void threads(detail::ProcReadError& err) {
    auto list = detail::threads_of(state_.pid, &err);
    if (!list) {
      state_.notes.push_back(
          fmt::format("threads not checked: {}: {}", err.path, std::strerror(err.err)));
      if (facts_.openmp_mapped) {
        state_.unseen_hazards.push_back(
            fmt::format("whether GNU OpenMP's thread pool is live ({} is mapped; {}: {})",
                        openmp_library_, err.path, std::strerror(err.err)));
      }
      return;
    }
    int count = 0;
    std::string which;
    for (const auto& t : *list) {
      if (!is_driver_thread(t.comm)) continue;
      ++count;
      if (which.find(t.comm) == std::string::npos) which += (which.empty() ? "" : ", ") + t.comm;
    }
    if (count > 0) {
      facts_.driver_threads = true;
      add(EvidenceKind::kDriverThread,
          fmt::format("{} CUDA driver thread{} ({})", count, count == 1 ? "" : "s", which),
          proc("task"));
    }
    if (hazards_) other_threads(*list);
  }

  // The file whose code holds `pc` ("" when none: anonymous or JIT code).
  std::string code_at(std::uintptr_t pc) const {
    for (const auto& m : code_) {
      if (pc >= m.start && pc < m.end) return m.path;
    }
    return {};
  }

  // Where the threads a fork leaves behind are (their syscall files): GNU OpenMP's workers
  // blocked in libgomp make the pool evidence; the others are live_thread evidence, a note only.
  void other_threads(const std::vector<detail::Thread>& list) {
    const pid_t forking = forking_thread(state_.pid, is_self_);
    std::vector<const detail::Thread*> others;
    std::vector<pid_t> tids;
    for (const auto& t : list) {
      if (t.tid == forking || is_driver_thread(t.comm)) continue;
      others.push_back(&t);
      tids.push_back(t.tid);
    }
    if (others.empty()) return;
    int rounds = 0;
    const auto states = detail::thread_states(state_.pid, tids, facts_.openmp_mapped, &rounds,
                                              is_self_ ? remembered_openmp_worker : nullptr);
    std::vector<pid_t> workers, running;
    const detail::ThreadState* unreadable = nullptr;
    for (const auto& st : states) {
      if (!st.syscall) {
        if (unreadable == nullptr) unreadable = &st;
      } else if (st.syscall->running) {
        if (is_self_ && remembered_openmp_worker(st.tid)) {
          workers.push_back(st.tid);  // spinning now; seen blocked in libgomp before
        } else {
          running.push_back(st.tid);
        }
      } else if (forkguard::detail::is_gnu_openmp_library(code_at(st.syscall->pc))) {
        workers.push_back(st.tid);
        if (is_self_) remember_openmp_worker(st.tid);
      }
    }
    const std::string syscalls = fmt::format("/proc/{}/task/*/syscall", state_.pid);
    if (!workers.empty()) {
      facts_.openmp_pool = true;
      add(EvidenceKind::kOpenMpPool,
          fmt::format("{} GNU OpenMP worker thread{} (TID{} {}) blocked in {}: a child fork()ed "
                      "from here hangs at its first parallel region",
                      workers.size(), plural(workers.size()), plural(workers.size()),
                      tid_list(workers), openmp_library_),
          syscalls);
    }
    bool running_are_pool = false;
    if (facts_.openmp_mapped && !running.empty() && workers.empty()) {
      running_are_pool = spinning(running, rounds, syscalls);
    }
    if (facts_.openmp_mapped && unreadable != nullptr && !facts_.openmp_pool) {
      const auto why =
          fmt::format("{}: {}", unreadable->error.path, std::strerror(unreadable->error.err));
      state_.notes.push_back(fmt::format(
          "GNU OpenMP's thread pool not checked: {} (a thread's syscall file needs ptrace access "
          "to the process: run as root, or as its parent where ptrace is restricted)",
          why));
      state_.unseen_hazards.push_back(fmt::format(
          "whether GNU OpenMP's thread pool is live ({} is mapped; {})", openmp_library_, why));
    }
    live_threads(others, states, running_are_pool);
  }

  // The threads neither CUDA's nor GNU OpenMP's pool: the first kMaxListed as evidence, and a note.
  void live_threads(const std::vector<const detail::Thread*>& others,
                    const std::vector<detail::ThreadState>& states, bool running_are_pool) {
    constexpr size_t kMaxListed = 8;
    size_t live = 0;
    for (size_t i = 0; i < others.size(); ++i) {
      const auto& t = *others[i];
      const auto& st = states[i];
      std::string where;
      if (!st.syscall) {
        where = fmt::format("(where it is blocked unknown: {})", std::strerror(st.error.err));
      } else if (st.syscall->running) {
        if (running_are_pool || (is_self_ && remembered_openmp_worker(t.tid))) continue;
        where = "running";
      } else {
        const std::string lib = code_at(st.syscall->pc);
        if (forkguard::detail::is_gnu_openmp_library(lib)) continue;
        where = lib.empty() ? fmt::format("blocked at {:#x} (no file's code)", st.syscall->pc)
                            : fmt::format("blocked in {}", basename_of(lib));
      }
      if (++live > kMaxListed) continue;
      add(EvidenceKind::kLiveThread, fmt::format("thread {} '{}' {}", t.tid, t.comm, where),
          fmt::format("/proc/{}/task/{}/syscall", state_.pid, t.tid));
    }
    if (live > kMaxListed) {
      add(EvidenceKind::kLiveThread, fmt::format("and {} more threads", live - kMaxListed),
          proc("task"));
    }
    if (live > 0) {
      state_.notes.push_back(fmt::format(
          "{} other thread{} live besides the {} thread (live_thread): a fork()ed child gets none "
          "of them, and a lock one holds at the fork stays held in the child; not counted "
          "against fork safety",
          live, live == 1 ? " is" : "s are", is_self_ ? "calling" : "main"));
    }
  }

  // Threads still running after the re-reads, with libgomp mapped: GNU OpenMP's workers where its
  // environment makes them spin for ever (true), otherwise unknown (a note; false).
  bool spinning(const std::vector<pid_t>& running, int rounds, const std::string& source) {
    const auto n = running.size();
    if (openmp_spins_for_ever([this](const char* name) { return environment_value(name); })) {
      facts_.openmp_pool = true;
      add(EvidenceKind::kOpenMpPool,
          fmt::format("{} thread{} running (TID{} {}) with {} mapped and its workers set to spin "
                      "for ever (OMP_WAIT_POLICY=active or GOMP_SPINCOUNT=infinite): taken for a "
                      "GNU OpenMP pool; a child fork()ed from here hangs at its first parallel "
                      "region",
                      n, plural(n), plural(n), tid_list(running), openmp_library_),
          source);
      return true;
    }
    state_.notes.push_back(fmt::format(
        "{} thread{} still running after {} re-reads {} ms apart, with {} mapped: if they are GNU "
        "OpenMP workers still spinning after a parallel region (GOMP_SPINCOUNT), a fork()ed child "
        "would hang at its first parallel region; probe again once they are idle",
        n, n == 1 ? " is" : "s are", rounds, detail::kSettlePauseMs, openmp_library_));
    state_.unseen_hazards.push_back(
        fmt::format("whether {} running thread{} (TID{} {}) belong to "
                    "a GNU OpenMP pool",
                    n, plural(n), plural(n), tid_list(running)));
    return false;
  }

  static const char* plural(size_t n) { return n == 1 ? "" : "s"; }

  static std::string tid_list(const std::vector<pid_t>& tids, size_t max = 8) {
    std::string out;
    for (size_t i = 0; i < tids.size() && i < max; ++i) {
      out += (out.empty() ? "" : ", ") + std::to_string(tids[i]);
    }
    if (tids.size() > max) out += fmt::format(" and {} more", tids.size() - max);
    return out;
  }

  // A variable of the probed process: getenv (self) or /proc/PID/environ (read once).
  std::optional<std::string> environment_value(const char* name) {
    if (is_self_) return self_env(name);
    if (!environ_) {
      detail::ProcReadError err;
      environ_ = detail::environment_of(state_.pid, &err).value_or(std::vector<std::string>{});
    }
    const std::string_view key(name);
    for (const auto& kv : *environ_) {
      if (kv.size() > key.size() && kv.compare(0, key.size(), key) == 0 && kv[key.size()] == '=') {
        return kv.substr(key.size() + 1);
      }
    }
    return std::nullopt;
  }

  // Device-file descriptions shared with the parent: the signature of a forked child. Proof of
  // poisoning needs more: the process sharing them is itself initialized (its driver threads
  // run). An ancestor that shares them without the threads (poisoned itself, as a worker's
  // worker) is passed through to its own parent, up to kMaxAncestors.
  void inherited(const std::vector<detail::OpenFile>& files) {
    constexpr int kMaxAncestors = 16;
    std::vector<int> mine;
    for (const auto& f : files) {
      if (device_role(f.target) != DeviceRole::kNone) mine.push_back(f.fd);
    }
    pid_t ancestor = state_.parent_pid;
    for (int depth = 0; depth < kMaxAncestors && !mine.empty() && ancestor > 1; ++depth) {
      const char* who = depth == 0 ? "parent" : "ancestor";
      auto shared = shared_device_files(mine, ancestor, who);
      if (!shared) return;
      if (depth == 0) facts_.inherited_files = true;
      detail::ProcReadError err;
      auto names = detail::thread_names(ancestor, &err);
      bool initialized = names && std::any_of(names->begin(), names->end(), is_driver_thread);
      add(EvidenceKind::kInheritedFile,
          fmt::format("{} {} PID {}{}", *shared, who, ancestor,
                      initialized ? ", which is initialized (CUDA driver threads running)"
                                  : ", which has no CUDA driver thread"),
          "kcmp(KCMP_FILE)");
      if (initialized) {
        facts_.poisoned_proof = true;
        state_.poisoned_by = ancestor;
        return;
      }
      auto up = detail::parent_of(ancestor, &err);
      if (!up) return;
      ancestor = *up;
    }
  }

  // "fd 7 (nvidia-uvm) is the same open file as fd 9 of" when one of `mine` shares its description
  // with one of `other`'s device files; nullopt otherwise (with a note when kcmp was refused).
  std::optional<std::string> shared_device_files(const std::vector<int>& mine, pid_t other,
                                                 const char* who) {
    detail::ProcReadError err;
    auto other_files = detail::open_files(other, &err);
    if (!other_files) {
      state_.notes.push_back(fmt::format("{} {} not compared (kcmp): {}: {}", who, other, err.path,
                                         std::strerror(err.err)));
      return std::nullopt;
    }
    for (int fd : mine) {
      for (const auto& of : *other_files) {
        if (device_role(of.target) == DeviceRole::kNone) continue;
        int same = detail::same_file_description(state_.pid, fd, other, of.fd);
        if (same < 0) {
          state_.notes.push_back(
              fmt::format("{} {} not compared: kcmp: {}", who, other, std::strerror(-same)));
          return std::nullopt;
        }
        if (same == 1) {
          return fmt::format("fd {} ({}) is the same open file as fd {} of", fd,
                             basename_of(of.target), of.fd);
        }
      }
    }
    return std::nullopt;
  }

  // Only calls that initialize nothing, and only on a driver already mapped here.
  void driver_state() {
    const auto* drv = cuda::Driver::if_mapped();
    if (drv == nullptr) {
      state_.notes.push_back("driver mapped but could not be bound with RTLD_NOLOAD");
      return;
    }
    const auto& api = drv->api();
    int version = 0;
    auto r = api.cuDriverGetVersion(&version);
    if (r == cuda::CUDA_SUCCESS) {
      add(EvidenceKind::kDriverState,
          fmt::format("driver supports CUDA {}.{}", version / 1000, (version % 1000) / 10),
          "cuDriverGetVersion");
    } else {
      add(EvidenceKind::kDriverState, fmt::format("cuDriverGetVersion: {}", cuda::result_name(r)),
          "cuDriverGetVersion");
    }
    int count = 0;
    r = api.cuDeviceGetCount(&count);
    facts_.driver_answered = true;
    if (r != cuda::CUDA_SUCCESS) {
      add(EvidenceKind::kDriverState,
          fmt::format("driver not initialized in this process (cuDeviceGetCount: {})",
                      cuda::result_name(r)),
          "cuDeviceGetCount");
      return;
    }
    facts_.driver_initialized = true;
    add(EvidenceKind::kDriverState,
        fmt::format("driver initialized in this process (cuInit has run): {} device{}", count,
                    count == 1 ? "" : "s"),
        "cuDeviceGetCount");
    for (int i = 0; i < count; ++i) {
      cuda::CUdevice dev = 0;
      if (api.cuDeviceGet(&dev, i) != cuda::CUDA_SUCCESS) continue;
      unsigned flags = 0;
      int active = 0;
      if (api.cuDevicePrimaryCtxGetState(dev, &flags, &active) == cuda::CUDA_SUCCESS && active) {
        facts_.context_active = true;
        add(EvidenceKind::kDriverState, fmt::format("primary context active on device {}", i),
            "cuDevicePrimaryCtxGetState");
      }
    }
    cuda::CUcontext current = nullptr;
    if (api.cuCtxGetCurrent(&current) == cuda::CUDA_SUCCESS && current != nullptr) {
      facts_.context_active = true;
      add(EvidenceKind::kDriverState, "a context is current on the probing thread",
          "cuCtxGetCurrent");
    }
  }

  void environment() {
    std::vector<std::string_view> names(kRelevantEnvironment.begin(), kRelevantEnvironment.end());
    if (facts_.openmp_mapped)
      names.insert(names.end(), kOpenMpEnvironment.begin(), kOpenMpEnvironment.end());
    std::string source = "environment";
    if (!is_self_) {
      detail::ProcReadError err;
      environ_ = detail::environment_of(state_.pid, &err);
      if (!environ_) {
        state_.notes.push_back(
            fmt::format("environment not read: {}: {}", err.path, std::strerror(err.err)));
        environ_.emplace();
        return;
      }
      source = proc("environ");
    }
    for (auto name : names) {
      if (auto v = environment_value(std::string(name).c_str())) {
        add(EvidenceKind::kEnvironment, fmt::format("{}={}", name, *v), source);
      }
    }
  }

  bool is_self_;
  bool hazards_;
  CudaState state_;
  Facts facts_;
  std::vector<detail::ExecMapping> code_;  // executable mappings of files, from /proc/PID/maps
  std::string openmp_library_;             // the libgomp mapped, when one is
  std::optional<std::vector<std::string>> environ_;  // another PID's, once read
};

// The fast path's look at the threads, with libgomp mapped and no CUDA driver: whether any thread
// but this one is blocked in libgomp's code (from dl_iterate_phdr: /proc/self/maps is not read),
// or runs where GNU OpenMP's workers spin for ever. true also when the threads cannot be listed
// or read, so that self() says what it can.
bool openmp_pool_suspected() {
  const pid_t me = ::getpid();
  detail::ProcReadError err;
  auto tids = detail::thread_ids(me, &err);
  if (!tids) return true;
  const pid_t caller = forking_thread(me, true);
  tids->erase(std::remove(tids->begin(), tids->end(), caller), tids->end());
  if (tids->empty()) return false;
  const auto code = forkguard::detail::gnu_openmp_code();
  bool running = false;
  for (const auto& t : detail::thread_states(me, *tids, true, nullptr, remembered_openmp_worker)) {
    if (!t.syscall) return true;
    if (t.syscall->running) {
      if (remembered_openmp_worker(t.tid)) return true;
      running = true;
      continue;
    }
    for (const auto& c : code) {
      if (t.syscall->pc >= c.start && t.syscall->pc < c.end) {
        remember_openmp_worker(t.tid);
        return true;
      }
    }
  }
  return running && openmp_spins_for_ever(self_env);
}

}  // namespace

bool CudaState::has(EvidenceKind kind) const {
  return std::any_of(evidence.begin(), evidence.end(),
                     [kind](const Evidence& e) { return e.kind == kind; });
}

ProbeError::ProbeError(pid_t pid, std::string message, bool permission_denied)
    : Error(std::move(message)), pid_(pid), permission_denied_(permission_denied) {}

CudaState self() {
  return Prober(::getpid(), true).run();
}

std::optional<CudaState> self_if_fork_unsafe() {
  const auto mapped = forkguard::detail::fork_hazard_libraries();
  if (!mapped.cuda_driver && !(mapped.gnu_openmp && openmp_pool_suspected())) return std::nullopt;
  auto state = self();
  if (state.fork_safe) return std::nullopt;
  return state;
}

std::optional<CudaState> self_if_cuda_unsafe() {
  if (!forkguard::detail::cuda_driver_mapped()) return std::nullopt;
  auto state = Prober(::getpid(), true, false).run();
  if (state.fork_safe) return std::nullopt;
  return state;
}

CudaState pid(pid_t target) {
  if (target <= 0) throw ProbeError(target, fmt::format("invalid PID {}", target), false);
  if (target == ::getpid()) return self();
  return Prober(target, false).run();
}

bool is_fork_safe(Verdict v) {
  return v <= Verdict::kNvmlOpen;
}

std::string_view to_string(Verdict v) {
  switch (v) {
    case Verdict::kClean: return "clean";
    case Verdict::kDriverLoaded: return "driver_loaded";
    case Verdict::kNvmlOpen: return "nvml_open";
    case Verdict::kInitialized: return "initialized";
    case Verdict::kContextActive: return "context_active";
    case Verdict::kPoisoned: return "poisoned";
    case Verdict::kOpenMpPool: return "openmp_pool";
  }
  return "unknown";
}

std::string_view to_string(EvidenceKind k) {
  switch (k) {
    case EvidenceKind::kLibraryMapped: return "library_mapped";
    case EvidenceKind::kDeviceFileOpen: return "device_file_open";
    case EvidenceKind::kDeviceFileMapped: return "device_file_mapped";
    case EvidenceKind::kDriverThread: return "driver_thread";
    case EvidenceKind::kInheritedFile: return "inherited_file";
    case EvidenceKind::kDriverState: return "driver_state";
    case EvidenceKind::kEnvironment: return "environment";
    case EvidenceKind::kOpenMpPool: return "openmp_pool";
    case EvidenceKind::kLiveThread: return "live_thread";
  }
  return "unknown";
}

}  // namespace forkguard::probe
