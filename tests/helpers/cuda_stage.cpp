// Helper for multi-process probe tests: walks through CUDA stages on command and answers each
// command with one line on stdout.
//
//   load     dlopen the driver (FORKGUARD_CUDA_DRIVER)        -> "ok"
//   nvml     dlopen NVML and nvmlInit (files stay open)        -> "ok" | "error N"
//   init     cuInit(0)                                        -> "ok" | "error NAME"
//   count    cuDeviceGetCount                                 -> "count N" | "error NAME"
//   ctx      retain device 0's primary context, make current  -> "ok" | "error NAME"
//   release  release it                                       -> "ok" | "error NAME"
//   probe    probe::self()                                    -> "probe VERDICT KIND,KIND,..."
//   fork     fork(); the child answers "child PID" and takes the next commands; when it exits
//            the parent answers "parent STATUS"
//   pid      -> "pid PID"
//   exit     exits 0 (no answer)
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <string>

#include "forkguard/cuda/driver.hpp"
#include "forkguard/probe/cuda_state.hpp"

namespace cuda = forkguard::cuda;
namespace probe = forkguard::probe;

namespace {

void reply(const std::string& s) {
  std::fputs((s + "\n").c_str(), stdout);
  std::fflush(stdout);
}

std::string result(cuda::CUresult r) {
  return r == cuda::CUDA_SUCCESS ? "ok" : "error " + cuda::result_name(r);
}

}  // namespace

int main() {
  std::string cmd;
  cuda::CUcontext ctx = nullptr;
  while (std::getline(std::cin, cmd)) {
    try {
      if (cmd == "load") {
        cuda::Driver::load();
        reply("ok");
      } else if (cmd == "nvml") {
        const char* lib = std::getenv("FORKGUARD_NVML_LIBRARY");
        void* h = ::dlopen(lib != nullptr ? lib : "libnvidia-ml.so.1", RTLD_NOW);
        auto init = h != nullptr
                        ? reinterpret_cast<cuda::PFN_nvmlInit_v2>(::dlsym(h, "nvmlInit_v2"))
                        : nullptr;
        int r = init != nullptr ? init() : -1;
        reply(r == 0 ? "ok" : "error " + std::to_string(r));
      } else if (cmd == "init") {
        reply(result(cuda::Driver::load().api().cuInit(0)));
      } else if (cmd == "count") {
        int n = 0;
        auto r = cuda::Driver::load().api().cuDeviceGetCount(&n);
        reply(r == cuda::CUDA_SUCCESS ? "count " + std::to_string(n) : result(r));
      } else if (cmd == "ctx") {
        const auto& api = cuda::Driver::load().api();
        auto r = api.cuDevicePrimaryCtxRetain(&ctx, 0);
        if (r == cuda::CUDA_SUCCESS) r = api.cuCtxSetCurrent(ctx);
        reply(result(r));
      } else if (cmd == "release") {
        reply(result(cuda::Driver::load().api().cuDevicePrimaryCtxRelease_v2(0)));
      } else if (cmd == "probe") {
        auto s = probe::self();
        std::string kinds;
        for (const auto& e : s.evidence) {
          std::string k(probe::to_string(e.kind));
          if (kinds.find(k) == std::string::npos) kinds += (kinds.empty() ? "" : ",") + k;
        }
        reply("probe " + std::string(probe::to_string(s.verdict)) + " " +
              (kinds.empty() ? "-" : kinds));
      } else if (cmd == "fork") {
        std::fflush(stdout);
        pid_t child = ::fork();
        if (child == 0) {
          reply("child " + std::to_string(::getpid()));
          continue;
        }
        int status = 0;
        ::waitpid(child, &status, 0);
        reply("parent " + std::to_string(status));
      } else if (cmd == "pid") {
        reply("pid " + std::to_string(::getpid()));
      } else if (cmd == "exit") {
        return 0;
      } else {
        reply("unknown command " + cmd);
      }
    } catch (const forkguard::Error& e) {
      reply(std::string("exception ") + e.what());
    }
  }
  return 0;
}
