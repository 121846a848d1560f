// libforkguard_trace.so: the interposed entry points, the event record, the fork handlers.
//
// Loaded with LD_PRELOAD into a program we did not build. Rules that follow from that:
// - Every hook forwards to the real function and returns what it returned, errno included.
// - Our own work inside a hook (the probe reads /proc, symbolizing reads ELF files) runs with
//   t_busy set, so that it is not itself recorded and cannot recurse.
// - The fork handlers exist only once the process came near CUDA or started GNU OpenMP's thread
//   pool (see activate()); until the driver is mapped or the pool started they only take two
//   mutexes of ours. The child handler is async-signal-safe: it closes and writes file
//   descriptors and resets our locks; the reports it needs were prepared before the fork.
// - Python frames are read with the GIL only where this thread holds no lock the GIL holder could
//   wait for (see GilPolicy); elsewhere the native frames stand alone and the report says why.
#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <poll.h>
#include <pthread.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <alloca.h>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "forkguard/probe/cuda_state.hpp"
#include "trace/preload/report.hpp"
#include "trace/preload/stack.hpp"

#define FG_EXPORT extern "C" __attribute__((visibility("default")))
#define FG_HIDDEN extern "C" __attribute__((visibility("hidden")))

// Read by the assembly entry points (interpose_x86_64.S).
FG_HIDDEN void* forkguard_trace_real_dlopen;
FG_HIDDEN void* forkguard_trace_real_dlsym;
void* forkguard_trace_real_dlopen = nullptr;
void* forkguard_trace_real_dlsym = nullptr;

namespace forkguard::trace::detail {
namespace {

using CUresult = int;
using Clock = std::chrono::steady_clock;
constexpr int kExitStrict = 70;  // EX_SOFTWARE

// --- per-thread state (initial-exec TLS: no allocation, usable in the child handler) -----------
__attribute__((tls_model("initial-exec"))) thread_local bool t_busy = false;
struct InitCapture;
__attribute__((tls_model("initial-exec"))) thread_local const InitCapture* t_in_cuinit = nullptr;
struct PreparedFork;
__attribute__((tls_model("initial-exec"))) thread_local PreparedFork* t_prepared = nullptr;

class Busy {
 public:
  Busy() : was_(t_busy) { t_busy = true; }
  ~Busy() { t_busy = was_; }
  Busy(const Busy&) = delete;
  Busy& operator=(const Busy&) = delete;

