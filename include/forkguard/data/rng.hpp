// Counter-based randomness for the data pipeline: every random decision is a pure function of
// (seed, epoch, sample index[, stream]), so the batches do not depend on which worker, thread or
// process made them, nor on the order in which they were made.
//
//   forkguard::data::Rng rng(seed, epoch, index);
//   if (rng.bernoulli(0.5)) flip(...);
//   double scale = rng.uniform(0.08, 1.0);
//
// The generator is xoshiro256** seeded through splitmix64 from the key. Thread-safety: an Rng is
// a value; give each sample its own.
#pragma once

#include <cstdint>

namespace forkguard::data {

// splitmix64's finalizer: a bijective 64-bit mix.
constexpr uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A 64-bit key for (seed, epoch, index, stream); distinct tuples give unrelated keys. With
// stream 0 it is a sample's seed: Rng(seed, epoch, index) here, and forkguard.DataLoader(seed=)'s
// per-sample seed in Python (forkguard._native.sample_key), so both draw from the same key.
constexpr uint64_t sample_key(uint64_t seed, uint64_t epoch, uint64_t index, uint64_t stream = 0) {
  return mix64(mix64(mix64(mix64(seed) ^ epoch) ^ index) ^ stream);
}

// The streams of sample_key that bad_sample="skip" draws substitutes from.
inline constexpr uint64_t kSubstituteStream = 1000;

// bad_sample="skip"'s choice: the attempt-th sample (attempt 0 first) that takes the place of the
// failed sample `index` in a dataset of `size` samples, a pure function of (seed, epoch, index,
// attempt), the same in the C++ loader and in forkguard.DataLoader (forkguard._native). Each
// attempt is a sample other than `index` (`index` itself only where size < 2: there is no other):
// the draws sample_key(seed, epoch, index, kSubstituteStream + k) % size, k = 0, 1, ..., with
// those equal to `index` passed over. That ends: sample_key is a bijection of its stream.
constexpr uint64_t substitute_index(uint64_t seed, uint64_t epoch, uint64_t index, uint64_t attempt,
                                    uint64_t size) {
  if (size < 2) return index;
  for (uint64_t stream = kSubstituteStream;; ++stream) {
    const uint64_t sub = sample_key(seed, epoch, index, stream) % size;
    if (sub != index && attempt-- == 0) return sub;
  }
}

class Rng {
 public:
  explicit Rng(uint64_t key) {
    uint64_t x = key;
    for (auto& s : s_) {
      x += 0x9e3779b97f4a7c15ull;
      s = mix64(x);
    }
  }
  Rng(uint64_t seed, uint64_t epoch, uint64_t index, uint64_t stream = 0)
      : Rng(sample_key(seed, epoch, index, stream)) {}

  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  // Uniform in [0, 1), 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // Uniform integer in [lo, hi] (inclusive), without modulo bias.
  int64_t uniform_int(int64_t lo, int64_t hi) {
    const uint64_t range = static_cast<uint64_t>(hi - lo) + 1;
    if (range == 0) return static_cast<int64_t>(next());  // the full 64-bit range
    const uint64_t limit = -range % range;                // 2^64 mod range
    uint64_t x;
    do {
      x = next();
    } while (x < limit);
    return lo + static_cast<int64_t>(x % range);
  }
  bool bernoulli(double p) { return uniform() < p; }

 private:
  static constexpr uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

}  // namespace forkguard::data
