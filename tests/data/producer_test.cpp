// The producer's writes into a slot: a slot's first task writes its images through the memfd, so
// the worker that fills it maps none of those pages (the cost of a loader's first batch), and the
// bytes are the same whichever way they went.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "data/producer.hpp"
#include "data/slot.hpp"
#include "data/test_pipeline.hpp"
#include "process.hpp"

namespace fd = forkguard::data;
namespace fdd = forkguard::data::detail;

namespace {

constexpr size_t kBatch = 16;
constexpr size_t kSampleBytes = 64 * 1024;

// The resident (mapped in this process) bytes of the mapping that starts at `p`.
size_t mapped_bytes(const void* p) {
  char start[32];
  std::snprintf(start, sizeof start, "%lx-", reinterpret_cast<unsigned long>(p));
  return forkguard::testing::mapped_bytes(::getpid(), start);
}

struct Fixture {
  fd::SyntheticDataset dataset{{.size = 100, .sample_bytes = kSampleBytes, .seed = 7}};
  forkguard::testing::NoiseTransform transform{{.bytes = kSampleBytes}};
  fdd::ProducerConfig config{.seed = 3, .layout = fdd::SlotLayout::make(kBatch, kSampleBytes, 64)};
  fdd::Producer producer{dataset, transform, config};
  std::vector<size_t> indices = [] {
    std::vector<size_t> v(kBatch);
    std::iota(v.begin(), v.end(), size_t{40});
    return v;
  }();

  // Images, labels and keys: everything a batch delivers.
  std::vector<std::byte> batch_bytes(const fdd::Mapping& m) const {
    return {m.data(), m.data() + config.layout.claim_offset};
  }

  // The bytes of a slot filled through its mapping.
  std::vector<std::byte> reference() const {
    fdd::Mapping m = fdd::create_shared(config.layout.total, "producer-test");
    auto r = producer.run(1, indices, m.data(), {});
    EXPECT_EQ(r.kind, fdd::TaskResult::Kind::kOk) << r.message;
    return batch_bytes(m);
  }
};

TEST(Producer, AFreshSlotsImagesAreWrittenWithoutBeingMappedHere) {
  Fixture f;
  fdd::Mapping m = fdd::create_shared(f.config.layout.total, "producer-test");
  auto r = f.producer.run(1, f.indices, m.data(), {.fresh_fd = m.fd()});
  ASSERT_EQ(r.kind, fdd::TaskResult::Kind::kOk) << r.message;
  // Only the labels' and keys' pages are mapped: 16 images of 64 KiB are not.
  EXPECT_LE(mapped_bytes(m.data()), f.config.layout.total - f.config.layout.labels_offset);
  EXPECT_TRUE(f.batch_bytes(m) == f.reference());
}

TEST(Producer, AFreshSlotSharedByTwoThreadsHoldsEverySampleOnce) {
  Fixture f;
  fdd::Mapping m = fdd::create_shared(f.config.layout.total, "producer-test");
  fdd::TaskResult a, b;
  std::thread other(
      [&] { b = f.producer.run(1, f.indices, m.data(), {.shared = true, .fresh_fd = m.fd()}); });
  a = f.producer.run(1, f.indices, m.data(), {.shared = true, .fresh_fd = m.fd()});
  other.join();
  ASSERT_EQ(a.kind, fdd::TaskResult::Kind::kOk) << a.message;
  ASSERT_EQ(b.kind, fdd::TaskResult::Kind::kOk) << b.message;
  EXPECT_TRUE(f.batch_bytes(m) == f.reference());
}

TEST(Producer, AFreshSlotThatRefusesWritesIsFilledThroughItsMapping) {
  Fixture f;
  // A sealed memfd: write() fails with EPERM, the existing mapping still takes stores.
  int fd = ::memfd_create("producer-test-sealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(f.config.layout.total)), 0);
  fdd::Mapping m(fd, f.config.layout.total);
  ASSERT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE), 0) << std::strerror(errno);
  ASSERT_LT(::pwrite(fd, "x", 1, 0), 0);
  auto r = f.producer.run(1, f.indices, m.data(), {.fresh_fd = fd});
  ASSERT_EQ(r.kind, fdd::TaskResult::Kind::kOk) << r.message;
  EXPECT_TRUE(f.batch_bytes(m) == f.reference());
}

TEST(Producer, AFileSizeLimitBelowTheSlotKeepsWritesInTheMapping) {
  // Under `ulimit -f` a write() past the limit raises SIGXFSZ (a core dump by default): a worker
  // under a small limit must fill its slots through the mapping instead.
  Fixture f;
  const auto want = f.reference();
  fdd::Mapping m = fdd::create_shared(f.config.layout.total, "producer-test");
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    rlimit small{4096, 4096};
    if (::setrlimit(RLIMIT_FSIZE, &small) != 0) ::_exit(10);
    auto r = f.producer.run(1, f.indices, m.data(), {.fresh_fd = m.fd()});
    ::_exit(r.kind == fdd::TaskResult::Kind::kOk ? 0 : 11);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed by signal " << WTERMSIG(status);
  ASSERT_EQ(WEXITSTATUS(status), 0);
  EXPECT_TRUE(f.batch_bytes(m) == want);
}

}  // namespace
