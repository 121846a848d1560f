// Slurm's host list forms (as `scontrol show hostnames` expands them) and the bad ones.
#include "forkguard/launch/hostlist.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace fl = forkguard::launch;
using Hosts = std::vector<std::string>;

namespace {

Hosts expand(const char* list) {
  return fl::HostList::parse(list, "SLURM_JOB_NODELIST").expand();
}

std::string error_of(const std::string& list) {
  try {
    fl::HostList::parse(list, "SLURM_JOB_NODELIST");
  } catch (const fl::HostListError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(HostList, PlainNamesAndCommas) {
  EXPECT_EQ(expand("node1"), Hosts{"node1"});
  EXPECT_EQ(expand("a,b,c"), (Hosts{"a", "b", "c"}));
  EXPECT_EQ(expand("host-1.example.org,host2"), (Hosts{"host-1.example.org", "host2"}));
}

TEST(HostList, RangesAndSingleNumbersInOneBracket) {
  EXPECT_EQ(expand("n[1-3]"), (Hosts{"n1", "n2", "n3"}));
  EXPECT_EQ(expand("n[1-3,7]"), (Hosts{"n1", "n2", "n3", "n7"}));
  EXPECT_EQ(expand("n[5]"), Hosts{"n5"});
  EXPECT_EQ(expand("n[1,3,5-6]"), (Hosts{"n1", "n3", "n5", "n6"}));
}

TEST(HostList, ZeroPaddingFollowsTheLowerBound) {
  EXPECT_EQ(expand("n[01-03]"), (Hosts{"n01", "n02", "n03"}));
  EXPECT_EQ(expand("n[08-11]"), (Hosts{"n08", "n09", "n10", "n11"}));
  EXPECT_EQ(expand("n[098-101]"), (Hosts{"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(expand("n[9-11]"), (Hosts{"n9", "n10", "n11"}));
  EXPECT_EQ(expand("n[0-1]"), (Hosts{"n0", "n1"}));
}

TEST(HostList, SeveralPrefixesTextAfterBracketsAndSeveralBrackets) {
  EXPECT_EQ(expand("n[01-02,07],gpu-a[1-2]"), (Hosts{"n01", "n02", "n07", "gpu-a1", "gpu-a2"}));
  EXPECT_EQ(expand("n[1-2]-ib"), (Hosts{"n1-ib", "n2-ib"}));
  EXPECT_EQ(expand("rack[1-2]-n[01-02]"),
            (Hosts{"rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"}));
  EXPECT_EQ(expand("[1-2]x"), (Hosts{"1x", "2x"}));
  EXPECT_EQ(expand("a,b[1-2],c"), (Hosts{"a", "b1", "b2", "c"}));
}

TEST(HostList, FirstHostWithoutExpandingAndCount) {
  auto hl = fl::HostList::parse("gpu[0001-9999],cpu[1-50000]", "SLURM_JOB_NODELIST");
  EXPECT_EQ(hl.size(), 59999u);
  EXPECT_EQ(hl.first(), "gpu0001");
  EXPECT_EQ(fl::HostList::parse("r[3-4]n[7-8]").first(), "r3n7");
}

TEST(HostList, BadListsNameTheVariableAndThePlace) {
  EXPECT_EQ(error_of("n[1-"),
            "SLURM_JOB_NODELIST=\"n[1-\": expected a number in brackets, "
            "found the end (at character 5)");
  EXPECT_EQ(error_of("n[3-1]"),
            "SLURM_JOB_NODELIST=\"n[3-1]\": range 3-1 goes down (at character 3)");
  EXPECT_EQ(error_of("n[1-100000000]"),
            "SLURM_JOB_NODELIST=\"n[1-100000000]\": range 1-100000000 names 100000000 hosts, more "
            "than 65536 (at character 3)");
  EXPECT_EQ(error_of("n[1-2"), "SLURM_JOB_NODELIST=\"n[1-2\": '[' is not closed (at character 2)");
  EXPECT_EQ(error_of("n1]"), "SLURM_JOB_NODELIST=\"n1]\": ']' without a '[' (at character 3)");
  EXPECT_EQ(error_of("n[a-b]"),
            "SLURM_JOB_NODELIST=\"n[a-b]\": expected a number in brackets, found 'a' (at "
            "character 3)");
  EXPECT_EQ(
      error_of("n[]"),
      "SLURM_JOB_NODELIST=\"n[]\": expected a number in brackets, found ']' (at character 3)");
  EXPECT_EQ(error_of("n[1[2]]"),
            "SLURM_JOB_NODELIST=\"n[1[2]]\": expected ',', '-' or ']' in brackets, found '[' (at "
            "character 4)");
  EXPECT_EQ(error_of(""), "SLURM_JOB_NODELIST=\"\": names no host");
  EXPECT_EQ(error_of(" , "), "SLURM_JOB_NODELIST=\" , \": names no host");
  EXPECT_NE(error_of("n[1-99999999999999999999]").find("too many digits"), std::string::npos);
}

TEST(HostList, TheWholeListIsBoundedNotOnlyEachRange) {
  // Each range alone is allowed; together, or multiplied by a second bracket, they are not.
  EXPECT_NE(error_of("a[1-40000],b[1-40000]").find("names more than 65536 hosts"),
            std::string::npos);
  EXPECT_NE(error_of("r[1-1000]n[1-1000]").find("names more than 65536 hosts"), std::string::npos);
  EXPECT_EQ(fl::HostList::parse("a[1-65536]").size(), 65536u);
  EXPECT_NE(error_of("a[1-65536],b").find("names more than 65536 hosts"), std::string::npos);
}
