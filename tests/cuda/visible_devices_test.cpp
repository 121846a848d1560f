#include "forkguard/cuda/visible_devices.hpp"

#include <gtest/gtest.h>

namespace cuda = forkguard::cuda;

namespace {

std::vector<cuda::GpuInfo> gpus(int n) {
  std::vector<cuda::GpuInfo> out;
  for (int i = 0; i < n; ++i) {
    char uuid[64];
    std::snprintf(uuid, sizeof uuid, "GPU-%08x-1111-2222-3333-444444444444", 0xa0 + i);
    out.push_back({i, "GPU " + std::to_string(i), uuid, i});
  }
  return out;
}

std::vector<int> indices(const cuda::VisibleResolution& r) {
  std::vector<int> out;
  for (const auto& g : r.visible) out.push_back(g.index);
  return out;
}

cuda::VisibleResolution resolve(std::optional<std::string_view> v, int n) {
  return cuda::resolve_visible_devices(cuda::parse_visible_devices(v), gpus(n));
}

}  // namespace

TEST(VisibleDevices, UnsetShowsEveryGpu) {
  auto r = resolve(std::nullopt, 3);
  EXPECT_EQ(indices(r), (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(r.problems.empty());
}

TEST(VisibleDevices, EmptyHidesEveryGpuAndSaysSo) {
  auto r = resolve("", 2);
  EXPECT_TRUE(r.visible.empty());
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_NE(r.problems[0].find("CUDA sees no GPU"), std::string::npos);
}

TEST(VisibleDevices, IndicesKeepTheirOrder) {
  auto r = resolve("2, 0", 3);
  EXPECT_EQ(indices(r), (std::vector<int>{2, 0}));
  EXPECT_TRUE(r.problems.empty());
}

TEST(VisibleDevices, OutOfRangeHidesItAndEverythingAfter) {
  auto r = resolve("0,5,1", 2);
  EXPECT_EQ(indices(r), (std::vector<int>{0}));
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_NE(r.problems[0].find("\"5\" is out of range (2 GPUs present)"), std::string::npos)
      << r.problems[0];
  EXPECT_NE(r.problems[0].find("(5,1)"), std::string::npos) << r.problems[0];
}

TEST(VisibleDevices, InvalidEntryStopsParsing) {
  auto r = resolve("1,-1,0", 2);
  EXPECT_EQ(indices(r), (std::vector<int>{1}));
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_NE(r.problems[0].find("\"-1\" is not an index"), std::string::npos) << r.problems[0];
}

TEST(VisibleDevices, RepeatedGpuStopsParsing) {
  auto r = resolve("1,1", 2);
  EXPECT_EQ(indices(r), (std::vector<int>{1}));
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_NE(r.problems[0].find("repeats GPU 1"), std::string::npos);
}

TEST(VisibleDevices, UuidsAndUniquePrefixes) {
  auto r = resolve("GPU-000000a1-1111-2222-3333-444444444444,GPU-000000a0", 2);
  EXPECT_EQ(indices(r), (std::vector<int>{1, 0}));
  EXPECT_TRUE(r.problems.empty());
}

TEST(VisibleDevices, AmbiguousOrUnknownUuid) {
  auto ambiguous = resolve("GPU-000000a", 2);
  EXPECT_TRUE(ambiguous.visible.empty());
  ASSERT_EQ(ambiguous.problems.size(), 1u);
  EXPECT_NE(ambiguous.problems[0].find("ambiguous"), std::string::npos);
  auto unknown = resolve("GPU-deadbeef", 2);
  ASSERT_EQ(unknown.problems.size(), 1u);
  EXPECT_NE(unknown.problems[0].find("matches no GPU's UUID"), std::string::npos);
}

TEST(VisibleDevices, MigInstancesAreCounted) {
  auto vis = cuda::parse_visible_devices("MIG-4f1b6a7e-1111-2222-3333-444444444444");
  ASSERT_EQ(vis.selectors.size(), 1u);
  EXPECT_EQ(vis.selectors[0].kind, cuda::DeviceSelector::Kind::kMig);
  auto r = cuda::resolve_visible_devices(vis, gpus(1));
  EXPECT_TRUE(r.uses_mig);
  EXPECT_EQ(r.mig_instances, 1);
  EXPECT_TRUE(r.problems.empty());
}
