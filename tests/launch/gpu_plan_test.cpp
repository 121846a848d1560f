#include "forkguard/launch/gpu_plan.hpp"

#include <gtest/gtest.h>

namespace fl = forkguard::launch;
namespace cuda = forkguard::cuda;

namespace {
cuda::GpuInventory two_gpus() {
  cuda::GpuInventory inv;
  inv.source = "nvml (test)";
  inv.gpus = {{0, "A", "GPU-aaaa", 0}, {1, "B", "GPU-bbbb", 1}};
  return inv;
}
}  // namespace

TEST(GpuPlan, BindGivesEachRankOneGpu) {
  auto plan =
      fl::plan_gpus({.bind = true}, 2, two_gpus(), cuda::parse_visible_devices(std::nullopt));
  EXPECT_EQ(plan.visible, 2);
  EXPECT_EQ(plan.rank_visible_devices[0], "0");
  EXPECT_EQ(plan.rank_visible_devices[1], "1");
}

TEST(GpuPlan, BindKeepsTheUsersIdentifiers) {
  auto plan =
      fl::plan_gpus({.bind = true}, 2, two_gpus(), cuda::parse_visible_devices("GPU-bbbb,0"));
  EXPECT_EQ(plan.rank_visible_devices[0], "GPU-bbbb");
  EXPECT_EQ(plan.rank_visible_devices[1], "0");
}

TEST(GpuPlan, MoreRanksThanGpusIsAnErrorNamingBothNumbersAndTheVariable) {
  try {
    fl::plan_gpus({.bind = true}, 4, two_gpus(), cuda::parse_visible_devices("1,0"));
    FAIL();
  } catch (const fl::GpuPlanError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("with 4 ranks per node needs 4 GPUs, but only 2 are visible"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("CUDA_VISIBLE_DEVICES=\"1,0\""), std::string::npos) << what;
    EXPECT_NE(what.find("gpus.allow_sharing"), std::string::npos) << what;
  }
}

TEST(GpuPlan, SharingIsRoundRobin) {
  auto plan = fl::plan_gpus({.bind = true, .allow_sharing = true}, 3, two_gpus(),
                            cuda::parse_visible_devices(std::nullopt));
  EXPECT_EQ(plan.rank_visible_devices[2], "0");
}

TEST(GpuPlan, WithoutBindNothingIsAssigned) {
  auto plan = fl::plan_gpus({}, 8, two_gpus(), cuda::parse_visible_devices(std::nullopt));
  for (const auto& v : plan.rank_visible_devices) EXPECT_FALSE(v.has_value());
}

TEST(GpuPlan, CountFollowsCudaVisibleDevices) {
  EXPECT_EQ(fl::count_visible_gpus(two_gpus(), cuda::parse_visible_devices("1")), 1);
  EXPECT_EQ(fl::count_visible_gpus(two_gpus(), cuda::parse_visible_devices("")), 0);
  EXPECT_EQ(fl::count_visible_gpus(two_gpus(), cuda::parse_visible_devices(std::nullopt)), 2);
}