 private:
  bool was_;
};

// --- configuration, from the environment `forkguard trace` sets ---------------------------------
struct Config {
  std::string events;   // FORKGUARD_TRACE_EVENTS: file that gets one JSON line per event
  bool strict = false;  // FORKGUARD_TRACE_STRICT=1: a poisoned child exits 70 at its first touch
  int grace_ms = 1000;  // FORKGUARD_TRACE_EXEC_GRACE_MS: how long a child may take to exec
};

// Never destroyed: the destructor at exit (stop()) and the watcher thread still read it after
// the function-local statics' destructors have run.
const Config& config() {
  static const Config* c = [] {
    auto* c = new Config;
    Config& cfg = *c;
    if (const char* v = std::getenv("FORKGUARD_TRACE_EVENTS")) cfg.events = v;
    if (const char* v = std::getenv("FORKGUARD_TRACE_STRICT")) {
      cfg.strict = *v != '\0' && *v != '0';
    }
    if (const char* v = std::getenv("FORKGUARD_TRACE_EXEC_GRACE_MS")) {
      int ms = std::atoi(v);
      if (ms > 0) cfg.grace_ms = ms;
    }
    return c;
  }();
  return *c;
}

double now_epoch() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec / 1e9;
}

void write_all(int fd, std::string_view s) {
  while (!s.empty()) {
    ssize_t n = ::write(fd, s.data(), s.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    s.remove_prefix(static_cast<size_t>(n));
  }
}

std::string_view basename_of(std::string_view path) {
  auto slash = path.rfind('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

bool starts_with(std::string_view s, std::string_view p) {
  return s.substr(0, p.size()) == p;
}

// The libraries whose loading is an event (and libraries that depend on them bring them in).
bool is_cuda_library(std::string_view base) {
  return starts_with(base, "libcuda.so") || starts_with(base, "libcudart.so") ||
         starts_with(base, "libnvidia-ml.so");
}

enum class Device { kNone, kControl, kUvm, kGpu };

// Matched by basename so the test driver's files (same names, another directory) count too.
Device device_of(std::string_view path) {
  auto base = basename_of(path);
  if (!starts_with(base, "nvidia")) return Device::kNone;
  auto rest = base.substr(6);
  if (rest == "ctl") return Device::kControl;
  if (rest == "-uvm") return Device::kUvm;
  if (!rest.empty() && rest.size() < 4 && rest.find_first_not_of("0123456789") == rest.npos) {
    return Device::kGpu;
  }
  return Device::kNone;
}

// --- the record of this process ------------------------------------------------------------------
// g_mu guards the record. Constant-initialized; the fork handlers hold it across fork() so the
// child's copy is consistent, and the child re-creates it.
//
// The fork handlers are registered by activate(), when the process first comes near CUDA (a CUDA
// library mapped, a device file opened, cuInit) or libgomp starts its thread pool (pthread_create
// called from libgomp): a process that does neither runs no code of ours at fork, not even a
// check. Every path to a state that is not fork-safe goes through one of those hooks first (cuInit
// opens nvidia-uvm; a pool's threads are created), and activate() is never called from a fork
// handler before the handlers exist (glibc holds its atfork lock while they run).
std::mutex g_mu;
std::atomic<bool> g_active{false};
__attribute__((tls_model("initial-exec"))) thread_local bool t_locked = false;

void before_fork();
void after_fork_parent();
void after_fork_child();

void activate() {
  if (g_active.load(std::memory_order_relaxed)) return;
  bool expected = false;
  if (g_active.compare_exchange_strong(expected, true)) {
    ::pthread_atfork(before_fork, after_fork_parent, after_fork_child);
  }
}
std::vector<Event>* g_events = nullptr;           // recorded here (a child inherits its parent's)
std::vector<std::string>* g_seen_libs = nullptr;  // CUDA libraries already reported
unsigned g_devices_seen = 0;                      // bit per device file: ctl, uvm, gpu 0..29
unsigned long long g_last_adds = ~0ull;           // dl_iterate_phdr's load counter at the last scan
std::atomic<bool> g_driver_seen{false};           // a CUDA library is mapped here
std::atomic<bool> g_scan_needed{true};            // something may have loaded since the last scan
std::atomic<bool> g_init_recorded{false};         // a cuda_init event exists for this process

// The stack of a forwarded dlopen of a CUDA library by bare name, waiting for the scan that sees
// the library arrive.
struct PendingLoad {
  std::string name;
  double time = 0;
  RawStack raw;
  Stack stack;
};
PendingLoad* g_pending_load = nullptr;

// Set in a child forked from a process whose CUDA state was not fork-safe.
struct PoisonedInfo {
  pid_t parent = 0;
  std::string parent_verdict;
  std::string parent_init;  // the parent's init site, text prepared before the fork
  std::string parent_init_headline;
};
const PoisonedInfo* g_poisoned = nullptr;
std::atomic<bool> g_poisoned_reported{false};
int g_exec_notify_fd = -1;  // this child's end of its parent's exec pipe (close-on-exec)

std::vector<Event>& events() {
  if (g_events == nullptr) g_events = new std::vector<Event>;
  return *g_events;
}

void append_json(const Event& e) {
  const std::string& path = config().events;
  if (path.empty()) return;
  int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return;
  write_all(fd, to_json_line(e));
  ::close(fd);
}

// Adds an event to the record (and to the events file). Runs with t_busy set.
void record(Event e) {
  e.pid = ::getpid();
  e.ppid = ::getppid();
  if (e.time == 0) e.time = now_epoch();
  if (!config().events.empty()) {
    ensure_symbolized(e);
    append_json(e);
  }
  activate();
  std::lock_guard lock(g_mu);
  events().push_back(std::move(e));
}

// New CUDA libraries in the address space since the last scan (paths), marked as seen.
std::vector<std::string> new_cuda_libraries() {
  struct Ctx {
    std::vector<std::string> found;
    unsigned long long adds = 0;
    bool unchanged = false;
  } ctx;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        auto* c = static_cast<Ctx*>(data);
        if (c->found.empty() && c->adds == 0) {
          c->adds = info->dlpi_adds;
          if (c->adds == __atomic_load_n(&g_last_adds, __ATOMIC_RELAXED)) {
            c->unchanged = true;
            return 1;
          }
        }
        if (info->dlpi_name != nullptr && is_cuda_library(basename_of(info->dlpi_name))) {
          c->found.emplace_back(info->dlpi_name);
        }
        return 0;
      },
      &ctx);
  if (g_scan_needed.load(std::memory_order_relaxed)) {
    g_scan_needed.store(false, std::memory_order_relaxed);
  }
  if (ctx.unchanged) return {};
  __atomic_store_n(&g_last_adds, ctx.adds, __ATOMIC_RELAXED);
  std::vector<std::string> fresh;
  if (ctx.found.empty()) return fresh;
  activate();
  std::lock_guard lock(g_mu);
  if (g_seen_libs == nullptr) g_seen_libs = new std::vector<std::string>;
  for (auto& path : ctx.found) {
    bool seen = false;
    for (const auto& s : *g_seen_libs) seen = seen || s == path;
    if (seen) continue;
    g_seen_libs->push_back(path);
    fresh.push_back(std::move(path));
  }
  return fresh;
}

// Records the CUDA libraries that arrived; `raw`/`stack` is the dlopen that brought them, if known.
void scan(const RawStack* raw, const Stack* stack, std::string_view via) {
  auto fresh = new_cuda_libraries();
  for (const auto& path : fresh) {
    auto base = basename_of(path);
    if (starts_with(base, "libcuda.so")) g_driver_seen.store(true);
    Event e;
    e.kind = EventKind::kDriverLoaded;
    e.what = std::string(base) + " (" + path + ")";
    e.fields.emplace_back("library", path);
    PendingLoad* pending = nullptr;
    {
      std::lock_guard lock(g_mu);
      if (g_pending_load != nullptr && starts_with(base, basename_of(g_pending_load->name))) {
        pending = g_pending_load;
        g_pending_load = nullptr;
      }
    }
    if (pending != nullptr) {
      e.raw = pending->raw;
      e.time = pending->time;
      e.stack = std::move(pending->stack);
      e.fields.emplace_back("via", "dlopen(\"" + pending->name + "\")");
      delete pending;
    } else if (raw != nullptr) {
      e.raw = *raw;
      if (stack != nullptr) e.stack = *stack;
      e.fields.emplace_back("via", "dlopen(\"" + std::string(via) + "\")");
    } else {
      e.fields.emplace_back("via", std::string(via));
    }
    record(std::move(e));
  }
}

void scan_if_needed() {
  if (g_scan_needed.load(std::memory_order_relaxed)) scan(nullptr, nullptr, "loaded earlier");
}

// ctypes and libffi hold no lock of the program's when they call into C: the thread there may
// wait for the GIL (it released it just before the call).
GilPolicy policy_for_caller(const void* caller) {
  const std::string object = object_of(caller);
  const auto base = basename_of(object);
  if (starts_with(base, "libffi.so") || starts_with(base, "_ctypes")) return GilPolicy::kMayTake;
  return GilPolicy::kIfHeld;
}

// --- cuInit
// ---------------------------------------------------------------------------------------
struct InitCapture {
  RawStack raw;
  Stack stack;
};

std::atomic<void*> g_real_cuinit{nullptr};
std::atomic<void*> g_real_get_proc{nullptr};
std::atomic<void*> g_real_get_proc_v2{nullptr};

std::string prepared_init_text(const Event& init);
void poisoned_touch(const char* touch, const void* caller, GilPolicy policy);

CUresult traced_cuinit(unsigned int flags) {
  auto real = reinterpret_cast<CUresult (*)(unsigned int)>(g_real_cuinit.load());
  if (t_busy || real == nullptr) return real != nullptr ? real(flags) : 3;
  const void* caller = __builtin_return_address(0);
  const GilPolicy policy = policy_for_caller(caller);
  if (g_poisoned != nullptr) poisoned_touch("cuInit", caller, policy);
  if (g_init_recorded.load()) return real(flags);
  InitCapture capture;
  {
    Busy busy;
    capture_pcs(capture.raw);
    python_frames(capture.stack, policy);
    scan_if_needed();
  }
  t_in_cuinit = &capture;
  const CUresult r = real(flags);
  t_in_cuinit = nullptr;
  if (r == 0 && !g_init_recorded.exchange(true)) {
    Busy busy;
    Event e;
    e.kind = EventKind::kCudaInit;
    e.what = "cuInit(" + std::to_string(flags) + ") = CUDA_SUCCESS";
    e.raw = capture.raw;
    e.stack = std::move(capture.stack);
    e.fields.emplace_back("call", "cuInit");
    record(std::move(e));
  }
  return r;
}

void* wrap_cuinit(void* real) {
  if (real == reinterpret_cast<void*>(&traced_cuinit)) return real;
  void* expected = nullptr;
  g_real_cuinit.compare_exchange_strong(expected, real);
  return g_real_cuinit.load() == real ? reinterpret_cast<void*>(&traced_cuinit) : real;
}

void* get_proc_result(const char* symbol, void* found);

CUresult traced_get_proc(const char* symbol, void** pfn, int version, unsigned long long flags) {
  auto real = reinterpret_cast<CUresult (*)(const char*, void**, int, unsigned long long)>(
      g_real_get_proc.load());
  CUresult r = 0;
  {
    Busy busy;  // the driver's own lookups are not the program's
    r = real(symbol, pfn, version, flags);
  }
  if (r == 0 && pfn != nullptr) *pfn = get_proc_result(symbol, *pfn);
  return r;
}

CUresult traced_get_proc_v2(const char* symbol, void** pfn, int version, unsigned long long flags,
                            void* status) {
  auto real = reinterpret_cast<CUresult (*)(const char*, void**, int, unsigned long long, void*)>(
      g_real_get_proc_v2.load());
  CUresult r = 0;
  {
    Busy busy;
    r = real(symbol, pfn, version, flags, status);
  }
  if (r == 0 && pfn != nullptr) *pfn = get_proc_result(symbol, *pfn);
  return r;
}

void* wrap_get_proc(std::atomic<void*>& slot, void* real, void* traced) {
  void* expected = nullptr;
  slot.compare_exchange_strong(expected, real);
  return slot.load() == real ? traced : real;
}

// The CUDA runtime asks the driver for its entry points (cuGetProcAddress), cuInit among them.
void* get_proc_result(const char* symbol, void* found) {
  if (symbol == nullptr || found == nullptr) return found;
  if (std::strcmp(symbol, "cuInit") == 0) return wrap_cuinit(found);
  if (std::strcmp(symbol, "cuGetProcAddress") == 0) {
    return wrap_get_proc(g_real_get_proc, found, reinterpret_cast<void*>(&traced_get_proc));
  }
  if (std::strcmp(symbol, "cuGetProcAddress_v2") == 0) {
    return wrap_get_proc(g_real_get_proc_v2, found, reinterpret_cast<void*>(&traced_get_proc_v2));
  }
  return found;
}

// --- device files
// ---------------------------------------------------------------------------------
void device_opened(const char* path, const void* caller) {
  const Device device = device_of(path);
  if (device == Device::kNone) return;
  if (g_poisoned != nullptr) {
    // NVML opens nvidiactl and nvidiaN too, and works in a forked child: not a CUDA touch.
    const std::string object = object_of(caller);
    const bool nvml = starts_with(basename_of(object), "libnvidia-ml.so");
    if (device == Device::kUvm || !nvml) {
      poisoned_touch(device == Device::kUvm ? "open of nvidia-uvm" : "open of a GPU device file",
                     caller, GilPolicy::kIfHeld);
    }
  }
  unsigned bit = 0;
  if (device == Device::kControl) bit = 1u;
  if (device == Device::kUvm) bit = 2u;
  if (device == Device::kGpu) {
    bit = 4u << std::min(std::atoi(basename_of(path).substr(6).data()), 29);
  }
  activate();
  {
    std::lock_guard lock(g_mu);
    if ((g_devices_seen & bit) != 0) return;
    g_devices_seen |= bit;
  }
  Busy busy;
  scan_if_needed();
  Event e;
  e.kind = EventKind::kDeviceOpened;
  e.what = path;
  e.fields.emplace_back("device", std::string(basename_of(path)));
  capture_pcs(e.raw);
  if (t_in_cuinit != nullptr) {
    e.stack.python = t_in_cuinit->stack.python;
    e.stack.python_note = t_in_cuinit->stack.python_note;
    e.fields.emplace_back("inside", "cuInit");
  } else {
    python_frames(e.stack, GilPolicy::kIfHeld);
  }
  const bool uvm_outside_cuinit = device == Device::kUvm && t_in_cuinit == nullptr;
  Event init;
  if (uvm_outside_cuinit) init = e;
  record(std::move(e));
  // Only cuInit opens nvidia-uvm: where cuInit was not intercepted (a program linked against the
  // driver), this open is the init site.
  if (uvm_outside_cuinit && !g_init_recorded.exchange(true)) {
    init.kind = EventKind::kCudaInit;
    init.time = 0;
    init.what = "CUDA initialized (first open of nvidia-uvm; cuInit itself not intercepted)";
    init.fields = {{"call", "open(nvidia-uvm)"}};
    record(std::move(init));
  }
}

// --- GNU OpenMP's thread pool
// ---------------------------------------------------------------------
// libgomp starts a thread's pool of workers with pthread_create at that thread's first parallel
// region (PyTorch: its first parallel CPU op), and the pool does not survive fork: a child's first
// parallel region waits for workers that do not exist. The first pthread_create called from a
// libgomp mapping is the pool's start; its stack is the site the dirty-fork report names.
//
// Every other pthread_create pays an atomic load while no pool was seen, and a look at a small
// cache of callers known not to be libgomp; a caller not in it costs one dl_iterate_phdr walk
// (no symbol search, no allocation).
std::atomic<bool> g_omp_claimed{false};  // this process's pool start is recorded (or being)
std::atomic<bool> g_omp_started{false};  // ... recorded: the fork handlers ask the probe

constexpr int kCallerSlots = 16;
std::atomic<uintptr_t> g_not_libgomp[kCallerSlots];  // racy by design: a lost entry costs a walk
std::atomic<unsigned> g_not_libgomp_next{0};

bool known_not_libgomp(uintptr_t pc) {
  for (const auto& slot : g_not_libgomp) {
    if (slot.load(std::memory_order_relaxed) == pc) return true;
  }
  return false;
}

// The object that contains `pc`, found through the program headers of the loaded objects.
struct ObjectAt {
  uintptr_t pc = 0;
  bool found = false;
  char path[512] = {};
};

void find_object(ObjectAt& at) {
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        auto* at = static_cast<ObjectAt*>(data);
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr)& ph = info->dlpi_phdr[i];
          if (ph.p_type != PT_LOAD) continue;
          const uintptr_t start = info->dlpi_addr + ph.p_vaddr;
          if (at->pc - start < ph.p_memsz) {
            at->found = true;
            const char* name = info->dlpi_name != nullptr ? info->dlpi_name : "";
            std::strncpy(at->path, name, sizeof at->path - 1);
            return 1;
          }
        }
        return 0;
      },
      &at);
}

