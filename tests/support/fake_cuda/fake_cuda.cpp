// The test driver: a stand-in libcuda.so.1 with the real driver's fork semantics.
//
// - cuInit records the owner PID, opens nvidiactl, nvidia-uvm and nvidiaN (see fake_common.hpp)
//   and starts a thread named like the real driver's ("cuda-EvtHandlr"); with FAKE_CUDA_INIT_GATE
//   it waits between the two, so a test can hold a process in the middle of cuInit.
// - Before cuInit every call except cuInit, cuDriverGetVersion and the error-name calls returns
//   CUDA_ERROR_NOT_INITIALIZED and changes nothing.
// - In a child forked after cuInit, every call, cuInit included, returns
//   CUDA_ERROR_NOT_INITIALIZED: the driver's state does not survive fork.
// - Device count from FAKE_CUDA_DEVICES, filtered by CUDA_VISIBLE_DEVICES (indices or the fake
//   UUIDs) as the real driver does.
// - Contexts map their GPU's device file (as real contexts map /dev/nvidiaN); memory, streams and
//   events are host-backed so copies can be checked byte for byte.
#include <dlfcn.h>
#include <pthread.h>
#include <semaphore.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include <poll.h>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "fake_common.hpp"
#include "forkguard/cuda/api.hpp"

using namespace forkguard::cuda;  // NOLINT: the C API's names, as in cuda.h

struct CUctx_st {
  int device = 0;
  int refs = 0;
  void* mapping = nullptr;
};
// FAKE_CUDA_COPY_DELAY_MS > 0: async copies on a stream are queued and performed only when they
// complete (that many milliseconds after they were enqueued, once an event query, an event or
// stream synchronize sees them): a host buffer reused before its copy's event completed is
// caught, because the copy then reads the new bytes.
struct PendingCopy {
  char* dst;
  const char* src;
  size_t bytes;
  std::chrono::steady_clock::time_point due;
  uint64_t seq;
};
struct CUstream_st {
  std::mutex mutex;
  std::deque<PendingCopy> queue;
  uint64_t enqueued = 0;
  uint64_t completed = 0;
};
struct CUevent_st {
  bool recorded = false;
  CUstream stream = nullptr;
  uint64_t seq = 0;
};

