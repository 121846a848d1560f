#include "forkguard/data/rng.hpp"

#include <gtest/gtest.h>

#include <cmath>

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