bool is_sanitizer_runtime(std::string_view base) {
  return starts_with(base, "libasan.so") || starts_with(base, "libtsan.so");
}

void record_pool_start(const char* library) {
  Busy busy;
  Event e;
  e.kind = EventKind::kOpenMpPool;
  e.what = "pthread_create from " + std::string(basename_of(library));
  e.fields.emplace_back("library", library);
  e.fields.emplace_back("call", "pthread_create");
  capture_pcs(e.raw);
  // The thread that starts a pool is in the program's compute code, which released the GIL
  // (PyTorch does for every op): libgomp holds no lock while it creates its workers, and none of
  // ours is held here, so waiting for the GIL cannot close a circle through us or libgomp.
  python_frames(e.stack, GilPolicy::kMayTake);
  record(std::move(e));
  g_omp_started.store(true);
}

// Called by the interposed pthread_create, before the thread exists, with its caller.
void thread_created_by(const void* caller) {
  const auto pc = reinterpret_cast<uintptr_t>(caller);
  if (known_not_libgomp(pc)) return;
  ObjectAt at;
  at.pc = pc;
  find_object(at);
  auto base = basename_of(at.path);
  if (at.found && is_sanitizer_runtime(base)) {
    // A sanitizer's interceptor in front of us: the real caller is the frame below it.
    RawStack raw;
    capture_pcs(raw);
    for (int i = 0; i < raw.size; ++i) {
      ObjectAt below;
      below.pc = raw.pcs[i];
      find_object(below);
      const auto b = basename_of(below.path);
      if (!below.found || below.path == self_path() || is_sanitizer_runtime(b)) continue;
      if (starts_with(b, "libgomp") && !g_omp_claimed.exchange(true)) record_pool_start(below.path);
      return;
    }
    return;
  }
  if (!at.found || !starts_with(base, "libgomp")) {
    const unsigned slot = g_not_libgomp_next.fetch_add(1, std::memory_order_relaxed);
    g_not_libgomp[slot % kCallerSlots].store(pc, std::memory_order_relaxed);
    return;
  }
  if (!g_omp_claimed.exchange(true)) record_pool_start(at.path);
}