namespace {

constexpr size_t kMapBytes = 4096;

std::atomic<pid_t> g_owner{0};
std::mutex g_mutex;
int g_count = 0;              // visible devices, fixed at cuInit
std::vector<int> g_physical;  // visible ordinal -> physical index
std::vector<int> g_fds;       // device files opened by cuInit
CUctx_st g_primary[64];
std::map<CUdeviceptr, size_t> g_allocations;
std::map<const char*, size_t> g_registered;
thread_local CUcontext g_current = nullptr;

CUresult done(const char* fn, CUresult r) {
  fake_cuda::log_call(fn, r);
  return r;
}

bool forked_child() {
  pid_t owner = g_owner.load();
  return owner != 0 && owner != ::getpid();
}

bool initialized() {
  return g_owner.load() == ::getpid();
}

// The real driver's rules: stop at the first invalid, unknown or repeated entry.
std::vector<int> visible_devices(int physical) {
  std::vector<int> out;
  const char* v = std::getenv("CUDA_VISIBLE_DEVICES");
  if (v == nullptr) {
    for (int i = 0; i < physical; ++i) out.push_back(i);
    return out;
  }
  std::string s(v);
  size_t pos = 0;
  while (pos <= s.size() && !s.empty()) {
    size_t comma = s.find(',', pos);
    std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    int idx = -1;
    if (!item.empty() && item.find_first_not_of("0123456789") == std::string::npos &&
        item.size() < 9) {
      idx = std::atoi(item.c_str());
    } else {
      for (int i = 0; i < physical; ++i) {
        if (!item.empty() && fake_cuda::uuid_of(i).rfind(item, 0) == 0 && item.size() > 4) idx = i;
      }
    }
    bool repeated = false;
    for (int o : out) repeated = repeated || o == idx;
    if (idx < 0 || idx >= physical || repeated) break;
    out.push_back(idx);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

// Posts `started` once it runs: cuInit returns only then, as the real driver's threads are up
// when its cuInit returns. A fork right after cuInit must not catch the thread half-created (its
// start-up takes locks, a sanitizer runtime's among them, that a forked child would never see
// released).
void* event_handler_thread(void* started) {
  ::sem_post(static_cast<sem_t*>(started));
  while (true) ::poll(nullptr, 0, -1);
  return nullptr;
}

// Common prologue: poisoned child and not-yet-initialized both answer CUDA_ERROR_NOT_INITIALIZED.
#define FAKE_REQUIRE_INIT(fn) \
  if (forked_child() || !initialized()) return done(fn, CUDA_ERROR_NOT_INITIALIZED);

#define FAKE_REQUIRE_CONTEXT(fn) \
  if (g_current == nullptr) return done(fn, CUDA_ERROR_INVALID_CONTEXT);

bool device_range_ok(CUdeviceptr p, size_t bytes) {
  auto it = g_allocations.upper_bound(p);
  if (it == g_allocations.begin()) return false;
  --it;
  return p >= it->first && p + bytes <= it->first + it->second;
}

const char* result_name(CUresult r) {
  switch (r) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
      return "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED";
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
    default: return nullptr;
  }
}

}  // namespace

extern "C" {

CUresult cuInit(unsigned int flags) {
  if (forked_child()) return done("cuInit", CUDA_ERROR_NOT_INITIALIZED);
  if (flags != 0) return done("cuInit", CUDA_ERROR_INVALID_VALUE);
  std::lock_guard lock(g_mutex);
  if (initialized()) return done("cuInit", CUDA_SUCCESS);
  int physical = fake_cuda::device_count();
  g_physical = visible_devices(physical);
  g_count = static_cast<int>(g_physical.size());
  if (g_count == 0) return done("cuInit", CUDA_ERROR_NO_DEVICE);
  const char* always[] = {"nvidiactl", "nvidia-uvm"};
  for (const char* name : always) g_fds.push_back(fake_cuda::open_device(name));
  for (int i = 0; i < physical; ++i) {
    std::string name = "nvidia" + std::to_string(i);
    g_fds.push_back(fake_cuda::open_device(name.c_str()));
  }
  for (int fd : g_fds) {
    if (fd < 0) return done("cuInit", CUDA_ERROR_UNKNOWN);
  }
  fake_cuda::wait_at_init_gate();
  pthread_t thread;
  static sem_t started;
  ::sem_init(&started, 0, 0);
  if (pthread_create(&thread, nullptr, event_handler_thread, &started) != 0) {
    return done("cuInit", CUDA_ERROR_OUT_OF_MEMORY);
  }
  while (::sem_wait(&started) != 0 && errno == EINTR) {
  }
  pthread_setname_np(thread, "cuda-EvtHandlr");
  pthread_detach(thread);
  for (int i = 0; i < g_count; ++i) g_primary[i].device = i;
  g_owner.store(::getpid());
  return done("cuInit", CUDA_SUCCESS);
}

CUresult cuDriverGetVersion(int* version) {
  if (forked_child()) return done("cuDriverGetVersion", CUDA_ERROR_NOT_INITIALIZED);
  if (version == nullptr) return done("cuDriverGetVersion", CUDA_ERROR_INVALID_VALUE);
  *version = 12080;
  return done("cuDriverGetVersion", CUDA_SUCCESS);
}

CUresult cuGetErrorName(CUresult error, const char** name) {
  if (forked_child()) return done("cuGetErrorName", CUDA_ERROR_NOT_INITIALIZED);
  const char* n = result_name(error);
  if (n == nullptr || name == nullptr) return done("cuGetErrorName", CUDA_ERROR_INVALID_VALUE);
  *name = n;
  return done("cuGetErrorName", CUDA_SUCCESS);
}

CUresult cuGetErrorString(CUresult error, const char** text) {
  if (forked_child()) return done("cuGetErrorString", CUDA_ERROR_NOT_INITIALIZED);
  const char* n = result_name(error);
  if (n == nullptr || text == nullptr) return done("cuGetErrorString", CUDA_ERROR_INVALID_VALUE);
  *text = n;
  return done("cuGetErrorString", CUDA_SUCCESS);
}

CUresult cuDeviceGetCount(int* count) {
  FAKE_REQUIRE_INIT("cuDeviceGetCount");
  if (count == nullptr) return done("cuDeviceGetCount", CUDA_ERROR_INVALID_VALUE);
  *count = g_count;
  return done("cuDeviceGetCount", CUDA_SUCCESS);
}

CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  FAKE_REQUIRE_INIT("cuDeviceGet");
  if (device == nullptr) return done("cuDeviceGet", CUDA_ERROR_INVALID_VALUE);
  if (ordinal < 0 || ordinal >= g_count) return done("cuDeviceGet", CUDA_ERROR_INVALID_DEVICE);
  *device = ordinal;
  return done("cuDeviceGet", CUDA_SUCCESS);
}

CUresult cuDeviceGetName(char* name, int len, CUdevice dev) {
  FAKE_REQUIRE_INIT("cuDeviceGetName");
  if (dev < 0 || dev >= g_count) return done("cuDeviceGetName", CUDA_ERROR_INVALID_DEVICE);
  if (name == nullptr || len <= 0) return done("cuDeviceGetName", CUDA_ERROR_INVALID_VALUE);
  std::snprintf(name, static_cast<size_t>(len), "Fake CUDA Device %d", g_physical[dev]);
  return done("cuDeviceGetName", CUDA_SUCCESS);
}

CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) {
  FAKE_REQUIRE_INIT("cuDeviceTotalMem_v2");
  if (dev < 0 || dev >= g_count) return done("cuDeviceTotalMem_v2", CUDA_ERROR_INVALID_DEVICE);
  if (bytes == nullptr) return done("cuDeviceTotalMem_v2", CUDA_ERROR_INVALID_VALUE);
  *bytes = size_t{16} << 30;
  return done("cuDeviceTotalMem_v2", CUDA_SUCCESS);
}

