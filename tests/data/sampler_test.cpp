#include "forkguard/data/sampler.hpp"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "forkguard/data/error.hpp"

namespace fd = forkguard::data;

namespace {
std::vector<size_t> iota(size_t n) {
  std::vector<size_t> v(n);
  std::iota(v.begin(), v.end(), size_t{0});
  return v;
}
}  // namespace

TEST(Sampler, SequentialVisitsEveryIndexInOrder) {
  EXPECT_EQ(fd::SequentialSampler(5).indices(3), iota(5));
}

TEST(Sampler, RandomIsAPermutationReshuffledPerEpochAndReproducible) {
  fd::RandomSampler s(1000, 42);
  auto e0 = s.indices(0);
  auto e1 = s.indices(1);
  EXPECT_NE(e0, e1);
  EXPECT_NE(e0, iota(1000));
  EXPECT_EQ(e0, fd::RandomSampler(1000, 42).indices(0));
  EXPECT_NE(e0, fd::RandomSampler(1000, 43).indices(0));
  std::sort(e1.begin(), e1.end());
  EXPECT_EQ(e1, iota(1000));
}

TEST(Sampler, DistributedShardsCoverTheDatasetWithEqualCounts) {
  // torch's DistributedSampler: 10 samples on 4 ranks -> 3 each, padded from the start.
  std::multiset<size_t> all;
  for (int r = 0; r < 4; ++r) {
    fd::DistributedSampler s(10, {.rank = r, .world_size = 4, .shuffle = false});
    auto v = s.indices(0);
    EXPECT_EQ(v.size(), 3u);
    all.insert(v.begin(), v.end());
  }
  EXPECT_EQ(all.size(), 12u);
  for (size_t i = 0; i < 10; ++i) EXPECT_GE(all.count(i), 1u);
  EXPECT_EQ(fd::DistributedSampler(10, {.rank = 1, .world_size = 4, .shuffle = false}).indices(0),
            (std::vector<size_t>{1, 5, 9}));
  EXPECT_EQ(fd::DistributedSampler(10, {.rank = 3, .world_size = 4, .shuffle = false}).indices(0),
            (std::vector<size_t>{3, 7, 1}));  // padding repeats index 1
  // drop_last: 2 each, nothing repeated.
  std::set<size_t> dropped;
  for (int r = 0; r < 4; ++r) {
    auto v = fd::DistributedSampler(10, {.rank = r, .world_size = 4, .drop_last = true}).indices(2);
    EXPECT_EQ(v.size(), 2u);
    dropped.insert(v.begin(), v.end());
  }
  EXPECT_EQ(dropped.size(), 8u);
}

TEST(Sampler, DistributedShuffleIsTheSamePermutationOnEveryRank) {
  std::set<size_t> all;
  for (int r = 0; r < 3; ++r) {
    auto v = fd::DistributedSampler(99, {.rank = r, .world_size = 3, .seed = 7}).indices(5);
    all.insert(v.begin(), v.end());
  }
  EXPECT_EQ(all.size(), 99u);  // disjoint shards of one permutation
}

TEST(Sampler, DistributedTakesRankAndWorldSizeFromTheEnvironment) {
  ::setenv("RANK", "2", 1);
  ::setenv("WORLD_SIZE", "3", 1);
  fd::DistributedSampler s(9, {.shuffle = false});
  EXPECT_EQ(s.rank(), 2);
  EXPECT_EQ(s.world_size(), 3);
  EXPECT_EQ(s.indices(0), (std::vector<size_t>{2, 5, 8}));
  ::setenv("RANK", "3", 1);
  EXPECT_THROW(fd::DistributedSampler(9, {}), fd::DataError);
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
}

TEST(Sampler, BatchesWithAndWithoutDropLast) {
  auto b = fd::make_batches(iota(10), 4, false);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[2], (std::vector<size_t>{8, 9}));
  EXPECT_EQ(fd::make_batches(iota(10), 4, true).size(), 2u);
  EXPECT_THROW(fd::make_batches(iota(3), 0, false), fd::DataError);
}