// --- reports
// --------------------------------------------------------------------------------------
std::optional<Event> first_event(EventKind kind) {
  std::lock_guard lock(g_mu);
  for (const auto& e : events()) {
    if (e.kind == kind) return e;
  }
  return std::nullopt;
}

std::string prepared_init_text(const Event& init) {
  return "  CUDA was initialized in PID " + std::to_string(init.pid) + " at " +
         headline(init.stack) + " (" + init.what + "):\n" + format_stack(init.stack, "    ");
}

// The most recent event of `kind` recorded by this process, else the first one inherited.
std::optional<Event> own_event(EventKind kind) {
  std::lock_guard lock(g_mu);
  const pid_t me = ::getpid();
  const Event* found = nullptr;
  for (const auto& e : events()) {
    if (e.kind != kind) continue;
    if (e.pid == me || found == nullptr) found = &e;
  }
  if (found == nullptr) return std::nullopt;
  return *found;
}

std::string evidence_text(const probe::CudaState& state, bool openmp_only) {
  std::string out;
  for (const auto& ev : state.evidence) {
    if (ev.kind == probe::EvidenceKind::kEnvironment) continue;
    const bool openmp =
        ev.kind == probe::EvidenceKind::kOpenMpPool || ev.kind == probe::EvidenceKind::kLiveThread;
    if (openmp_only && !openmp) continue;
    out += "    - " + std::string(probe::to_string(ev.kind)) + ": " + ev.detail + "\n";
  }
  return out;
}

// One report a fork may need: CUDA's, GNU OpenMP's, or both.
struct ForkReport {
  Event event;          // dirty_fork or openmp_fork; child_pid and repeat added once known
  std::string verdict;  // the probe's
  std::string body;     // the report below its first line
  std::string site;     // fork site + cause site: repeated forks from one place are reported once
};

// What the parent knew at fork time, for its reports and its child's.
struct PreparedFork {
  int read_fd = -1;
  int write_fd = -1;
  std::vector<ForkReport> reports;
  bool cuda = false;  // CUDA's state was not fork-safe: the child is poisoned (child_info)
  PoisonedInfo child_info;
};

// A fork's report as both kinds begin it: the event, the verdict, the fork's own stack.
ForkReport fork_report(const Event& fork, EventKind kind, const probe::CudaState& state,
                       const char* what) {
  ForkReport r;
  r.event = fork;
  r.event.kind = kind;
  r.verdict = std::string(probe::to_string(state.verdict));
  r.event.what = std::string(what) + " (" + r.verdict + ")";
  r.event.fields.emplace_back("verdict", r.verdict);
  r.body =
      "  fork() called at " + headline(r.event.stack) + ":\n" + format_stack(r.event.stack, "    ");
  return r;
}

ForkReport cuda_report(const Event& fork, const probe::CudaState& state, PoisonedInfo& child) {
  ForkReport r =
      fork_report(fork, EventKind::kDirtyFork, state, "fork() with CUDA state not fork-safe");
  Event& e = r.event;
  const std::string& verdict = r.verdict;
  std::string body = std::move(r.body);
  std::string init_text =
      "  where CUDA was initialized: not seen (it happened before tracing or "
      "through a path not intercepted)\n";
  std::string init_headline = "(not seen)";
  if (auto init = first_event(EventKind::kCudaInit)) {
    ensure_symbolized(*init);
    init_text = prepared_init_text(*init);
    init_headline = headline(init->stack);
    e.fields.emplace_back("init_site", init_headline);
  }
  body += init_text;
  if (auto load = first_event(EventKind::kDriverLoaded)) {
    ensure_symbolized(*load);
    body += "  driver loaded: " + load->what;
    if (load->raw.size > 0) {
      body += " at " + headline(load->stack) + "\n";
    } else {
      body += " (linked at start-up)\n";
    }
  }
  {
    std::string files;
    std::lock_guard lock(g_mu);
    for (const auto& ev : events()) {
      if (ev.kind == EventKind::kDeviceOpened && ev.pid == ::getpid()) {
        files += (files.empty() ? "" : ", ") + std::string(basename_of(ev.what));
      }
    }
    if (!files.empty()) body += "  device files opened: " + files + "\n";
  }
  body += "  evidence (forkguard probe, verdict " + verdict + "):\n";
  body += evidence_text(state, false);
  body += "  cure:\n" + cure_text("    ");
  r.body = std::move(body);
  r.site = headline(e.stack) + "|" + init_headline;
  child.parent = ::getpid();
  child.parent_verdict = verdict;
  child.parent_init = std::move(init_text);
  child.parent_init_headline = init_headline;
  return r;
}

