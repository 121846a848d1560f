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
