// forkguard::init(argc, argv): the first line of main() in a program that launches ranks.
//
//   int main(int argc, char** argv) {
//     forkguard::init(argc, argv);
//     ...
//   }
//
// 1. In a rank started by spawn (re-exec of /proc/self/exe) it runs the registered entry named in
//    FORKGUARD_ENTRY and exits with its return value: init() does not return there.
// 2. Otherwise it starts the fork server (a zygote forked now, while the process is still clean)
//    unless FORKGUARD_NO_FORK_SERVER is set or options say not to, and returns.
//
// Call it before creating threads and before anything touches CUDA. Thread-safety: call once,
// from the main thread.
#pragma once

namespace forkguard {

struct InitOptions {
  bool fork_server = true;  // start the zygote (kForkServer and kAuto use it)
};

void init(int argc, char** argv, const InitOptions& options = {});

}  // namespace forkguard
