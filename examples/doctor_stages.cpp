// The demo: `forkguard doctor` on one process as it goes from clean to CUDA-initialized, and on a
// child forked after that. Each stage runs `forkguard doctor --pid <this process>` by posix_spawn
// (fork+exec, which is safe at every stage).
//
//   FORKGUARD_CUDA_DRIVER=build/release/lib/fake_cuda/libcuda.so.1 build/release/bin/doctor_stages
#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <string>

#include "forkguard/cuda/driver.hpp"

extern char** environ;

namespace {

std::string sibling(const char* name) {
  char self[PATH_MAX] = {};
  ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  std::string dir = n > 0 ? std::string(self, static_cast<size_t>(n)) : std::string("./x");
  return dir.substr(0, dir.rfind('/') + 1) + name;
}

int doctor(const std::string& title, bool brief) {
  std::fflush(stdout);
  fmt::print("\n=== {} (PID {}) ===\n", title, ::getpid());
  std::fflush(stdout);
  std::string exe = sibling("forkguard");
  std::string pid = std::to_string(::getpid());
  const char* argv[] = {exe.c_str(), "doctor", "--pid", pid.c_str(), nullptr};
  pid_t child = -1;
  int rc = posix_spawn(&child, exe.c_str(), nullptr, nullptr, const_cast<char**>(argv), environ);
  if (rc != 0) {
    fmt::print(stderr, "failed to execute {}: {}\n", exe, std::strerror(rc));
    return -1;
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  fmt::print("--- doctor exit code {} ({}){}\n", code,
             code == 0   ? "fork safe"
             : code == 3 ? "fork UNSAFE"
                         : "error",
             brief ? "" : "");
  return code;
}

}  // namespace

int main() {
  namespace cuda = forkguard::cuda;
  try {
    doctor("1. a clean process", true);
    const auto& drv = cuda::Driver::load();
    fmt::print("\n[demo] loaded the driver: {}\n", drv.path());
    doctor("2. the driver loaded, not initialized", true);
    drv.check(drv.api().cuInit(0), "cuInit");
    fmt::print("\n[demo] cuInit(0) succeeded\n");
    doctor("3. the driver initialized", true);
    std::fflush(stdout);
    pid_t child = ::fork();
    if (child == 0) {
      int n = 0;
      auto r = drv.api().cuInit(0);
      fmt::print("\n[demo] in the forked child, cuInit returns {}; cuDeviceGetCount returns {}\n",
                 cuda::result_name(r), cuda::result_name(drv.api().cuDeviceGetCount(&n)));
      int code = doctor("4. a child forked after cuInit", true);
      std::fflush(stdout);
      ::_exit(code == 3 ? 0 : 1);
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
  } catch (const forkguard::Error& e) {
    fmt::print(stderr, "doctor_stages: {}\n", e.what());
    return 1;
  }
}
