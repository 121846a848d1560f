// Helper for the forkguard trace tests: walks through the CUDA stages named on its command line,
// in order, with functions of its own name at each step so that reports can be checked for them.
//
//   trace_fork STEP...
//     load         dlopen the driver (FORKGUARD_CUDA_DRIVER, else libcuda.so.1)
//     init         cuInit(0) through dlsym, as forkguard and ctypes reach it
//     init-gpa     cuInit(0) through cuGetProcAddress, as the CUDA runtime reaches it
//     init-linked  cuInit(0) called directly (trace_linked only: linked against the driver)
//     nvml-by-name dlopen("libnvidia-ml.so.1") by bare name, found through this program's own
//                  RUNPATH (trace_linked only)
//     nvml         dlopen NVML (FORKGUARD_NVML_LIBRARY) and nvmlInit_v2
//     fork-touch   fork; the child calls cuInit(0) and exits 0 (its result printed)
//     fork-exit    fork; the child exits 0 at once
//     fork-exec    fork; the child execs /bin/true
//     spawn        posix_spawn /bin/true
// After each fork the parent waits for the child and prints "child exited N"; the helper's exit
// code is the first non-zero child exit code (0 if none).
#include <dlfcn.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

extern char** environ;

namespace {

void* g_driver = nullptr;
int g_exit = 0;

const char* driver_path() {
  const char* p = std::getenv("FORKGUARD_CUDA_DRIVER");
  return p != nullptr && *p != '\0' ? p : "libcuda.so.1";
}

[[gnu::noinline]] void load_cuda_driver() {
  g_driver = ::dlopen(driver_path(), RTLD_NOW | RTLD_GLOBAL);
  if (g_driver == nullptr) {
    std::fprintf(stderr, "trace_fork: dlopen: %s\n", ::dlerror());
    std::exit(2);
  }
}

using CuInit = int (*)(unsigned);

// The driver's cuInit, called by the functions below themselves: their frames are the init and
// touch sites whatever the build (a sanitizer keeps frames a plain build would tail-call away).
[[gnu::noinline]] CuInit cuinit_function() {
  if (g_driver == nullptr) load_cuda_driver();
  auto cu_init = reinterpret_cast<CuInit>(::dlsym(g_driver, "cuInit"));
  if (cu_init == nullptr) {
    std::fprintf(stderr, "trace_fork: no cuInit\n");
    std::exit(2);
  }
  return cu_init;
}

[[gnu::noinline]] void initialize_cuda_in_parent() {
  std::printf("parent cuInit = %d\n", cuinit_function()(0));  // trace-test: init site
  std::fflush(stdout);
}

[[gnu::noinline]] void initialize_cuda_through_get_proc_address() {
  if (g_driver == nullptr) load_cuda_driver();
  using GetProc = int (*)(const char*, void**, int, unsigned long long);
  auto get_proc = reinterpret_cast<GetProc>(::dlsym(g_driver, "cuGetProcAddress"));
  void* fn = nullptr;
  if (get_proc == nullptr || get_proc("cuInit", &fn, 12000, 0) != 0 || fn == nullptr) {
    std::fprintf(stderr, "trace_fork: cuGetProcAddress(cuInit) failed\n");
    std::exit(2);
  }
  std::printf("parent cuInit = %d\n", reinterpret_cast<CuInit>(fn)(0));  // trace-test: gpa site
  std::fflush(stdout);
}

#ifdef TRACE_FORK_LINKED
extern "C" int cuInit(unsigned);

[[gnu::noinline]] void initialize_cuda_linked() {
  std::printf("parent cuInit = %d\n", cuInit(0));  // trace-test: linked init site
  std::fflush(stdout);
}

[[gnu::noinline]] void load_nvml_by_name() {
  void* h = ::dlopen("libnvidia-ml.so.1", RTLD_NOW);  // trace-test: nvml by name
  std::printf("dlopen(libnvidia-ml.so.1) %s\n", h != nullptr ? "ok" : ::dlerror());
  std::fflush(stdout);
}
#endif

[[gnu::noinline]] void open_nvml() {
  const char* lib = std::getenv("FORKGUARD_NVML_LIBRARY");
  void* h = ::dlopen(lib != nullptr ? lib : "libnvidia-ml.so.1", RTLD_NOW);
  auto init = h != nullptr ? reinterpret_cast<int (*)()>(::dlsym(h, "nvmlInit_v2")) : nullptr;
  std::printf("nvmlInit_v2 = %d\n", init != nullptr ? init() : -1);
  std::fflush(stdout);
}

void wait_for(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
  }
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::printf("child exited %d\n", code);
  std::fflush(stdout);
  if (g_exit == 0) g_exit = code;
}

[[gnu::noinline]] void worker_touches_cuda() {
  std::printf("child cuInit = %d\n", cuinit_function()(0));  // trace-test: touch site
  std::fflush(stdout);
}

[[gnu::noinline]] void fork_worker_that_uses_cuda() {
  std::fflush(stdout);
  pid_t pid = ::fork();
  if (pid == 0) {
    worker_touches_cuda();
    ::_exit(0);
  }
  wait_for(pid);
}

[[gnu::noinline]] void fork_worker_that_exits() {
  std::fflush(stdout);
  pid_t pid = ::fork();  // trace-test: fork site
  if (pid == 0) ::_exit(0);
  wait_for(pid);
}

[[gnu::noinline]] void fork_then_exec() {
  std::fflush(stdout);
  pid_t pid = ::fork();
  if (pid == 0) {
    char arg0[] = "true";
    char* argv[] = {arg0, nullptr};
    ::execv("/bin/true", argv);
    ::_exit(127);
  }
  wait_for(pid);
}

[[gnu::noinline]] void spawn_true() {
  char arg0[] = "true";
  char* argv[] = {arg0, nullptr};
  pid_t pid = -1;
  if (::posix_spawn(&pid, "/bin/true", nullptr, nullptr, argv, environ) != 0) std::exit(2);
  wait_for(pid);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string step = argv[i];
    if (step == "load") {
      load_cuda_driver();
    } else if (step == "init") {
      initialize_cuda_in_parent();
    } else if (step == "init-gpa") {
      initialize_cuda_through_get_proc_address();
#ifdef TRACE_FORK_LINKED
    } else if (step == "init-linked") {
      initialize_cuda_linked();
    } else if (step == "nvml-by-name") {
      load_nvml_by_name();
#endif
    } else if (step == "nvml") {
      open_nvml();
    } else if (step == "fork-touch") {
      fork_worker_that_uses_cuda();
    } else if (step == "fork-exit") {
      fork_worker_that_exits();
    } else if (step == "fork-exec") {
      fork_then_exec();
    } else if (step == "spawn") {
      spawn_true();
    } else {
      std::fprintf(stderr, "trace_fork: unknown step %s\n", step.c_str());
      return 2;
    }
  }
  return g_exit;
}