ForkReport openmp_report(const Event& fork, const probe::CudaState& state) {
  ForkReport r = fork_report(fork, EventKind::kOpenMpFork, state,
                             "fork() with GNU OpenMP's thread pool alive");
  Event& e = r.event;
  const std::string& verdict = r.verdict;
  std::string body = std::move(r.body);
  std::string pool_headline = "(not seen)";
  if (auto pool = own_event(EventKind::kOpenMpPool)) {
    ensure_symbolized(*pool);
    pool_headline = headline(pool->stack);
    e.fields.emplace_back("pool_site", pool_headline);
    body += "  GNU OpenMP's thread pool was started in PID " + std::to_string(pool->pid) + " at " +
            pool_headline + " (" + pool->what + "):\n" + format_stack(pool->stack, "    ");
  } else {
    body +=
        "  where GNU OpenMP's thread pool was started: not seen (before tracing, or by a "
        "pthread_create not called from libgomp's own code)\n";
  }
  body += "  evidence (forkguard probe, verdict " + verdict + "):\n";
  body += evidence_text(state, true);
  body += "  cure:\n" + openmp_cure_text("    ");
  r.body = std::move(body);
  r.site = headline(e.stack) + "|" + pool_headline;
  return r;
}

PreparedFork* prepare_fork() {
  std::optional<probe::CudaState> state;
  try {
    state = probe::self_if_fork_unsafe();
  } catch (...) {
    return nullptr;  // the probe could not look: no report rather than a wrong one
  }
  if (!state) return nullptr;
  // CUDA's verdict stands where it is not fork-safe, a live pool is then evidence beside it.
  const bool openmp =
      state->verdict == probe::Verdict::kOpenMpPool || state->has(probe::EvidenceKind::kOpenMpPool);
  const bool cuda =
      !probe::is_fork_safe(state->verdict) && state->verdict != probe::Verdict::kOpenMpPool;
  if (!cuda && !openmp) return nullptr;
  auto* p = new PreparedFork;
  Event fork;
  fork.time = now_epoch();
  capture_pcs(fork.raw);
  python_frames(fork.stack, GilPolicy::kIfHeld);
  ensure_symbolized(fork);
  if (cuda) {
    p->cuda = true;
    p->reports.push_back(cuda_report(fork, *state, p->child_info));
  }
  if (openmp) p->reports.push_back(openmp_report(fork, *state));
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) == 0) {
    p->read_fd = fds[0];
    p->write_fd = fds[1];
    ::fcntl(p->read_fd, F_SETFL, O_NONBLOCK);
  }
  return p;
}

void poisoned_touch(const char* touch, const void* caller, GilPolicy policy) {
  if (g_poisoned == nullptr || t_busy || g_poisoned_reported.exchange(true)) return;
  (void)caller;
  Busy busy;
  const PoisonedInfo& info = *g_poisoned;
  Event e;
  e.kind = EventKind::kPoisonedTouch;
  e.what = std::string(touch) + " in a child forked after CUDA was initialized in PID " +
           std::to_string(info.parent);
  capture_pcs(e.raw);
  python_frames(e.stack, policy);
  ensure_symbolized(e);
  e.fields.emplace_back("touch", touch);
  e.fields.emplace_back("parent_init_site", info.parent_init_headline);
  e.numbers.emplace_back("parent_pid", info.parent);
  e.numbers.emplace_back("strict", config().strict ? 1 : 0);
  std::string text = "forkguard trace: PID " + std::to_string(::getpid()) + " touched CUDA (" +
                     touch + ") at " + headline(e.stack) + ", but it was forked from PID " +
                     std::to_string(info.parent) + " after CUDA was initialized there (verdict " +
                     info.parent_verdict +
                     ").\n  CUDA calls in this process fail with CUDA_ERROR_NOT_INITIALIZED (3) "
                     "(PyTorch: \"Cannot re-initialize CUDA in forked subprocess\"): the driver's "
                     "state does not survive fork.\n";
  text += "  touched at " + headline(e.stack) + ":\n" + format_stack(e.stack, "    ");
  text += "  in the parent, PID " + std::to_string(info.parent) + ":\n" + info.parent_init;
  text += "  cure:\n" + cure_text("    ");
  if (config().strict) {
    text += "  forkguard trace --strict: exiting with code 70 here.\n";
  }
  write_all(2, text);
  record(std::move(e));
  if (config().strict) ::_exit(kExitStrict);
}

// --- the watcher: was the fork followed by exec? ------------------------------------------------
// The parent keeps the read end of a close-on-exec pipe whose write end only the child holds.
// The child writes its PID at once, and 'e' just before exec. EOF after an 'e': fork-then-exec,
// nothing to say. EOF without one (the child exited or died), or no exec within the grace period:
// a dirty fork, reported by the parent.
struct Pending {
  PreparedFork* prepared;
  pid_t child = 0;
  int got = 0;
  unsigned char pid_bytes[sizeof(pid_t)];
  bool exec = false;
  Clock::time_point deadline;
};

std::mutex g_watch_mu;
std::condition_variable* g_watch_cv = nullptr;  // never destroyed (stop() runs after destructors)
std::vector<Pending>* g_pending = nullptr;
std::vector<std::string>* g_reported_sites = nullptr;
bool g_watcher_running = false;
bool g_watcher_exiting = false;
bool g_watcher_done = false;
int g_wake[2] = {-1, -1};

void wake_watcher() {
  if (g_wake[1] >= 0) {
    char c = 1;
    ssize_t n = ::write(g_wake[1], &c, 1);
    (void)n;
  }
}

