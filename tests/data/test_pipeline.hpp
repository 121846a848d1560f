// Datasets, transforms and hooks the loader tests register (as a user would), so that
// fork-server workers can rebuild them.
#pragma once

#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

#include "forkguard/cuda/api.hpp"
#include "forkguard/data/loader.hpp"

namespace forkguard::testing {

namespace fd = forkguard::data;

// Synthetic samples; the indices in `bad` fail to read ("corrupt record").
class FlakyDataset : public fd::Dataset {
 public:
  FlakyDataset(fd::SyntheticOptions o, std::set<size_t> bad) : inner_(o), o_(o), bad_(bad) {}
  size_t size() const override { return inner_.size(); }
  fd::Sample read(size_t i) const override {
    if (bad_.count(i) != 0) throw std::runtime_error("corrupt record");
    return inner_.read(i);
  }
  std::string key(size_t i) const override { return inner_.key(i); }
  std::optional<fd::Description> describe() const override {
    return fd::Description{"test_flaky",
                           {{"size", o_.size},
                            {"sample_bytes", o_.sample_bytes},
                            {"seed", o_.seed},
                            {"bad", std::vector<size_t>(bad_.begin(), bad_.end())}}};
  }

 private:
  fd::SyntheticDataset inner_;
  fd::SyntheticOptions o_;
  std::set<size_t> bad_;
};

struct NoiseOptions {
  size_t bytes = 0;      // per sample (input and output)
  int sleep_ms = 0;      // per sample: a slow transform
  long cuda_at = -1;     // at this sample index, dlopen `driver` and cuInit
  std::string driver{};  // the test driver's path
  long slow_at = -1;     // this sample index sleeps slow_ms more
  int slow_ms = 0;
  bool slow_once = false;  // only the first time (per transform object)
  std::string trace{};     // a file each sample appends "<key> <thread id>" to: who filled it
};

// Random per (seed, epoch, index): XORs the bytes with the sample's random stream and reverses
// them with probability 1/2 (a "flip").
class NoiseTransform : public fd::Transform {
 public:
  explicit NoiseTransform(NoiseOptions o) : o_(std::move(o)) {}
  std::string name() const override { return "noise"; }
  fd::OutputSpec output() const override {
    return {{static_cast<int64_t>(o_.bytes)}, fd::DType::kUInt8, fd::Layout::kAny};
  }
  void apply(const fd::Sample& in, std::span<std::byte> out, fd::Rng& rng) const override {
    if (o_.sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o_.sleep_ms));
    if (o_.slow_at >= 0 &&
        in.key == fd::SyntheticDataset({}).key(static_cast<size_t>(o_.slow_at)) &&
        !(o_.slow_once && slept_.exchange(true))) {
      std::this_thread::sleep_for(std::chrono::milliseconds(o_.slow_ms));
    }
    if (!o_.trace.empty()) {  // one O_APPEND write per line: lines never interleave
      std::string line = in.key + " " + std::to_string(::gettid()) + "\n";
      int fd = ::open(o_.trace.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
      if (fd < 0 || ::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
        throw std::runtime_error("cannot write the trace " + o_.trace);
      }
      ::close(fd);
    }
    if (o_.cuda_at >= 0 &&
        in.key == fd::SyntheticDataset({}).key(static_cast<size_t>(o_.cuda_at))) {
      void* h = ::dlopen(o_.driver.c_str(), RTLD_NOW | RTLD_GLOBAL);
      if (h == nullptr) throw std::runtime_error(::dlerror());
      auto init = reinterpret_cast<forkguard::cuda::PFN_cuInit>(::dlsym(h, "cuInit"));
      if (init(0) != forkguard::cuda::CUDA_SUCCESS) throw std::runtime_error("cuInit failed");
    }
    if (in.data.size() != out.size()) throw std::runtime_error("wrong size");
    for (size_t i = 0; i < out.size(); i += 8) {
      uint64_t r = rng.next();
      for (size_t k = 0; k < 8 && i + k < out.size(); ++k) {
        out[i + k] =
            static_cast<std::byte>(in.data[i + k] ^ static_cast<unsigned char>(r >> (8 * k)));
      }
    }
    if (rng.bernoulli(0.5)) std::reverse(out.begin(), out.end());
  }
  std::optional<fd::Description> describe() const override {
    return fd::Description{"test_noise",
                           {{"bytes", o_.bytes},
                            {"sleep_ms", o_.sleep_ms},
                            {"cuda_at", o_.cuda_at},
                            {"driver", o_.driver},
                            {"slow_at", o_.slow_at},
                            {"slow_ms", o_.slow_ms},
                            {"slow_once", o_.slow_once},
                            {"trace", o_.trace}}};
  }

 private:
  NoiseOptions o_;
  mutable std::atomic<bool> slept_{false};
};

}  // namespace forkguard::testing
