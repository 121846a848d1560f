#include "forkguard/probe/cuda_state.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
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

constexpr std::array<std::string_view, 8> kRelevantEnvironment = {
    "CUDA_VISIBLE_DEVICES",   "PYTORCH_NVML_BASED_CUDA_CHECK", "CUDA_DEVICE_ORDER",
    "NVIDIA_VISIBLE_DEVICES", "CUDA_MODULE_LOADING",           "CUDA_LAUNCH_BLOCKING",
    "FORKGUARD_CUDA_DRIVER",  "FORKGUARD_NVML_LIBRARY"};

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
  explicit Prober(pid_t pid, bool is_self) : is_self_(is_self) { state_.pid = pid; }

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
    if (init_files_without_threads(facts_)) {
      state_.notes.push_back(
          "nvidia-uvm is open but the CUDA driver's threads are not running and no initialized "
          "parent shares these device files (kcmp): cuInit is in progress here, or the process "
          "that initialized CUDA before a fork is gone; counted as initialized, not poisoned");
    }
    state_.fork_safe = is_fork_safe(state_.verdict);
    if (!is_self_ && state_.fork_safe && facts_.torch_cuda_mapped) {
      // torch's flag is a byte in libtorch_python's memory, not in /proc (docs/probe.md).
      state_.notes.push_back(
          "a CUDA build of torch is loaded (libtorch_cuda.so): torch's own fork poison is not "
          "visible from another process. torch.cuda.is_available() (and device_count() where "
          "NVML cannot count, and torch's CUDA init) registers a pthread_atfork handler that "
          "puts every later fork child in a bad fork (\"Cannot re-initialize CUDA in forked "
          "subprocess\" at its first CUDA use), even with no GPU or driver; forkguard.probe() "
          "called inside that Python process reads it (evidence torch_fork_poison)");
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
    auto maps = must(state_.pid, detail::mapped_paths(state_.pid, &err), err);
    if (is_self_) {
      for (const auto& lib : forkguard::detail::loaded_libraries()) library(lib, "dl_iterate_phdr");
    }
    std::vector<std::string> seen;
    for (const auto& path : maps) {
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
    auto names = detail::thread_names(state_.pid, &err);
    if (!names) {
      state_.notes.push_back(
          fmt::format("threads not checked: {}: {}", err.path, std::strerror(err.err)));
      return;
    }
    int count = 0;
    std::string which;
    for (const auto& n : *names) {
      if (!is_driver_thread(n)) continue;
      ++count;
      if (which.find(n) == std::string::npos) which += (which.empty() ? "" : ", ") + n;
    }
    if (count > 0) {
      facts_.driver_threads = true;
      add(EvidenceKind::kDriverThread,
          fmt::format("{} CUDA driver thread{} ({})", count, count == 1 ? "" : "s", which),
          proc("task"));
    }
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
    std::vector<std::string> vars;
    std::string source = "environment";
    if (is_self_) {
      for (auto name : kRelevantEnvironment) {
        if (const char* v = std::getenv(std::string(name).c_str())) {
          vars.push_back(fmt::format("{}={}", name, v));
        }
      }
    } else {
      detail::ProcReadError err;
      auto env = detail::environment_of(state_.pid, &err);
      if (!env) {
        state_.notes.push_back(
            fmt::format("environment not read: {}: {}", err.path, std::strerror(err.err)));
        return;
      }
      source = proc("environ");
      for (const auto& kv : *env) {
        for (auto name : kRelevantEnvironment) {
          if (kv.size() > name.size() && kv.compare(0, name.size(), name) == 0 &&
              kv[name.size()] == '=') {
            vars.push_back(kv);
          }
        }
      }
    }
    for (auto& v : vars) add(EvidenceKind::kEnvironment, std::move(v), source);
  }

  bool is_self_;
  CudaState state_;
  Facts facts_;
};

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
  if (!forkguard::detail::cuda_driver_mapped()) return std::nullopt;
  auto state = self();
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
  }
  return "unknown";
}

}  // namespace forkguard::probe