// Reads what the child sent; true when the entry is decided (EOF or exec).
bool drain(Pending& p) {
  unsigned char buf[64];
  for (;;) {
    ssize_t n = ::read(p.prepared->read_fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return p.exec;  // EAGAIN: nothing more for now
    if (n == 0) return true;
    for (ssize_t i = 0; i < n; ++i) {
      if (p.got < static_cast<int>(sizeof(pid_t))) {
        p.pid_bytes[p.got++] = buf[i];
        if (p.got == sizeof(pid_t)) std::memcpy(&p.child, p.pid_bytes, sizeof(pid_t));
      } else if (buf[i] == 'e') {
        p.exec = true;
      }
    }
  }
}

// The reports of a dirty fork, and their events.
std::string resolve(Pending& p) {
  PreparedFork& f = *p.prepared;
  if (g_reported_sites == nullptr) g_reported_sites = new std::vector<std::string>;
  const std::string me = std::to_string(::getpid());
  const std::string child = std::to_string(p.child);
  std::string text;
  for (auto& r : f.reports) {
    const bool cuda = r.event.kind == EventKind::kDirtyFork;
    const std::string site = (cuda ? "cuda|" : "openmp|") + r.site;
    bool repeat = false;
    for (const auto& s : *g_reported_sites) repeat = repeat || s == site;
    if (repeat && cuda) {
      text += "forkguard trace: PID " + me +
              " forked again after CUDA was initialized (child PID " + child + ", at " +
              headline(r.event.stack) + "): same fork and init sites as above.\n";
    } else if (repeat) {
      text += "forkguard trace: PID " + me +
              " forked again while GNU OpenMP's thread pool was alive (child PID " + child +
              ", at " + headline(r.event.stack) + "): same fork and pool sites as above.\n";
    } else if (cuda) {
      g_reported_sites->push_back(site);
      text += "forkguard trace: PID " + me + " forked child PID " + child +
              " after CUDA was initialized in it (verdict " + r.verdict +
              "): the child cannot use CUDA; every CUDA call there fails with "
              "CUDA_ERROR_NOT_INITIALIZED (3) (PyTorch: \"Cannot re-initialize CUDA in forked "
              "subprocess\").\n" +
              r.body;
    } else {
      g_reported_sites->push_back(site);
      text += "forkguard trace: PID " + me + " forked child PID " + child +
              " while GNU OpenMP's thread pool was alive in it (verdict " + r.verdict +
              "): the child hangs for ever at its first OpenMP parallel region (PyTorch: its "
              "first parallel CPU op), waiting for pool threads that fork did not copy.\n" +
              r.body;
    }
    r.event.numbers.emplace_back("child_pid", p.child);
    r.event.numbers.emplace_back("repeat", repeat ? 1 : 0);
  }
  return text;
}

void watch() {
  pthread_setname_np(pthread_self(), "forkguard-trace");
  for (;;) {
    std::vector<pollfd> fds;
    int timeout = -1;
    {
      std::unique_lock lock(g_watch_mu);
      if (g_pending->empty() && g_watcher_exiting) {
        g_watcher_done = true;
        g_watch_cv->notify_all();
        return;
      }
      fds.push_back({g_wake[0], POLLIN, 0});
      const auto now = Clock::now();
      for (const auto& p : *g_pending) {
        fds.push_back({p.prepared->read_fd, POLLIN, 0});
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(p.deadline - now).count();
        left = std::max<long long>(left + 1, 0);
        if (timeout < 0 || left < timeout) timeout = static_cast<int>(left);
      }
    }
    ::poll(fds.data(), fds.size(), timeout);
    std::vector<std::string> texts;
    std::vector<Event> fired;
    {
      std::unique_lock lock(g_watch_mu);
      char sink[64];
      while (::read(g_wake[0], sink, sizeof sink) > 0) {
      }
      const auto now = Clock::now();
      for (size_t i = 0; i < g_pending->size();) {
        Pending& p = (*g_pending)[i];
        const bool decided = drain(p);
        const bool late = now >= p.deadline;
        if (!decided && !late) {
          ++i;
          continue;
        }
        if (!p.exec && p.got == sizeof(pid_t)) {
          texts.push_back(resolve(p));
          for (auto& r : p.prepared->reports) fired.push_back(std::move(r.event));
        }
        ::close(p.prepared->read_fd);
        delete p.prepared;
        g_pending->erase(g_pending->begin() + static_cast<long>(i));
      }
    }
    for (const auto& t : texts) write_all(2, t);
    for (auto& e : fired) {
      Busy busy;
      record(std::move(e));
    }
  }
}

// --- fork handlers
// ----------------------------------------------------------------------------------
void before_fork() {
  if (!t_busy) {
    if (!g_driver_seen.load(std::memory_order_relaxed) &&
        g_scan_needed.load(std::memory_order_relaxed)) {
      Busy busy;
      scan_if_needed();
    }
    if (g_driver_seen.load(std::memory_order_relaxed) ||
        g_omp_started.load(std::memory_order_relaxed)) {
      Busy busy;
      t_prepared = prepare_fork();
    }
  }
  g_mu.lock();
  g_watch_mu.lock();
  t_locked = true;
}

void after_fork_parent() {
  if (!t_locked) return;
  t_locked = false;
  PreparedFork* p = t_prepared;
  t_prepared = nullptr;
  if (p != nullptr) {
    if (p->write_fd >= 0) ::close(p->write_fd);
    p->write_fd = -1;
    if (p->read_fd < 0) {
      delete p;  // no pipe: cannot tell fork-then-exec apart, so say nothing
    } else {
      if (g_pending == nullptr) g_pending = new std::vector<Pending>;
      Pending entry{p,  0,     0,
                    {}, false, Clock::now() + std::chrono::milliseconds(config().grace_ms)};
      g_pending->push_back(entry);
      if (!g_watcher_running && ::pipe2(g_wake, O_CLOEXEC | O_NONBLOCK) == 0) {
        if (g_watch_cv == nullptr) g_watch_cv = new std::condition_variable;
        g_watcher_running = true;
        g_watcher_exiting = false;
        g_watcher_done = false;
        std::thread(watch).detach();
      }
      wake_watcher();
    }
  }
  g_watch_mu.unlock();
  g_mu.unlock();
}

// Async-signal-safe: no allocation, no lock taken.
void after_fork_child() {
  t_locked = false;
  new (&g_mu) std::mutex;
  new (&g_watch_mu) std::mutex;
  g_watch_cv = nullptr;  // the parent's: leaked in the child, never touched
  g_pending = nullptr;   // the parent's entries: leaked in the child, never touched
  g_watcher_running = false;
  if (g_wake[0] >= 0) ::close(g_wake[0]);
  if (g_wake[1] >= 0) ::close(g_wake[1]);
  g_wake[0] = g_wake[1] = -1;
  if (g_exec_notify_fd >= 0) ::close(g_exec_notify_fd);  // our parent's pipe is not ours to write
  g_exec_notify_fd = -1;
  // The pool's threads were not copied: a pool this child starts is its own, recorded again.
  g_omp_claimed.store(false, std::memory_order_relaxed);
  g_omp_started.store(false, std::memory_order_relaxed);
  PreparedFork* p = t_prepared;
  t_prepared = nullptr;
  if (p == nullptr) return;
  if (p->read_fd >= 0) ::close(p->read_fd);
  if (p->write_fd >= 0) {
    const pid_t me = static_cast<pid_t>(::getpid());
    ssize_t n = ::write(p->write_fd, &me, sizeof me);
    (void)n;
    g_exec_notify_fd = p->write_fd;
  }
  if (!p->cuda) return;
  g_poisoned = &p->child_info;
  g_poisoned_reported.store(false, std::memory_order_relaxed);
}

void about_to_exec() {
  if (g_exec_notify_fd >= 0) {
    const char e = 'e';
    ssize_t n = ::write(g_exec_notify_fd, &e, 1);
    (void)n;
  }
}

__attribute__((constructor)) void start() {
  Busy busy;
  (void)config();
  (void)self_path();
  scan(nullptr, nullptr, "linked at start-up");
}

// At exit, the last loads are recorded and the forks still undecided are decided (each waits at
// most its grace period).
__attribute__((destructor)) void stop() {
  if (!t_busy) {
    Busy busy;
    scan_if_needed();  // a library loaded by a dlopen forwarded untouched, with no hook since
  }
  std::unique_lock lock(g_watch_mu);
  if (!g_watcher_running) return;
  g_watcher_exiting = true;
  wake_watcher();
  g_watch_cv->wait_for(lock, std::chrono::milliseconds(config().grace_ms + 2000),
                       [] { return g_watcher_done; });
}

template <typename F>
F next(const char* name) {
  return reinterpret_cast<F>(::dlsym(RTLD_NEXT, name));
}

void resolve_dl() {
  if (__atomic_load_n(&forkguard_trace_real_dlsym, __ATOMIC_ACQUIRE) != nullptr) return;
  void* real_dlsym = ::dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
  if (real_dlsym == nullptr) real_dlsym = ::dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
  auto lookup = reinterpret_cast<void* (*)(void*, const char*)>(real_dlsym);
  void* real_dlopen = lookup(RTLD_NEXT, "dlopen");
  __atomic_store_n(&forkguard_trace_real_dlopen, real_dlopen, __ATOMIC_RELEASE);
  __atomic_store_n(&forkguard_trace_real_dlsym, real_dlsym, __ATOMIC_RELEASE);
}

}  // namespace
}  // namespace forkguard::trace::detail

