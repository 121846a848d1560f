#include "forkguard/data/rng.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace fd = forkguard::data;

TEST(Rng, PureFunctionOfSeedEpochAndIndex) {
  fd::Rng a(1, 2, 3), b(1, 2, 3);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(a.next(), b.next());
  EXPECT_NE(fd::Rng(1, 2, 3).next(), fd::Rng(1, 2, 4).next());
  EXPECT_NE(fd::Rng(1, 2, 3).next(), fd::Rng(1, 3, 3).next());
  EXPECT_NE(fd::Rng(1, 2, 3).next(), fd::Rng(2, 2, 3).next());
}

TEST(Rng, UniformAndIntegersStayInRangeWithTheRightMean) {
  fd::Rng r(9, 0, 0);
  double sum = 0;
  int heads = 0;
  for (int i = 0; i < 100000; ++i) {
    double u = r.uniform();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    int64_t k = r.uniform_int(-3, 3);
    ASSERT_GE(k, -3);
    ASSERT_LE(k, 3);
    heads += r.bernoulli(0.25) ? 1 : 0;
  }
  EXPECT_NEAR(sum / 100000, 0.5, 0.01);
  EXPECT_NEAR(heads / 100000.0, 0.25, 0.01);
}

// The Python side pins the same literals (tests/python/test_dataloader.py,
// test_seed_and_substitutes_are_the_cpp_loaders): changing these changes every seeded run's
// random numbers and substitutes, in C++ and in forkguard.DataLoader alike.
TEST(Rng, SampleKeyIsPinned) {
  EXPECT_EQ(fd::sample_key(0, 0, 0), 0x2130748aaac80268ull);
  EXPECT_EQ(fd::sample_key(1, 2, 3), 0x12588d809dce88a7ull);
  EXPECT_EQ(fd::sample_key(1234, 5, 17), 0xa8d5176972f214d3ull);
  EXPECT_EQ(fd::sample_key(~0ull, 7, 1ull << 40), 0xe254a2f289f68412ull);
  EXPECT_EQ(fd::Rng(1, 2, 3).next(), fd::Rng(fd::sample_key(1, 2, 3)).next());
}

TEST(Rng, SubstitutesArePinnedAndNeverTheFailedSample) {
  // seed 3, epoch 0, sample 13 of 40: the sixth draw (stream 1005) is 13 itself, passed over
  std::vector<uint64_t> got;
  for (uint64_t attempt = 0; attempt < 6; ++attempt) {
    got.push_back(fd::substitute_index(3, 0, 13, attempt, 40));
  }
  EXPECT_EQ(got, (std::vector<uint64_t>{32, 27, 21, 18, 4, 33}));
  EXPECT_EQ(fd::sample_key(3, 0, 13, fd::kSubstituteStream + 5) % 40, 13u);
  for (uint64_t size : {2u, 3u, 10u, 1000u}) {
    for (uint64_t index = 0; index < std::min<uint64_t>(size, 20); ++index) {
      for (uint64_t attempt = 0; attempt < 20; ++attempt) {
        const uint64_t sub = fd::substitute_index(9, 1, index, attempt, size);
        ASSERT_LT(sub, size);
        ASSERT_NE(sub, index) << size << " " << attempt;
      }
    }
  }
  // no other sample: the failed one (the loader then gives up at once)
  EXPECT_EQ(fd::substitute_index(3, 0, 0, 0, 1), 0u);
  EXPECT_EQ(fd::substitute_index(3, 0, 5, 2, 0), 5u);
  static_assert(fd::substitute_index(3, 0, 13, 5, 40) == 33);
}