CUresult cuDeviceGetAttribute(int* value, CUdevice_attribute attrib, CUdevice dev) {
  FAKE_REQUIRE_INIT("cuDeviceGetAttribute");
  if (dev < 0 || dev >= g_count) return done("cuDeviceGetAttribute", CUDA_ERROR_INVALID_DEVICE);
  if (value == nullptr) return done("cuDeviceGetAttribute", CUDA_ERROR_INVALID_VALUE);
  switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: *value = g_physical[dev] + 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: *value = 0; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = 0; break;
    default: return done("cuDeviceGetAttribute", CUDA_ERROR_INVALID_VALUE);
  }
  return done("cuDeviceGetAttribute", CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  FAKE_REQUIRE_INIT("cuDevicePrimaryCtxRetain");
  if (dev < 0 || dev >= g_count) return done("cuDevicePrimaryCtxRetain", CUDA_ERROR_INVALID_DEVICE);
  if (ctx == nullptr) return done("cuDevicePrimaryCtxRetain", CUDA_ERROR_INVALID_VALUE);
  std::lock_guard lock(g_mutex);
  CUctx_st& c = g_primary[dev];
  if (c.refs == 0) {
    // A live context maps its GPU's device file, as the real driver's contexts map /dev/nvidiaN.
    std::string name = "nvidia" + std::to_string(g_physical[dev]);
    int fd = fake_cuda::open_device(name.c_str());
    if (fd < 0) return done("cuDevicePrimaryCtxRetain", CUDA_ERROR_UNKNOWN);
    if (::ftruncate(fd, kMapBytes) != 0) {
      ::close(fd);
      return done("cuDevicePrimaryCtxRetain", CUDA_ERROR_UNKNOWN);
    }
    void* m = ::mmap(nullptr, kMapBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (m == MAP_FAILED) return done("cuDevicePrimaryCtxRetain", CUDA_ERROR_OUT_OF_MEMORY);
    c.mapping = m;
  }
  ++c.refs;
  *ctx = &c;
  return done("cuDevicePrimaryCtxRetain", CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  FAKE_REQUIRE_INIT("cuDevicePrimaryCtxRelease_v2");
  if (dev < 0 || dev >= g_count) {
    return done("cuDevicePrimaryCtxRelease_v2", CUDA_ERROR_INVALID_DEVICE);
  }
  std::lock_guard lock(g_mutex);
  CUctx_st& c = g_primary[dev];
  if (c.refs == 0) return done("cuDevicePrimaryCtxRelease_v2", CUDA_ERROR_INVALID_CONTEXT);
  if (--c.refs == 0) {
    ::munmap(c.mapping, kMapBytes);
    c.mapping = nullptr;
    if (g_current == &c) g_current = nullptr;
  }
  return done("cuDevicePrimaryCtxRelease_v2", CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active) {
  FAKE_REQUIRE_INIT("cuDevicePrimaryCtxGetState");
  if (dev < 0 || dev >= g_count) {
    return done("cuDevicePrimaryCtxGetState", CUDA_ERROR_INVALID_DEVICE);
  }
  if (flags == nullptr || active == nullptr) {
    return done("cuDevicePrimaryCtxGetState", CUDA_ERROR_INVALID_VALUE);
  }
  std::lock_guard lock(g_mutex);
  *flags = 0;
  *active = g_primary[dev].refs > 0 ? 1 : 0;
  return done("cuDevicePrimaryCtxGetState", CUDA_SUCCESS);
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
  FAKE_REQUIRE_INIT("cuCtxSetCurrent");
  if (ctx != nullptr && ctx->refs == 0) return done("cuCtxSetCurrent", CUDA_ERROR_INVALID_CONTEXT);
  g_current = ctx;
  return done("cuCtxSetCurrent", CUDA_SUCCESS);
}

CUresult cuCtxGetCurrent(CUcontext* ctx) {
  FAKE_REQUIRE_INIT("cuCtxGetCurrent");
  if (ctx == nullptr) return done("cuCtxGetCurrent", CUDA_ERROR_INVALID_VALUE);
  *ctx = g_current;
  return done("cuCtxGetCurrent", CUDA_SUCCESS);
}

CUresult cuCtxSynchronize() {
  FAKE_REQUIRE_INIT("cuCtxSynchronize");
  FAKE_REQUIRE_CONTEXT("cuCtxSynchronize");
  return done("cuCtxSynchronize", CUDA_SUCCESS);
}

CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytes) {
  FAKE_REQUIRE_INIT("cuMemAlloc_v2");
  FAKE_REQUIRE_CONTEXT("cuMemAlloc_v2");
  if (dptr == nullptr || bytes == 0) return done("cuMemAlloc_v2", CUDA_ERROR_INVALID_VALUE);
  void* p = std::malloc(bytes);
  if (p == nullptr) return done("cuMemAlloc_v2", CUDA_ERROR_OUT_OF_MEMORY);
  std::lock_guard lock(g_mutex);
  *dptr = reinterpret_cast<CUdeviceptr>(p);
  g_allocations[*dptr] = bytes;
  return done("cuMemAlloc_v2", CUDA_SUCCESS);
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
  FAKE_REQUIRE_INIT("cuMemFree_v2");
  FAKE_REQUIRE_CONTEXT("cuMemFree_v2");
  std::lock_guard lock(g_mutex);
  auto it = g_allocations.find(dptr);
  if (it == g_allocations.end()) return done("cuMemFree_v2", CUDA_ERROR_INVALID_VALUE);
  std::free(reinterpret_cast<void*>(dptr));
  g_allocations.erase(it);
  return done("cuMemFree_v2", CUDA_SUCCESS);
}

CUresult cuMemHostRegister_v2(void* p, size_t bytes, unsigned int /*flags*/) {
  FAKE_REQUIRE_INIT("cuMemHostRegister_v2");
  FAKE_REQUIRE_CONTEXT("cuMemHostRegister_v2");
  if (p == nullptr || bytes == 0) return done("cuMemHostRegister_v2", CUDA_ERROR_INVALID_VALUE);
  std::lock_guard lock(g_mutex);
  const char* begin = static_cast<const char*>(p);
  for (const auto& [start, len] : g_registered) {
    if (begin < start + len && start < begin + bytes) {
      return done("cuMemHostRegister_v2", CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    }
  }
  g_registered[begin] = bytes;
  return done("cuMemHostRegister_v2", CUDA_SUCCESS);
}

CUresult cuMemHostUnregister(void* p) {
  FAKE_REQUIRE_INIT("cuMemHostUnregister");
  FAKE_REQUIRE_CONTEXT("cuMemHostUnregister");
  std::lock_guard lock(g_mutex);
  if (g_registered.erase(static_cast<const char*>(p)) == 0) {
    return done("cuMemHostUnregister", CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
  }
  return done("cuMemHostUnregister", CUDA_SUCCESS);
}

// Only CU_POINTER_ATTRIBUTE_MEMORY_TYPE (2): CU_MEMORYTYPE_HOST (1) inside memory registered with
// cuMemHostRegister, CU_MEMORYTYPE_DEVICE (2) inside an allocation; elsewhere, as the real driver
// says of memory it does not know, CUDA_ERROR_INVALID_VALUE. (How PyTorch's Tensor.is_pinned()
// asks, through the runtime's cudaPointerGetAttributes.)
CUresult cuPointerGetAttribute(void* data, int attribute, CUdeviceptr ptr) {
  FAKE_REQUIRE_INIT("cuPointerGetAttribute");
  constexpr int kMemoryType = 2;
  if (data == nullptr || attribute != kMemoryType) {
    return done("cuPointerGetAttribute", CUDA_ERROR_INVALID_VALUE);
  }
  std::lock_guard lock(g_mutex);
  const char* p = reinterpret_cast<const char*>(ptr);
  for (const auto& [start, len] : g_registered) {
    if (p >= start && p < start + len) {
      *static_cast<unsigned int*>(data) = 1;
      return done("cuPointerGetAttribute", CUDA_SUCCESS);
    }
  }
  if (device_range_ok(ptr, 1)) {
    *static_cast<unsigned int*>(data) = 2;
    return done("cuPointerGetAttribute", CUDA_SUCCESS);
  }
  return done("cuPointerGetAttribute", CUDA_ERROR_INVALID_VALUE);
}

namespace {
CUresult copy_htod(const char* fn, CUdeviceptr dst, const void* src, size_t bytes) {
  FAKE_REQUIRE_INIT(fn);
  FAKE_REQUIRE_CONTEXT(fn);
  std::lock_guard lock(g_mutex);
  if (src == nullptr || !device_range_ok(dst, bytes)) return done(fn, CUDA_ERROR_INVALID_VALUE);
  std::memcpy(reinterpret_cast<void*>(dst), src, bytes);
  return done(fn, CUDA_SUCCESS);
}
CUresult copy_dtoh(const char* fn, void* dst, CUdeviceptr src, size_t bytes) {
  FAKE_REQUIRE_INIT(fn);
  FAKE_REQUIRE_CONTEXT(fn);
  std::lock_guard lock(g_mutex);
  if (dst == nullptr || !device_range_ok(src, bytes)) return done(fn, CUDA_ERROR_INVALID_VALUE);
  std::memcpy(dst, reinterpret_cast<const void*>(src), bytes);
  return done(fn, CUDA_SUCCESS);
}
}  // namespace

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t bytes) {
  return copy_htod("cuMemcpyHtoD_v2", dst, src, bytes);
}
CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t bytes) {
  return copy_dtoh("cuMemcpyDtoH_v2", dst, src, bytes);
}
namespace {
int copy_delay_ms() {
  const char* v = std::getenv("FAKE_CUDA_COPY_DELAY_MS");
  return v == nullptr ? 0 : std::atoi(v);
}

// CU_STREAM_LEGACY (0x1) and CU_STREAM_PER_THREAD (0x2) are the synchronous null stream here.
CUstream own(CUstream s) {
  return reinterpret_cast<uintptr_t>(s) <= 2 ? nullptr : s;
}

void enqueue(CUstream s, char* dst, const char* src, size_t bytes, int delay_ms) {
  std::lock_guard lock(s->mutex);
  s->queue.push_back({dst, src, bytes,
                      std::chrono::steady_clock::now() + std::chrono::milliseconds(delay_ms),
                      ++s->enqueued});
}

// A copy queued on `stream`, performed when it completes; `device` is its device side.
CUresult queue_copy(const char* fn, char* dst, const char* src, size_t bytes, CUdeviceptr device,
                    CUstream stream, int delay_ms) {
  FAKE_REQUIRE_INIT(fn);
  FAKE_REQUIRE_CONTEXT(fn);
  {
    std::lock_guard lock(g_mutex);
    if (dst == nullptr || src == nullptr || !device_range_ok(device, bytes)) {
      return done(fn, CUDA_ERROR_INVALID_VALUE);
    }
  }
  enqueue(stream, dst, src, bytes, delay_ms);
  return done(fn, CUDA_SUCCESS);
}

// Performs the queued copies up to `seq`: those already due, or (block) all of them, waiting.
void flush(CUstream s, uint64_t seq, bool block) {
  std::lock_guard lock(s->mutex);
  while (!s->queue.empty() && s->queue.front().seq <= seq) {
    auto& c = s->queue.front();
    if (c.due > std::chrono::steady_clock::now()) {
      if (!block) return;
      std::this_thread::sleep_until(c.due);
    }
    std::memcpy(c.dst, c.src, c.bytes);
    s->completed = c.seq;
    s->queue.pop_front();
  }
  if (s->queue.empty()) s->completed = s->enqueued;
}
}  // namespace

// Host-backed: without FAKE_CUDA_COPY_DELAY_MS an "async" copy completes before it returns,
// which is one legal schedule; with it, the copy is queued on its stream and happens when it
// completes (the device's bytes are read, or written, then).
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) {
  stream = own(stream);
  const int delay = copy_delay_ms();
  if (delay <= 0 || stream == nullptr) return copy_htod("cuMemcpyHtoDAsync_v2", dst, src, bytes);
  return queue_copy("cuMemcpyHtoDAsync_v2", reinterpret_cast<char*>(dst),
                    static_cast<const char*>(src), bytes, dst, stream, delay);
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  stream = own(stream);
  const int delay = copy_delay_ms();
  if (delay <= 0 || stream == nullptr) return copy_dtoh("cuMemcpyDtoHAsync_v2", dst, src, bytes);
  return queue_copy("cuMemcpyDtoHAsync_v2", static_cast<char*>(dst),
                    reinterpret_cast<const char*>(src), bytes, src, stream, delay);
}

// Later work on `stream` waits for `event`: the event's stream runs up to it now (blocking the
// caller: a legal, if slow, schedule).
CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags) {
  FAKE_REQUIRE_INIT("cuStreamWaitEvent");
  FAKE_REQUIRE_CONTEXT("cuStreamWaitEvent");
  if (event == nullptr || flags != 0) return done("cuStreamWaitEvent", CUDA_ERROR_INVALID_VALUE);
  (void)stream;
  if (event->stream != nullptr) flush(event->stream, event->seq, true);
  return done("cuStreamWaitEvent", CUDA_SUCCESS);
}

