#include "forkguard/data/sampler.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <numeric>
#include <string>

#include "detail/decimal.hpp"
#include "forkguard/data/error.hpp"
#include "forkguard/data/rng.hpp"

namespace forkguard::data {
namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  const auto n = forkguard::detail::parse_decimal<int>(v);
  if (!n || *n < 0) throw DataError(fmt::format("{}={} is not a valid number", name, v));
  return *n;
}

std::vector<size_t> permutation(size_t size, uint64_t seed, uint64_t epoch) {
  std::vector<size_t> out(size);
  std::iota(out.begin(), out.end(), size_t{0});
  Rng rng(seed, epoch, 0, 0x5a3b1e);
  for (size_t i = size; i > 1; --i) {  // Fisher-Yates
    size_t j = static_cast<size_t>(rng.uniform_int(0, static_cast<int64_t>(i - 1)));
    std::swap(out[i - 1], out[j]);
  }
  return out;
}

}  // namespace

std::vector<size_t> SequentialSampler::indices(uint64_t) const {
  std::vector<size_t> out(size_);
  std::iota(out.begin(), out.end(), size_t{0});
  return out;
}

std::vector<size_t> RandomSampler::indices(uint64_t epoch) const {
  return permutation(size_, seed_, epoch);
}

DistributedSampler::DistributedSampler(size_t size, DistributedOptions o) : size_(size), o_(o) {
  if (o_.world_size < 0) o_.world_size = env_int("WORLD_SIZE", 1);
  if (o_.rank < 0) o_.rank = env_int("RANK", 0);
  if (o_.world_size < 1 || o_.rank >= o_.world_size) {
    throw DataError(fmt::format("distributed sampler: rank {} is not within world size {}", o_.rank,
                                o_.world_size));
  }
}

std::vector<size_t> DistributedSampler::indices(uint64_t epoch) const {
  std::vector<size_t> all;
  if (o_.shuffle) {
    all = permutation(size_, o_.seed, epoch);
  } else {
    all.resize(size_);
    std::iota(all.begin(), all.end(), size_t{0});
  }
  const size_t world = static_cast<size_t>(o_.world_size);
  size_t total;
  if (o_.drop_last) {
    total = (size_ / world) * world;
    all.resize(total);
  } else {
    total = (size_ + world - 1) / world * world;
    for (size_t i = 0; all.size() < total && size_ > 0; ++i) all.push_back(all[i % size_]);
  }
  std::vector<size_t> out;
  out.reserve(total / world);
  for (size_t i = static_cast<size_t>(o_.rank); i < all.size(); i += world) out.push_back(all[i]);
  return out;
}

std::vector<std::vector<size_t>> make_batches(const std::vector<size_t>& indices, size_t batch_size,
                                              bool drop_last) {
  if (batch_size == 0) throw DataError("batch size must be at least 1");
  std::vector<std::vector<size_t>> out;
  for (size_t i = 0; i < indices.size(); i += batch_size) {
    size_t end = std::min(indices.size(), i + batch_size);
    if (end - i < batch_size && drop_last) break;
    out.emplace_back(indices.begin() + static_cast<long>(i),
                     indices.begin() + static_cast<long>(end));
  }
  return out;
}

}  // namespace forkguard::data
