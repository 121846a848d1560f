// One training rank's input pipeline: an ImageFolder decoded and augmented by CUDA-clean process
// workers (from this rank's fork server), batches handed to the GPU in this process, or kept on
// the host where there is no GPU. Meant to run as N ranks under `forkguard run`:
//
//   forkguard run --nproc-per-node 2 -- loader_ranks --data DIR [--epochs 2] [--workers 2]
//
// Each rank reads its shard of every epoch (RANK/WORLD_SIZE, as torch's DistributedSampler), draws
// a progress bar (redrawn in place on a terminal, a line per quarter otherwise) and ends with its
// throughput. The GPU path initializes CUDA here before the workers start: they come from the
// fork server, so they stay clean.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdlib>

#include "forkguard/cuda/driver.hpp"
#include "forkguard/data/image_folder.hpp"
#include "forkguard/data/image_transform.hpp"
#include "forkguard/data/loader.hpp"
#include "forkguard/init.hpp"

namespace fd = forkguard::data;
namespace cuda = forkguard::cuda;
using Clock = std::chrono::steady_clock;

namespace {

// Whether a GPU is there for this rank: the driver loads and reports a device. Initializes CUDA
// (this process is the one that feeds the GPU).
bool have_gpu() {
  try {
    const auto& drv = cuda::Driver::load();
    if (drv.api().cuInit(0) != cuda::CUDA_SUCCESS) return false;
    int count = 0;
    return drv.api().cuDeviceGetCount(&count) == cuda::CUDA_SUCCESS && count > 0;
  } catch (const forkguard::Error&) {
    return false;
  }
}

std::string bar(double fraction, int width = 30) {
  const int full = static_cast<int>(fraction * width + 0.5);
  std::string s;
  for (int i = 0; i < width; ++i) s += i < full ? "#" : ".";
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  forkguard::init(argc, argv);  // the fork server starts here, while this rank is clean
  CLI::App app{"One rank's image pipeline (run it under forkguard run)"};
  std::string data;
  int epochs = 2;
  size_t workers = 2, batch_size = 64;
  bool host_only = false;
  app.add_option("--data", data, "an ImageFolder directory")->required();
  app.add_option("--epochs", epochs, "passes over this rank's shard");
  app.add_option("--workers", workers, "process workers");
  app.add_option("--batch-size", batch_size, "samples per batch");
  app.add_flag("--host", host_only, "keep batches on the host even when a GPU is there");
  CLI11_PARSE(app, argc, argv);
  const char* rank_env = std::getenv("RANK");
  const int rank = rank_env != nullptr ? std::atoi(rank_env) : 0;
  try {
    const bool gpu = !host_only && have_gpu();
    auto dataset = std::make_shared<fd::ImageFolder>(data);
    auto transform = std::make_shared<fd::ImageTransform>(fd::ImageOptions{.train = true});
    const auto t0 = Clock::now();
    fd::Loader loader(dataset, transform,
                      {.batch_size = batch_size,
                       .workers = workers,
                       .worker_kind = fd::WorkerKind::kProcess,
                       .seed = 2026,
                       .shuffle = true,
                       .distributed = true,
                       .device = {.enabled = gpu}});
    const bool tty = ::isatty(STDOUT_FILENO) != 0;
    const size_t total = loader.size() * static_cast<size_t>(epochs);
    size_t done = 0, images = 0, quarter = 0;
    double first_batch = 0;
    for (int e = 0; e < epochs; ++e) {
      while (auto batch = loader.next()) {
        if (images == 0) first_batch = std::chrono::duration<double>(Clock::now() - t0).count();
        images += batch->size();
        ++done;
        const double f = static_cast<double>(done) / static_cast<double>(total);
        const double s = std::chrono::duration<double>(Clock::now() - t0).count();
        const auto line = fmt::format("epoch {}/{} [{}] {:3.0f}% {:6.0f} img/s", e + 1, epochs,
                                      bar(f), 100 * f, static_cast<double>(images) / s);
        if (tty) {
          fmt::print("\r{}", line);
        } else if (static_cast<size_t>(f * 4) > quarter) {
          quarter = static_cast<size_t>(f * 4);
          fmt::print("{}\n", line);
        }
        std::fflush(stdout);
      }
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    const auto stats = loader.stats();
    fmt::print(
        "{}rank {}: {} images in {:.2f} s = {:.0f} images/s to the {}, first batch {:.0f} ms, "
        "{} process workers, {} skipped\n",
        tty ? "\n" : "", rank, images, seconds, static_cast<double>(images) / seconds,
        gpu ? "GPU" : (host_only ? "host (--host)" : "host (no GPU here)"), first_batch * 1e3,
        workers, stats.skipped);
    return 0;
  } catch (const forkguard::Error& e) {
    fmt::print(stderr, "rank {}: {}\n", rank, e.what());
    return 1;
  }
}
