// Test support: a fixture for multi-process tests that checks what each must leave behind: no
// child (or zombie) of this process, and exactly the fds it had when the test began.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <vector>

#include "process.hpp"

namespace forkguard::testing {

class NothingLeft : public ::testing::Test {
 protected:
  void SetUp() override { fds_ = open_fds(); }
  void TearDown() override {
    EXPECT_EQ(children_of(::getpid()), std::vector<pid_t>{});
    EXPECT_EQ(open_fds(), fds_);
  }
  std::vector<int> fds_;
};

}  // namespace forkguard::testing
