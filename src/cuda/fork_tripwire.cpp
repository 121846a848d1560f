#include "cuda/fork_tripwire.hpp"

#include <dlfcn.h>
#include <fmt/format.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "forkguard/cuda/driver.hpp"

namespace forkguard::cuda {
namespace {

std::atomic<unsigned> g_trips{0};
bool g_armed = false;

// What the driver itself returns for cuInit in a fork child of an initialized parent.
CUresult tripped_cu_init(unsigned int /*flags*/) {
  g_trips.fetch_add(1, std::memory_order_relaxed);
  return CUDA_ERROR_NOT_INITIALIZED;
}

#if defined(__x86_64__)
// movabs r11, imm64; jmp r11 (r11 is a scratch register in the SysV ABI: no caller keeps a
// value there across a call).
constexpr size_t kJumpBytes = 13;
void write_jump(unsigned char* at, const void* to) {
  const auto target = reinterpret_cast<uintptr_t>(to);
  at[0] = 0x49;
  at[1] = 0xBB;
  std::memcpy(at + 2, &target, sizeof target);
  at[10] = 0x41;
  at[11] = 0xFF;
  at[12] = 0xE3;
}
#endif

// The patch site: cuInit's address, checked to hold the jump. Sets `why` where it cannot.
unsigned char* patch_site(std::string& why) {
#if !defined(__x86_64__)
  why = "the CUDA fork tripwire is implemented for x86-64 only";
  return nullptr;
#else
  const Driver* driver = Driver::if_mapped();
  if (driver == nullptr) {
    why = "no CUDA driver is mapped in this process";
    return nullptr;
  }
  auto* entry = reinterpret_cast<void*>(driver->api().cuInit);
  Dl_info info{};
  void* extra = nullptr;  // dladdr1 gives the symbol table entry (const ElfW(Sym)*) here
  if (::dladdr1(entry, &info, &extra, RTLD_DL_SYMENT) == 0 || extra == nullptr) {
    why = fmt::format("cuInit of {} has no symbol table entry", driver->path());
    return nullptr;
  }
  const auto* symbol = static_cast<const ElfW(Sym)*>(extra);
  if (symbol->st_size < kJumpBytes) {
    why = fmt::format("cuInit of {} is {} bytes long, shorter than the {}-byte jump",
                      driver->path(), symbol->st_size, kJumpBytes);
    return nullptr;
  }
  return static_cast<unsigned char*>(entry);
#endif
}

}  // namespace

std::string fork_tripwire_unavailable() {
  std::string why;
  patch_site(why);
  return why;
}

void arm_fork_tripwire() {
  if (g_armed) return;
  std::string why;
  unsigned char* site = patch_site(why);
  if (site == nullptr) throw Error("cannot arm the CUDA fork tripwire: " + why);
#if defined(__x86_64__)
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t first = reinterpret_cast<uintptr_t>(site) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(site) + kJumpBytes;
  const size_t length = (end - first + page - 1) & ~(page - 1);
  auto* pages = reinterpret_cast<void*>(first);
  // Writable, then executable again: never both (a W^X policy refuses that), and nothing runs
  // the driver's code meanwhile (the caller is a single-threaded fork child).
  if (::mprotect(pages, length, PROT_READ | PROT_WRITE) != 0) {
    throw Error(fmt::format("cannot arm the CUDA fork tripwire: mprotect of cuInit's page: {}",
                            std::strerror(errno)));
  }
  write_jump(site, reinterpret_cast<const void*>(&tripped_cu_init));
  __builtin___clear_cache(reinterpret_cast<char*>(site),
                          reinterpret_cast<char*>(site + kJumpBytes));
  if (::mprotect(pages, length, PROT_READ | PROT_EXEC) != 0) {
    throw Error(fmt::format("the CUDA fork tripwire: mprotect restoring cuInit's page: {}",
                            std::strerror(errno)));
  }
  g_armed = true;
#endif
}

unsigned fork_tripwire_trips() noexcept {
  return g_trips.load(std::memory_order_relaxed);
}

}  // namespace forkguard::cuda