CUresult cuStreamCreate(CUstream* stream, unsigned int) {
  FAKE_REQUIRE_INIT("cuStreamCreate");
  FAKE_REQUIRE_CONTEXT("cuStreamCreate");
  if (stream == nullptr) return done("cuStreamCreate", CUDA_ERROR_INVALID_VALUE);
  *stream = new CUstream_st;
  return done("cuStreamCreate", CUDA_SUCCESS);
}

CUresult cuStreamDestroy_v2(CUstream stream) {
  FAKE_REQUIRE_INIT("cuStreamDestroy_v2");
  if (stream == nullptr) return done("cuStreamDestroy_v2", CUDA_ERROR_INVALID_HANDLE);
  flush(stream, ~0ull, true);
  // Events recorded on it stay valid (CUDA allows destroying a stream whose events live on):
  // the finished stream is kept, reachable, rather than freed under them.
  static std::mutex destroyed_mutex;
  static std::vector<std::unique_ptr<CUstream_st>> destroyed;
  std::lock_guard lock(destroyed_mutex);
  destroyed.emplace_back(stream);
  return done("cuStreamDestroy_v2", CUDA_SUCCESS);
}

CUresult cuStreamSynchronize(CUstream stream) {
  FAKE_REQUIRE_INIT("cuStreamSynchronize");
  FAKE_REQUIRE_CONTEXT("cuStreamSynchronize");
  stream = own(stream);
  if (stream != nullptr) flush(stream, ~0ull, true);
  return done("cuStreamSynchronize", CUDA_SUCCESS);
}