namespace ftd = forkguard::trace::detail;

// --- dlopen / dlsym (entry points in interpose_x86_64.S) ----------------------------------------
FG_HIDDEN int forkguard_trace_dlopen_pre(const char* file, int mode, const void* caller);
FG_HIDDEN void* forkguard_trace_dlopen_wrapped(const char* file, int mode);
FG_HIDDEN int forkguard_trace_dlsym_pre(void* handle, const char* name);
FG_HIDDEN void* forkguard_trace_dlsym_wrapped(void* handle, const char* name);

int forkguard_trace_dlopen_pre(const char* file, int /*mode*/, const void* caller) {
  ftd::resolve_dl();
  if (ftd::t_busy || file == nullptr) return 0;
  ftd::g_scan_needed.store(true, std::memory_order_relaxed);
  if (std::strchr(file, '/') != nullptr && std::strchr(file, '$') == nullptr) return 1;
  // A bare name: glibc searches the caller's RUNPATH, so the call goes to dlopen from the caller
  // itself. For the CUDA libraries the stack is taken now, for the scan that sees them arrive.
  if (!ftd::is_cuda_library(ftd::basename_of(file))) return 0;
  const int saved = errno;
  {
    ftd::Busy busy;
    auto* pending = new ftd::PendingLoad;
    pending->name = file;
    pending->time = ftd::now_epoch();
    ftd::capture_pcs(pending->raw);
    ftd::python_frames(pending->stack, ftd::policy_for_caller(caller));
    ftd::activate();
    std::lock_guard lock(ftd::g_mu);
    delete ftd::g_pending_load;
    ftd::g_pending_load = pending;
  }
  errno = saved;
  return 0;
}

// A dlopen by path (no search involved, so the caller does not matter): forwarded, then the
// libraries it brought in are looked at, with this stack.
void* forkguard_trace_dlopen_wrapped(const char* file, int mode) {
  auto real = reinterpret_cast<void* (*)(const char*, int)>(forkguard_trace_real_dlopen);
  void* handle = real(file, mode);
  if (handle == nullptr || ftd::t_busy) return handle;
  const int saved = errno;
  {
    ftd::Busy busy;
    auto fresh = ftd::new_cuda_libraries();
    if (!fresh.empty()) {
      ftd::RawStack raw;
      ftd::capture_pcs(raw);
      ftd::Stack stack;
      ftd::python_frames(stack, ftd::policy_for_caller(__builtin_return_address(0)));
      // Put them back as unseen and let scan() record them with this stack.
      {
        std::lock_guard lock(ftd::g_mu);
        for (const auto& path : fresh) {
          auto& seen = *ftd::g_seen_libs;
          for (size_t i = 0; i < seen.size(); ++i) {
            if (seen[i] == path) {
              seen.erase(seen.begin() + static_cast<long>(i));
              break;
            }
          }
        }
        ftd::g_last_adds = ~0ull;
      }
      ftd::scan(&raw, &stack, file);
    }
  }
  errno = saved;
  return handle;
}

int forkguard_trace_dlsym_pre(void* handle, const char* name) {
  ftd::resolve_dl();
  // RTLD_DEFAULT and RTLD_NEXT depend on the caller: always forwarded untouched.
  if (handle == RTLD_DEFAULT || handle == RTLD_NEXT || name == nullptr || ftd::t_busy) return 0;
  if (name[0] != 'c' || name[1] != 'u') return 0;
  return std::strcmp(name, "cuInit") == 0 || std::strcmp(name, "cuGetProcAddress") == 0 ||
         std::strcmp(name, "cuGetProcAddress_v2") == 0;
}

void* forkguard_trace_dlsym_wrapped(void* handle, const char* name) {
  auto real = reinterpret_cast<void* (*)(void*, const char*)>(forkguard_trace_real_dlsym);
  void* found = real(handle, name);
  if (found == nullptr) return found;
  const int saved = errno;
  {
    ftd::Busy busy;
    ftd::scan_if_needed();
  }
  errno = saved;
  return ftd::get_proc_result(name, found);
}

// --- open / openat: the NVIDIA device files
// -------------------------------------------------------
namespace {

mode_t mode_of(int flags, va_list ap) {
  return (flags & O_CREAT) != 0 || (flags & O_TMPFILE) == O_TMPFILE ? va_arg(ap, mode_t) : 0;
}

template <typename F>
F real_fn(F& slot, const char* name) {
  F f = __atomic_load_n(&slot, __ATOMIC_ACQUIRE);
  if (f == nullptr) {
    f = ftd::next<F>(name);
    __atomic_store_n(&slot, f, __ATOMIC_RELEASE);
  }
  return f;
}

int after_open(int fd, const char* path, const void* caller) {
  if (fd >= 0 && !ftd::t_busy && path != nullptr && std::strstr(path, "nvidia") != nullptr) {
    const int saved = errno;
    ftd::device_opened(path, caller);
    errno = saved;
  }
  return fd;
}

using OpenFn = int (*)(const char*, int, ...);
using OpenatFn = int (*)(int, const char*, int, ...);
using Open2Fn = int (*)(const char*, int);
using Openat2Fn = int (*)(int, const char*, int);
OpenFn g_open, g_open64;
OpenatFn g_openat, g_openat64;
Open2Fn g_open_2, g_open64_2;
Openat2Fn g_openat_2, g_openat64_2;

}  // namespace

