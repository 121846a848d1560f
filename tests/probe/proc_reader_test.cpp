// The /proc parsers on texts as the kernel writes them (tests/fuzz/proc_files_fuzz.cpp gives them
// any bytes).
#include "probe/proc_reader.hpp"

#include <gtest/gtest.h>

namespace fp = forkguard::probe::detail;
using Strings = std::vector<std::string>;

TEST(ProcReader, MapsListsMappedFilesOnce) {
  const std::string maps =
      "55d0c0a00000-55d0c0a28000 r--p 00000000 fe:01 1312                       /usr/bin/cat\n"
      "55d0c0a28000-55d0c0a30000 r-xp 00028000 fe:01 1312                       /usr/bin/cat\n"
      "7f2a1c000000-7f2a1c021000 rw-p 00000000 00:00 0 \n"
      "7ffd5e9e1000-7ffd5ea02000 rw-p 00000000 00:00 0                          [stack]\n"
      "7f2a1d000000-7f2a1d100000 r-xp 00000000 fe:01 99 /usr/lib/libcuda.so.1 (deleted)";
  EXPECT_EQ(fp::parse_maps(maps), (Strings{"/usr/bin/cat", "/usr/lib/libcuda.so.1"}));
  EXPECT_EQ(fp::parse_maps(""), Strings{});
}

TEST(ProcReader, StatParentAfterTheLastParenthesis) {
  EXPECT_EQ(fp::parse_stat_parent("4242 (python3 (x) y) S 4241 4242 4242 0 -1"), 4241);
  EXPECT_EQ(fp::parse_stat_parent("1 (init) S 0 1 1"), 0);
  EXPECT_FALSE(fp::parse_stat_parent("no parenthesis"));
  EXPECT_FALSE(fp::parse_stat_parent("1 (x) S"));
  EXPECT_FALSE(fp::parse_stat_parent("1 (x) S 12ab 1"));
}

TEST(ProcReader, EnvironSkipsEmptyStrings) {
  const std::string env("A=1\0\0B=2\0", 9);
  EXPECT_EQ(fp::parse_environ(env), (Strings{"A=1", "B=2"}));
  EXPECT_EQ(fp::strip_deleted("/dev/nvidiactl (deleted)"), "/dev/nvidiactl");
  EXPECT_EQ(fp::strip_deleted(" (deleted)"), " (deleted)");
}

TEST(ProcReader, ExecMappingsKeepRangesOfExecutableFiles) {
  const std::string maps =
      "7f2a1c000000-7f2a1c021000 r--p 00000000 fe:01 7 /usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0\n"
      "7f2a1c021000-7f2a1c040000 r-xp 00021000 fe:01 7 /usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0\n"
      "7f2a1d000000-7f2a1d100000 rwxp 00000000 00:00 0 \n"
      "7f2a1e000000-7f2a1e100000 r-xp 00000000 fe:01 99 /tmp/libx.so (deleted)\n"
      "ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]\n"
      "zz-1 r-xp 00000000 fe:01 9 /bad/range.so";
  auto exec = fp::parse_exec_mappings(maps);
  ASSERT_EQ(exec.size(), 2u);
  EXPECT_EQ(exec[0].start, 0x7f2a1c021000u);
  EXPECT_EQ(exec[0].end, 0x7f2a1c040000u);
  EXPECT_EQ(exec[0].path, "/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0");
  EXPECT_EQ(exec[1].path, "/tmp/libx.so");
}

// As the kernel writes /proc/PID/task/TID/syscall (proc_pid_syscall): the PC is the last field.
TEST(ProcReader, SyscallGivesRunningOrThePc) {
  auto blocked =
      fp::parse_syscall("202 0x7f2a1c0a1f40 0x80 0x0 0x0 0x0 0x0 0x7f2a1b7fdd90 0x7f2a1c02a1b9\n");
  ASSERT_TRUE(blocked);
  EXPECT_FALSE(blocked->running);
  EXPECT_EQ(blocked->nr, 202);
  EXPECT_EQ(blocked->pc, 0x7f2a1c02a1b9u);
  auto outside = fp::parse_syscall("-1 0x7ffd5e9e1000 0x55d0c0a28abc\n");
  ASSERT_TRUE(outside);
  EXPECT_EQ(outside->nr, -1);
  EXPECT_EQ(outside->pc, 0x55d0c0a28abcu);
  auto running = fp::parse_syscall("running\n");
  ASSERT_TRUE(running);
  EXPECT_TRUE(running->running);
  for (const char* bad : {"", "running now", "202 0x1 0x2", "-1 0x1 0x2 0x3", "x 0x1 0x2",
                          "-1 0x1 zz", "-1  0x1 0x2", "-1 1 2"}) {
    EXPECT_FALSE(fp::parse_syscall(bad)) << bad;
  }
}
