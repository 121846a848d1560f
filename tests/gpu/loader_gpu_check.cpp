// GPU check of the loader's hand-off (tests/gpu/run.sh runs it): this process initializes CUDA
// first, then process workers (from the fork server) fill the slots and the loader copies each
// batch to the GPU. Every device batch is copied back and compared with the same batch made on
// the host. Prints "loader-gpu ok BATCHES batches, X GB/s to the device" or "loader-gpu FAIL ...".
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "forkguard/cuda/driver.hpp"
#include "forkguard/data/loader.hpp"
#include "forkguard/init.hpp"

namespace fd = forkguard::data;
using namespace forkguard::cuda;  // NOLINT: the driver's C names

int main(int argc, char** argv) {
  forkguard::init(argc, argv);
  try {
    const auto& drv = Driver::load();
    drv.check(drv.api().cuInit(0), "cuInit");  // the parent touches CUDA before any worker
    CUdevice dev;
    drv.check(drv.api().cuDeviceGet(&dev, 0), "cuDeviceGet");
    CUcontext ctx;
    drv.check(drv.api().cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    drv.check(drv.api().cuCtxSetCurrent(ctx), "cuCtxSetCurrent");

    auto ds = std::make_shared<fd::SyntheticDataset>(
        fd::SyntheticOptions{.size = 512, .sample_bytes = 3 * 64 * 64, .seed = 3});
    auto tf = std::make_shared<fd::CopyTransform>(fd::OutputSpec{{3, 64, 64}});
    fd::LoaderOptions o{.batch_size = 32,
                        .workers = 2,
                        .worker_kind = fd::WorkerKind::kProcess,
                        .seed = 1,
                        .shuffle = true};
    std::vector<std::vector<unsigned char>> expected;
    {
      fd::Loader host(ds, tf, o);
      for (int e = 0; e < 2; ++e) {
        while (auto b = host.next()) {
          auto* p = static_cast<const unsigned char*>(b->images_data());
          expected.emplace_back(p, p + b->images_bytes());
        }
      }
    }
    o.device.enabled = true;
    fd::Loader loader(ds, tf, o);
    size_t n = 0, bytes = 0;
    std::vector<unsigned char> back;
    const auto t0 = std::chrono::steady_clock::now();
    for (int e = 0; e < 2; ++e) {
      while (auto b = loader.next()) {
        b->synchronize();
        back.resize(b->images_bytes());
        drv.check(drv.api().cuMemcpyDtoH_v2(
                      back.data(), reinterpret_cast<CUdeviceptr>(b->images_data()), back.size()),
                  "cuMemcpyDtoH_v2");
        if (n >= expected.size() || back != expected[n]) {
          fmt::print("loader-gpu FAIL batch {} of epoch {}: device bytes differ from the host's\n",
                     b->number(), e);
          return 1;
        }
        bytes += back.size();
        ++n;
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (n != expected.size()) {
      fmt::print("loader-gpu FAIL {} device batches, {} expected\n", n, expected.size());
      return 1;
    }
    // record_stream: each batch is copied back on a stream of ours (into pinned memory: truly
    // asynchronous) and released at once; the loader's later copies into the same device buffer
    // must wait for those copies. Compared after one synchronize at the end.
    const size_t per_epoch = expected.size() / 2;
    std::vector<std::vector<unsigned char>> later(per_epoch,
                                                  std::vector<unsigned char>(expected[0].size()));
    for (auto& h : later) {
      drv.check(drv.api().cuMemHostRegister_v2(h.data(), h.size(), 0), "cuMemHostRegister_v2");
    }
    CUstream mine = nullptr;
    drv.check(drv.api().cuStreamCreate(&mine, kCuStreamNonBlocking), "cuStreamCreate");
    {
      fd::Loader again(ds, tf, o);
      size_t k = 0;
      while (auto b = again.next()) {
        if (k >= per_epoch) break;
        b->synchronize();
        drv.check(drv.api().cuMemcpyDtoHAsync_v2(later[k].data(),
                                                 reinterpret_cast<CUdeviceptr>(b->images_data()),
                                                 b->images_bytes(), mine),
                  "cuMemcpyDtoHAsync_v2");
        b->record_stream(reinterpret_cast<uintptr_t>(mine));
        ++k;
      }
      drv.check(drv.api().cuStreamSynchronize(mine), "cuStreamSynchronize");
    }
    for (size_t k = 0; k < per_epoch; ++k) {
      if (later[k] != expected[k]) {
        fmt::print("loader-gpu FAIL record_stream: batch {} read back on another stream differs\n",
                   k);
        return 1;
      }
      drv.check(drv.api().cuMemHostUnregister(later[k].data()), "cuMemHostUnregister");
    }
    drv.api().cuStreamDestroy_v2(mine);
    fmt::print(
        "loader-gpu ok {} batches, {:.2f} GB/s to the device (copy-back included); "
        "record_stream ok\n",
        n, static_cast<double>(bytes) / s / 1e9);
    return 0;
  } catch (const std::exception& e) {
    fmt::print("loader-gpu FAIL {}\n", e.what());
    return 1;
  }
}
