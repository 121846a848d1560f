#include "forkguard/launch/exit_status.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

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

TEST(ExitStatus, WaitStatusIsTheExactInverse) {
  // The fork server reports the wait status of each child it reaps through its Child handle:
  // every exit code, every signal, with and without a core dump, maps back unchanged.
  for (int code = 0; code <= 255; ++code) {
    const int w = fl::ExitStatus::exited(code).wait_status();
    EXPECT_TRUE(WIFEXITED(w));
    EXPECT_EQ(WEXITSTATUS(w), code);
    EXPECT_EQ(fl::ExitStatus::from_wait_status(w).code, code);
  }
  for (int sig = 1; sig < SIGRTMAX; ++sig) {
    if (sig == SIGSTOP || sig == SIGCONT) continue;  // never an exit
    for (bool core : {false, true}) {
      const int w = fl::ExitStatus::signaled(sig, core).wait_status();
      ASSERT_TRUE(WIFSIGNALED(w)) << sig;
      EXPECT_EQ(WTERMSIG(w), sig);
      EXPECT_EQ(static_cast<bool>(WCOREDUMP(w)), core);
      const auto back = fl::ExitStatus::from_wait_status(w);
      EXPECT_EQ(back.signal, sig);
      EXPECT_EQ(back.core_dumped, core);
    }
  }
  EXPECT_EQ(fl::ExitStatus::from_wait_status(fl::ExitStatus{}.wait_status()).kind,
            fl::ExitStatus::Kind::kNotStarted);
}