CUresult cuEventCreate(CUevent* event, unsigned int) {
  FAKE_REQUIRE_INIT("cuEventCreate");
  FAKE_REQUIRE_CONTEXT("cuEventCreate");
  if (event == nullptr) return done("cuEventCreate", CUDA_ERROR_INVALID_VALUE);
  *event = new CUevent_st;
  return done("cuEventCreate", CUDA_SUCCESS);
}

CUresult cuEventRecord(CUevent event, CUstream stream) {
  FAKE_REQUIRE_INIT("cuEventRecord");
  stream = own(stream);
  if (event == nullptr) return done("cuEventRecord", CUDA_ERROR_INVALID_HANDLE);
  event->recorded = true;
  event->stream = stream;
  if (stream != nullptr) {
    std::lock_guard lock(stream->mutex);
    event->seq = stream->enqueued;
  }
  return done("cuEventRecord", CUDA_SUCCESS);
}

CUresult cuEventQuery(CUevent event) {
  FAKE_REQUIRE_INIT("cuEventQuery");
  if (event == nullptr) return done("cuEventQuery", CUDA_ERROR_INVALID_HANDLE);
  if (event->stream != nullptr) {
    flush(event->stream, event->seq, false);
    std::lock_guard lock(event->stream->mutex);
    if (event->stream->completed < event->seq) return done("cuEventQuery", CUDA_ERROR_NOT_READY);
  }
  return done("cuEventQuery", CUDA_SUCCESS);
}

