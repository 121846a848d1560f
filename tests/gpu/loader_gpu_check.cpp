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
    // asynchronous), behind a 64 MiB copy that keeps that stream busy, and released at once; the
    // loader's later copies into the same device buffer must wait for that work. Compared after
    // one synchronize at the end. Run once without the record too: how many batches then differ
    // says whether this check could tell (informational: it depends on timing).
    const size_t per_epoch = expected.size() / 2;
    const size_t big = size_t{64} << 20;
    std::vector<unsigned char> big_host(big);
    CUdeviceptr big_device = 0;
    drv.check(drv.api().cuMemAlloc_v2(&big_device, big), "cuMemAlloc_v2");
    drv.check(drv.api().cuMemHostRegister_v2(big_host.data(), big, 0), "cuMemHostRegister_v2");
    CUstream mine = nullptr;
    drv.check(drv.api().cuStreamCreate(&mine, kCuStreamNonBlocking), "cuStreamCreate");
    auto differing = [&](bool record) {
      std::vector<std::vector<unsigned char>> later(per_epoch,
                                                    std::vector<unsigned char>(expected[0].size()));
      for (auto& h : later) {
        drv.check(drv.api().cuMemHostRegister_v2(h.data(), h.size(), 0), "cuMemHostRegister_v2");
      }
      {
        fd::Loader again(ds, tf, o);
        size_t k = 0;
        while (auto b = again.next()) {
          b->synchronize();
          drv.check(drv.api().cuMemcpyDtoHAsync_v2(big_host.data(), big_device, big, mine),
                    "cuMemcpyDtoHAsync_v2");
          drv.check(drv.api().cuMemcpyDtoHAsync_v2(later[k].data(),
                                                   reinterpret_cast<CUdeviceptr>(b->images_data()),
                                                   b->images_bytes(), mine),
                    "cuMemcpyDtoHAsync_v2");
          if (record) b->record_stream(reinterpret_cast<uintptr_t>(mine));
          ++k;
        }
        drv.check(drv.api().cuStreamSynchronize(mine), "cuStreamSynchronize");
      }
      size_t bad = 0;
      for (size_t k = 0; k < per_epoch; ++k) {
        bad += later[k] != expected[k] ? 1 : 0;
        drv.check(drv.api().cuMemHostUnregister(later[k].data()), "cuMemHostUnregister");
      }
      return bad;
    };
    const size_t with = differing(true);
    const size_t without = differing(false);
    drv.api().cuStreamDestroy_v2(mine);
    drv.api().cuMemHostUnregister(big_host.data());
    drv.api().cuMemFree_v2(big_device);
    if (with != 0) {
      fmt::print(
          "loader-gpu FAIL record_stream: {} of {} batches read back on another stream "
          "differ\n",
          with, per_epoch);
      return 1;
    }
    fmt::print(
        "loader-gpu ok {} batches, {:.2f} GB/s to the device (copy-back included); "
        "record_stream ok ({} of {} batches differ without it)\n",
        n, static_cast<double>(bytes) / s / 1e9, without, per_epoch);
    return 0;
  } catch (const std::exception& e) {
    fmt::print("loader-gpu FAIL {}\n", e.what());
    return 1;
  }
}
