#include "forkguard/launch/exit_status.hpp"

#include <gtest/gtest.h>
#include <signal.h>

namespace fl = forkguard::launch;

TEST(ExitStatus, PrintsItself) {
  EXPECT_EQ(fl::ExitStatus::exited(3).to_string(), "exited with code 3");
  EXPECT_EQ(fl::ExitStatus::signaled(SIGKILL).to_string(), "killed by signal 9 (SIGKILL)");
  EXPECT_EQ(fl::ExitStatus::signaled(SIGSEGV, true).to_string(),
            "killed by signal 11 (SIGSEGV) (core dumped)");
}

TEST(ExitStatus, ShellCodes) {
  EXPECT_EQ(fl::ExitStatus::exited(0).shell_code(), 0);
  EXPECT_EQ(fl::ExitStatus::exited(7).shell_code(), 7);
  EXPECT_EQ(fl::ExitStatus::signaled(SIGTERM).shell_code(), 143);
  EXPECT_TRUE(fl::ExitStatus::exited(0).success());
  EXPECT_FALSE(fl::ExitStatus::signaled(SIGTERM).success());
}

TEST(ExitStatus, FromWaitStatus) {
  EXPECT_EQ(fl::ExitStatus::from_wait_status(3 << 8).code, 3);
  auto s = fl::ExitStatus::from_wait_status(SIGSEGV | 0x80);
  EXPECT_EQ(s.signal, SIGSEGV);
  EXPECT_TRUE(s.core_dumped);
}
