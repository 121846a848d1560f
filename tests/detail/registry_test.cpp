// The one registry rule, for the registry template and for every registry built on it (dataset
// types, transform types, worker init hooks, entry functions; zygote functions are checked in
// tests/launch/zygote_protocol_test.cpp): the first of two registrations keeps the name, the
// second is refused with a line on stderr naming both places, and an unknown name's error lists
// the names registered and how to register one.
#include "detail/registry.hpp"

#include <fmt/format.h>

#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include "data/workers.hpp"
#include "forkguard/data/dataset.hpp"
#include "forkguard/data/error.hpp"
#include "forkguard/data/loader.hpp"
#include "forkguard/data/transform.hpp"
#include "forkguard/launch/entry.hpp"

namespace fdata = forkguard::data;
using forkguard::detail::Registry;

namespace {

std::string data_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const fdata::DataError& e) {
    return e.what();
  }
  return "no error";
}

int entry_one(const forkguard::launch::RankContext&) {
  return 1;
}
int entry_two(const forkguard::launch::RankContext&) {
  return 2;
}

}  // namespace

TEST(Registry, FirstRegistrationKeepsTheNameAndTheSecondIsRefusedNamingBothPlaces) {
  Registry<int> r("widget", "REGISTER_WIDGET");
  const int first_line = __LINE__ + 1;
  EXPECT_TRUE(r.add("a", 1));
  testing::internal::CaptureStderr();
  const int second_line = __LINE__ + 1;
  EXPECT_FALSE(r.add("a", 2));
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_EQ(r.find("a"), 1);
  EXPECT_NE(said.find("forkguard: widget \"a\" is registered twice"), std::string::npos) << said;
  EXPECT_NE(said.find(fmt::format("registry_test.cpp:{}", first_line)), std::string::npos) << said;
  EXPECT_NE(said.find(fmt::format("registry_test.cpp:{}", second_line)), std::string::npos) << said;
  EXPECT_NE(said.find("the first is kept"), std::string::npos) << said;
}

TEST(Registry, UnknownNamesListTheRegisteredOnesAndHowToRegister) {
  Registry<int> r("widget", "REGISTER_WIDGET");
  EXPECT_EQ(r.find("x"), std::nullopt);
  EXPECT_EQ(r.unknown("x"),
            "no widget named \"x\" (registered: none); register it with REGISTER_WIDGET");
  r.add("b", 2);
  r.add("a", 1);
  EXPECT_EQ(r.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(r.unknown("x"),
            "no widget named \"x\" (registered: a, b); register it with REGISTER_WIDGET");
}

TEST(Registry, DatasetTypesFollowTheRule) {
  testing::internal::CaptureStderr();
  EXPECT_FALSE(fdata::register_dataset(
      "synthetic", [](const nlohmann::json&) { return std::unique_ptr<fdata::Dataset>(); }));
  EXPECT_NE(
      testing::internal::GetCapturedStderr().find("dataset type \"synthetic\" is registered twice"),
      std::string::npos);
  // The built-in factory is still the one used.
  auto ds = fdata::make_dataset(
      {"synthetic", {{"size", 3}, {"sample_bytes", 4}, {"classes", 2}, {"seed", 1}}});
  ASSERT_TRUE(ds);
  EXPECT_EQ(ds->size(), 3u);
  const std::string e = data_error_of([] { fdata::make_dataset({"no_such", {}}); });
  EXPECT_NE(e.find("no dataset type named \"no_such\" (registered: "), std::string::npos) << e;
  EXPECT_NE(e.find("synthetic"), std::string::npos) << e;
  EXPECT_NE(e.find("); register it with FORKGUARD_REGISTER_DATASET"), std::string::npos) << e;
}

TEST(Registry, TransformTypesFollowTheRule) {
  testing::internal::CaptureStderr();
  EXPECT_FALSE(fdata::register_transform(
      "copy", [](const nlohmann::json&) { return std::unique_ptr<fdata::Transform>(); }));
  EXPECT_NE(
      testing::internal::GetCapturedStderr().find("transform type \"copy\" is registered twice"),
      std::string::npos);
  const std::string e = data_error_of([] { fdata::make_transform({"no_such", {}}); });
  EXPECT_NE(e.find("no transform type named \"no_such\" (registered: "), std::string::npos) << e;
  EXPECT_NE(e.find("copy"), std::string::npos) << e;
  EXPECT_NE(e.find("); register it with FORKGUARD_REGISTER_TRANSFORM"), std::string::npos) << e;
}

TEST(Registry, WorkerInitHooksFollowTheRule) {
  EXPECT_TRUE(fdata::register_worker_init("test_registry_hook", [](const fdata::WorkerInfo&) {}));
  testing::internal::CaptureStderr();
  EXPECT_FALSE(fdata::register_worker_init("test_registry_hook", [](const fdata::WorkerInfo&) {}));
  EXPECT_NE(testing::internal::GetCapturedStderr().find(
                "worker init hook \"test_registry_hook\" is registered twice"),
            std::string::npos);
  // An unknown hook is refused when the loader starts its workers.
  const std::string e = data_error_of([] { fdata::detail::find_worker_init("no_such_hook"); });
  EXPECT_NE(e.find("no worker init hook named \"no_such_hook\" (registered: "), std::string::npos)
      << e;
  EXPECT_NE(e.find("test_registry_hook"), std::string::npos) << e;
  EXPECT_NE(e.find("register it with forkguard::data::register_worker_init"), std::string::npos)
      << e;
}

TEST(Registry, EntryFunctionsFollowTheRule) {
  EXPECT_TRUE(forkguard::launch::register_entry("test_registry_entry", &entry_one));
  testing::internal::CaptureStderr();
  EXPECT_FALSE(forkguard::launch::register_entry("test_registry_entry", &entry_two));
  EXPECT_NE(testing::internal::GetCapturedStderr().find(
                "entry function \"test_registry_entry\" is registered twice"),
            std::string::npos);
  EXPECT_EQ(forkguard::launch::find_entry("test_registry_entry"), &entry_one);
  EXPECT_EQ(forkguard::launch::find_entry("no_such_entry"), nullptr);
}
