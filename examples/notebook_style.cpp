// The notebook-launcher failure, and its cure, in C++.
//
//   notebook_style [--parent-touches-cuda] [--nproc N] [--start-method spawn|forkserver|fork|auto]
//
// With --parent-touches-cuda the parent initializes CUDA first (as a notebook cell that checks the
// GPU does), then launches N ranks of a registered function; each rank initializes CUDA, creates
// a context and prints "rank R: cuda ok". Spawn and the fork server succeed; plain fork is refused
// with the evidence instead of N ranks dying with CUDA_ERROR_NOT_INITIALIZED.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "forkguard/cuda/driver.hpp"
#include "forkguard/init.hpp"
#include "forkguard/launch/entry.hpp"
#include "forkguard/launch/launcher.hpp"

namespace cuda = forkguard::cuda;
namespace fl = forkguard::launch;

FORKGUARD_ENTRY(train) {
  try {
    const auto& drv = cuda::Driver::load();
    const auto& api = drv.api();
    drv.check(api.cuInit(0), "cuInit");
    int count = 0;
    drv.check(api.cuDeviceGetCount(&count), "cuDeviceGetCount");
    cuda::CUcontext context = nullptr;
    drv.check(api.cuDevicePrimaryCtxRetain(&context, 0), "cuDevicePrimaryCtxRetain");
    drv.check(api.cuCtxSetCurrent(context), "cuCtxSetCurrent");
    fmt::print("rank {}: cuda ok ({} device{} visible)\n", ctx.rank, count, count == 1 ? "" : "s");
    drv.check(api.cuDevicePrimaryCtxRelease_v2(0), "cuDevicePrimaryCtxRelease");
    return 0;
  } catch (const forkguard::Error& e) {
    fmt::print(stderr, "rank {}: {}\n", ctx.rank, e.what());
    return 1;
  }
}

int main(int argc, char** argv) {
  forkguard::init(argc, argv);  // spawned ranks run `train` here; the fork server starts now
  CLI::App app{"notebook_style: launch ranks after the parent touched CUDA"};
  bool touch = false;
  int nproc = 2;
  std::string method = "auto";
  app.add_flag("--parent-touches-cuda", touch, "Initialize CUDA in the parent before launching");
  app.add_option("--nproc", nproc, "Ranks to launch")->check(CLI::Range(1, 256));
  app.add_option("--start-method", method, "spawn, forkserver, fork or auto");
  CLI11_PARSE(app, argc, argv);
  auto start = fl::parse_start_method(method);
  if (!start) {
    fmt::print(stderr, "notebook_style: unknown start method {}\n", method);
    return 2;
  }
  try {
    if (touch) {
      const auto& drv = cuda::Driver::load();
      drv.check(drv.api().cuInit(0), "cuInit");
      fmt::print("parent: CUDA initialized (as a notebook cell checking the GPU would)\n");
    }
    auto result = fl::launch({.nproc = nproc, .start = *start}, "train", {});
    fmt::print("parent: {} ranks by {}: {}", nproc, fl::to_string(result.method), result.report());
    return 0;
  } catch (const fl::DirtyForkError& e) {
    fmt::print(stderr, "parent: {}\n", e.what());
    return 3;
  } catch (const fl::RankFailedError& e) {
    fmt::print(stderr, "parent: {}", e.what());
    return e.result().exit_code();
  } catch (const forkguard::Error& e) {
    fmt::print(stderr, "parent: {}\n", e.what());
    return 1;
  }
}
