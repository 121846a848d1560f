// Helper for the forkguard trace tests: starts GNU OpenMP's thread pool the way an OpenMP program
// does (GOMP_parallel, what `#pragma omp parallel` compiles to), then forks, with functions of its
// own name at each step so that reports can be checked for them. libgomp is dlopen()ed (Debian's
// libgomp.so.1, or FORKGUARD_LIBGOMP): no -fopenmp, so the sanitizer builds stay clean.
//
//   trace_openmp STEP...
//     parallel   GOMP_parallel(fn, data, 2, 0): libgomp starts its pool (one worker thread); then
//                waits until the worker is blocked (as the probe sees a pool)
//     thread     pthread_create and join a plain thread (not libgomp's)
//     fork-exit  fork; the child _exit(0)s at once (a parallel region there would hang for ever)
//     fork-exec  fork; the child execs /bin/true
// After each fork the parent waits for the child and prints "child exited N"; after `parallel`
// it prints "parallel ran on N threads". Exit code: 0, or 2 when a step failed.
#include <dirent.h>
#include <dlfcn.h>
#include <pthread.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);

std::atomic<int> g_ran{0};  // atomics: libgomp's barriers are invisible to ThreadSanitizer

void count_thread(void* data) {
  static_cast<std::atomic<int>*>(data)->fetch_add(1);
}

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "trace_openmp: %s\n", what);
  std::exit(2);
}

GompParallel gomp_parallel() {
  const char* path = std::getenv("FORKGUARD_LIBGOMP");
  void* gomp = ::dlopen(path != nullptr && *path != '\0' ? path : "libgomp.so.1", RTLD_NOW);
  if (gomp == nullptr) fail(::dlerror());
  auto fn = reinterpret_cast<GompParallel>(::dlsym(gomp, "GOMP_parallel"));
  if (fn == nullptr) fail("no GOMP_parallel in libgomp");
  return fn;
}

// Whether another thread of this process is running (state R), not blocked.
bool another_thread_runs() {
  const std::string self = std::to_string(::gettid());
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return false;
  bool runs = false;
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] == '.' || self == e->d_name) continue;
    FILE* f = std::fopen(("/proc/self/task/" + std::string(e->d_name) + "/stat").c_str(), "r");
    if (f == nullptr) continue;
    char buf[512] = {};
    const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    const char* paren = std::strrchr(buf, ')');
    if (n > 0 && paren != nullptr && paren[1] == ' ' && paren[2] == 'R') runs = true;
  }
  ::closedir(dir);
  return runs;
}

// The probe sees a pool by its workers blocked in libgomp. After a region they spin a while first
// (GOMP_SPINCOUNT), longer on a loaded machine: wait, up to 30 s, until none of them runs.
void wait_for_workers_to_block() {
  timespec deadline{};
  ::clock_gettime(CLOCK_MONOTONIC, &deadline);
  deadline.tv_sec += 30;
  while (another_thread_runs()) {
    timespec now{};
    ::clock_gettime(CLOCK_MONOTONIC, &now);
    if (now.tv_sec > deadline.tv_sec) fail("GNU OpenMP's workers still run after 30 s");
    const timespec ms{0, 1000000};
    ::nanosleep(&ms, nullptr);
  }
}

[[gnu::noinline]] void start_openmp_pool() {
  const GompParallel parallel = gomp_parallel();
  parallel(count_thread, &g_ran, 2, 0);  // trace-test: parallel site
  wait_for_workers_to_block();
  std::printf("parallel ran on %d threads\n", g_ran.load());
  std::fflush(stdout);
}

void* nothing(void*) {
  return nullptr;
}

[[gnu::noinline]] void start_plain_thread() {
  pthread_t t;
  if (::pthread_create(&t, nullptr, nothing, nullptr) != 0) fail("pthread_create");
  ::pthread_join(t, nullptr);
}

void wait_for(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
  }
  std::printf("child exited %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : 128);
  std::fflush(stdout);
}

[[gnu::noinline]] void fork_child_that_exits() {
  const pid_t pid = ::fork();  // trace-test: fork site
  if (pid == 0) ::_exit(0);
  if (pid < 0) fail("fork");
  wait_for(pid);
}

[[gnu::noinline]] void fork_child_that_execs() {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/true", "true", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  if (pid < 0) fail("fork");
  wait_for(pid);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const char* step = argv[i];
    if (std::strcmp(step, "parallel") == 0) {
      start_openmp_pool();
    } else if (std::strcmp(step, "thread") == 0) {
      start_plain_thread();
    } else if (std::strcmp(step, "fork-exit") == 0) {
      fork_child_that_exits();
    } else if (std::strcmp(step, "fork-exec") == 0) {
      fork_child_that_execs();
    } else {
      std::fprintf(stderr, "trace_openmp: unknown step %s\n", step);
      return 2;
    }
  }
  return 0;
}
