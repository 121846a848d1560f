// Samplers: which dataset indices an epoch visits, in which order; and their batching.
//
//   forkguard::data::RandomSampler s(dataset.size(), /*seed=*/7);
//   auto order = s.indices(epoch);                         // a permutation, new each epoch
//   auto batches = forkguard::data::make_batches(order, 64, /*drop_last=*/true);
//
// indices() is a pure function of the sampler's parameters and the epoch. Thread-safety: const
// methods may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace forkguard::data {

class Sampler {
 public:
  virtual ~Sampler() = default;
  virtual std::vector<size_t> indices(uint64_t epoch) const = 0;
};

// 0, 1, ..., size-1.
class SequentialSampler : public Sampler {
 public:
  explicit SequentialSampler(size_t size) : size_(size) {}
  std::vector<size_t> indices(uint64_t epoch) const override;

 private:
  size_t size_;
};

// A permutation of 0..size-1 drawn from (seed, epoch): reshuffled every epoch.
class RandomSampler : public Sampler {
 public:
  RandomSampler(size_t size, uint64_t seed) : size_(size), seed_(seed) {}
  std::vector<size_t> indices(uint64_t epoch) const override;

 private:
  size_t size_;
  uint64_t seed_;
};

// torch.utils.data.DistributedSampler's contract: the (optionally shuffled) indices are padded
// by repeating from the start to a multiple of world_size (or, with drop_last, the tail is
// dropped), and rank r takes every world_size-th index starting at r. Every rank gets the same
// count, and the ranks together cover the dataset.
struct DistributedOptions {
  int rank = -1;           // -1: RANK from the environment (0 when unset)
  int world_size = -1;     // -1: WORLD_SIZE from the environment (1 when unset)
  bool shuffle = true;     // permute with (seed, epoch) before sharding
  uint64_t seed = 0;       // the same on every rank
  bool drop_last = false;  // drop the tail instead of padding
};

class DistributedSampler : public Sampler {
 public:
  DistributedSampler(size_t size, DistributedOptions options);
  std::vector<size_t> indices(uint64_t epoch) const override;
  int rank() const { return o_.rank; }
  int world_size() const { return o_.world_size; }

 private:
  size_t size_;
  DistributedOptions o_;
};

// Consecutive groups of batch_size; the last one is shorter unless drop_last drops it.
std::vector<std::vector<size_t>> make_batches(const std::vector<size_t>& indices, size_t batch_size,
                                              bool drop_last);

}  // namespace forkguard::data