FG_EXPORT int open(const char* path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = mode_of(flags, ap);
  va_end(ap);
  return after_open(real_fn(g_open, "open")(path, flags, mode), path, __builtin_return_address(0));
}

FG_EXPORT int open64(const char* path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = mode_of(flags, ap);
  va_end(ap);
  return after_open(real_fn(g_open64, "open64")(path, flags, mode), path,
                    __builtin_return_address(0));
}

FG_EXPORT int openat(int dirfd, const char* path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = mode_of(flags, ap);
  va_end(ap);
  return after_open(real_fn(g_openat, "openat")(dirfd, path, flags, mode), path,
                    __builtin_return_address(0));
}

FG_EXPORT int openat64(int dirfd, const char* path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = mode_of(flags, ap);
  va_end(ap);
  return after_open(real_fn(g_openat64, "openat64")(dirfd, path, flags, mode), path,
                    __builtin_return_address(0));
}

// What _FORTIFY_SOURCE builds call instead.
FG_EXPORT int __open_2(const char* path, int flags) {
  return after_open(real_fn(g_open_2, "__open_2")(path, flags), path, __builtin_return_address(0));
}
FG_EXPORT int __open64_2(const char* path, int flags) {
  return after_open(real_fn(g_open64_2, "__open64_2")(path, flags), path,
                    __builtin_return_address(0));
}
FG_EXPORT int __openat_2(int dirfd, const char* path, int flags) {
  return after_open(real_fn(g_openat_2, "__openat_2")(dirfd, path, flags), path,
                    __builtin_return_address(0));
}
FG_EXPORT int __openat64_2(int dirfd, const char* path, int flags) {
  return after_open(real_fn(g_openat64_2, "__openat64_2")(dirfd, path, flags), path,
                    __builtin_return_address(0));
}

// --- pthread_create: where GNU OpenMP's thread pool starts
// ----------------------------------------
namespace {
using PthreadCreateFn = int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
PthreadCreateFn g_pthread_create;
}  // namespace

FG_EXPORT int pthread_create(pthread_t* thread, const pthread_attr_t* attr, void* (*start)(void*),
                             void* arg) {
  const PthreadCreateFn real = real_fn(g_pthread_create, "pthread_create");
  if (!ftd::t_busy && !ftd::g_omp_claimed.load(std::memory_order_relaxed)) {
    const int saved = errno;
    {
      ftd::Busy busy;
      ftd::thread_created_by(__builtin_return_address(0));
    }
    errno = saved;
  }
  return real(thread, attr, start, arg);
}

// --- exec: tells the parent's watcher that this child is a fork-then-exec
// -------------------------
namespace {

using ExecveFn = int (*)(const char*, char* const[], char* const[]);
using ExecvFn = int (*)(const char*, char* const[]);
using FexecveFn = int (*)(int, char* const[], char* const[]);
using ExecveatFn = int (*)(int, const char*, char* const[], char* const[], int);
ExecveFn g_execve, g_execvpe;
ExecvFn g_execv, g_execvp;
FexecveFn g_fexecve;
ExecveatFn g_execveat;

// The arguments of execl and friends, up to the terminating null, on the stack (no malloc).
#define FG_COLLECT_ARGS(first, argv, after)                               \
  size_t argc_ = 1;                                                       \
  {                                                                       \
    va_list ap_;                                                          \
    va_start(ap_, first);                                                 \
    while (va_arg(ap_, const char*) != nullptr) ++argc_;                  \
    va_end(ap_);                                                          \
  }                                                                       \
  char** argv = static_cast<char**>(alloca((argc_ + 1) * sizeof(char*))); \
  {                                                                       \
    va_list ap_;                                                          \
    va_start(ap_, first);                                                 \
    argv[0] = const_cast<char*>(first);                                   \
    for (size_t i_ = 1; i_ <= argc_; ++i_) argv[i_] = va_arg(ap_, char*); \
    after;                                                                \
    va_end(ap_);                                                          \
  }

}  // namespace

FG_EXPORT int execve(const char* path, char* const argv[], char* const envp[]) noexcept {
  ftd::about_to_exec();
  return real_fn(g_execve, "execve")(path, argv, envp);
}
FG_EXPORT int execv(const char* path, char* const argv[]) noexcept {
  ftd::about_to_exec();
  return real_fn(g_execv, "execv")(path, argv);
}
FG_EXPORT int execvp(const char* file, char* const argv[]) noexcept {
  ftd::about_to_exec();
  return real_fn(g_execvp, "execvp")(file, argv);
}
FG_EXPORT int execvpe(const char* file, char* const argv[], char* const envp[]) noexcept {
  ftd::about_to_exec();
  return real_fn(g_execvpe, "execvpe")(file, argv, envp);
}
FG_EXPORT int fexecve(int fd, char* const argv[], char* const envp[]) noexcept {
  ftd::about_to_exec();
  return real_fn(g_fexecve, "fexecve")(fd, argv, envp);
}
FG_EXPORT int execveat(int dirfd, const char* path, char* const argv[], char* const envp[],
                       int flags) noexcept {
  ftd::about_to_exec();
  return real_fn(g_execveat, "execveat")(dirfd, path, argv, envp, flags);
}
FG_EXPORT int execl(const char* path, const char* arg, ...) noexcept {
  FG_COLLECT_ARGS(arg, argv, (void)0);
  ftd::about_to_exec();
  return real_fn(g_execv, "execv")(path, argv);
}
FG_EXPORT int execlp(const char* file, const char* arg, ...) noexcept {
  FG_COLLECT_ARGS(arg, argv, (void)0);
  ftd::about_to_exec();
  return real_fn(g_execvp, "execvp")(file, argv);
}
FG_EXPORT int execle(const char* path, const char* arg, ...) noexcept {
  char* const* envp = nullptr;
  FG_COLLECT_ARGS(arg, argv, envp = va_arg(ap_, char* const*));
  ftd::about_to_exec();
  return real_fn(g_execve, "execve")(path, argv, envp);
}