CUresult cuEventSynchronize(CUevent event) {
  FAKE_REQUIRE_INIT("cuEventSynchronize");
  if (event == nullptr) return done("cuEventSynchronize", CUDA_ERROR_INVALID_HANDLE);
  if (event->stream != nullptr) flush(event->stream, event->seq, true);
  return done("cuEventSynchronize", CUDA_SUCCESS);
}

CUresult cuEventDestroy_v2(CUevent event) {
  FAKE_REQUIRE_INIT("cuEventDestroy_v2");
  if (event == nullptr) return done("cuEventDestroy_v2", CUDA_ERROR_INVALID_HANDLE);
  delete event;
  return done("cuEventDestroy_v2", CUDA_SUCCESS);
}

// The CUDA runtime's way to the driver's entry points (cuInit among them): any exported function
// of this library by name, as the real driver answers for the names it knows.
CUresult cuGetProcAddress(const char* symbol, void** pfn, int /*cudaVersion*/,
                          unsigned long long /*flags*/) {
  if (symbol == nullptr || pfn == nullptr)
    return done("cuGetProcAddress", CUDA_ERROR_INVALID_VALUE);
  Dl_info self{};
  void* handle = nullptr;
  if (::dladdr(reinterpret_cast<void*>(&cuGetProcAddress), &self) != 0) {
    handle = ::dlopen(self.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  }
  *pfn = handle != nullptr ? ::dlsym(handle, symbol) : nullptr;
  if (handle != nullptr) ::dlclose(handle);
  return done("cuGetProcAddress", *pfn != nullptr ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND);
}

}  // extern "C"

// Every exported function has exactly the signature forkguard's loader expects.
#define FAKE_CHECK_SIGNATURE(name, ret, params) \
  static_assert(std::is_same_v<decltype(&::name), PFN_##name>, #name);
FORKGUARD_CUDA_DRIVER_FUNCTIONS(FAKE_CHECK_SIGNATURE)
