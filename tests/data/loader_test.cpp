// The loader core, end to end: real threads, real processes (from the fork server and by guarded
// fork), real memfd slots, the test driver for the GPU hand-off. Its own main() calls
// forkguard::init(), as a user's program does, so the fork server exists.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "data/test_images.hpp"
#include "data/test_pipeline.hpp"
#include "detail/fnv.hpp"
#include "forkguard/cuda/driver.hpp"
#include "forkguard/data/image_folder.hpp"
#include "forkguard/data/rng.hpp"
#include "forkguard/init.hpp"
#include "launch/fork_server.hpp"
#include "paths.hpp"
#include "process.hpp"

namespace fd = forkguard::data;
namespace ft = forkguard::testing;
using forkguard::testing::FlakyDataset;
using forkguard::testing::NoiseOptions;
using forkguard::testing::NoiseTransform;
using Clock = std::chrono::steady_clock;

FORKGUARD_REGISTER_DATASET(test_flaky, [](const nlohmann::json& p) {
  auto bad = p.at("bad").get<std::vector<size_t>>();
  return std::make_unique<FlakyDataset>(
      fd::SyntheticOptions{
          .size = p.at("size"), .sample_bytes = p.at("sample_bytes"), .seed = p.at("seed")},
      std::set<size_t>(bad.begin(), bad.end()));
});
FORKGUARD_REGISTER_TRANSFORM(test_noise, [](const nlohmann::json& p) {
  return std::make_unique<NoiseTransform>(NoiseOptions{
      p.at("bytes"), p.at("sleep_ms"), p.at("cuda_at"), p.at("driver").get<std::string>(),
      p.at("slow_at"), p.at("slow_ms"), p.at("slow_once"), p.at("trace").get<std::string>()});
});

namespace {

constexpr size_t kBytes = 3 * 16 * 16;

std::shared_ptr<fd::Dataset> dataset(size_t n = 200, std::set<size_t> bad = {}) {
  return std::make_shared<FlakyDataset>(
      fd::SyntheticOptions{.size = n, .sample_bytes = kBytes, .seed = 11}, std::move(bad));
}

std::shared_ptr<fd::Transform> noise(NoiseOptions o = {}) {
  o.bytes = kBytes;
  return std::make_shared<NoiseTransform>(o);
}

using forkguard::detail::fnv1a;

uint64_t hash_batch(const fd::Batch& b) {
  uint64_t h = fnv1a(b.images_data(), b.images_bytes());
  h = fnv1a(b.labels(), b.size() * sizeof(int64_t), h);
  for (size_t i = 0; i < b.size(); ++i) {
    auto k = b.key(i);
    h = fnv1a(k.data(), k.size(), h);
  }
  return fnv1a(b.indices().data(), b.indices().size() * sizeof(size_t), h);
}

// The hash of every batch of `epochs` epochs, in delivery order.
std::vector<uint64_t> hashes(const fd::LoaderOptions& o, int epochs,
                             std::shared_ptr<fd::Dataset> ds = dataset()) {
  fd::Loader loader(ds, noise(), o);
  std::vector<uint64_t> out;
  for (int e = 0; e < epochs; ++e) {
    while (auto b = loader.next()) out.push_back(hash_batch(*b));
  }
  return out;
}

std::string maps_with(const std::string& needle) {
  std::ifstream in("/proc/self/maps");
  std::string line, found;
  while (std::getline(in, line)) {
    if (line.find(needle) != std::string::npos) found += line + "\n";
  }
  return found;
}

pid_t zygote() {
  return forkguard::launch::detail::ForkServer::get()->pid();
}

// This process initializes CUDA (the test driver) and makes a context current.
const forkguard::cuda::Driver& init_cuda_here() {
  ::setenv("FORKGUARD_CUDA_DRIVER", ft::kFakeCuda.c_str(), 1);
  const auto& d = forkguard::cuda::Driver::load();
  d.check(d.api().cuInit(0), "cuInit");
  forkguard::cuda::CUdevice dev;
  d.check(d.api().cuDeviceGet(&dev, 0), "cuDeviceGet");
  forkguard::cuda::CUcontext ctx;
  d.check(d.api().cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  d.check(d.api().cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  return d;
}

// Nothing left behind: the fds and mappings of before, no worker processes.
void expect_clean(const std::vector<int>& fds_before) {
  EXPECT_EQ(ft::open_fds(), fds_before);
  EXPECT_EQ(maps_with("forkguard-batch"), "");
  EXPECT_TRUE(ft::children_of(zygote()).empty());
  for (pid_t c : ft::children_of(::getpid())) {
    EXPECT_EQ(c, zygote()) << "a child other than the fork server is left: " << c;
  }
}

struct Kind {
  size_t workers;
  fd::WorkerKind kind;
  fd::ProcessStart start;
  const char* name;
};

const Kind kKinds[] = {
    {0, fd::WorkerKind::kThread, fd::ProcessStart::kAuto, "inline"},
    {1, fd::WorkerKind::kThread, fd::ProcessStart::kAuto, "1 thread"},
    {2, fd::WorkerKind::kThread, fd::ProcessStart::kAuto, "2 threads"},
    {3, fd::WorkerKind::kThread, fd::ProcessStart::kAuto, "3 threads"},
    {1, fd::WorkerKind::kProcess, fd::ProcessStart::kForkServer, "1 fork-server process"},
    {2, fd::WorkerKind::kProcess, fd::ProcessStart::kForkServer, "2 fork-server processes"},
    {2, fd::WorkerKind::kProcess, fd::ProcessStart::kFork, "2 forked processes"},
};

fd::LoaderOptions with(const Kind& k, fd::LoaderOptions o) {
  o.workers = k.workers;
  o.worker_kind = k.kind;
  o.process_start = k.start;
  return o;
}

}  // namespace

TEST(Loader, SameBatchesForEveryWorkerCountAndKind) {
  const fd::LoaderOptions base{.batch_size = 16, .seed = 5, .shuffle = true};
  const auto reference = hashes(with(kKinds[0], base), 3);
  ASSERT_EQ(reference.size(), 3u * 13u);  // 200 samples: 12 full batches and one of 8
  // Shuffled per epoch, and the noise depends on the epoch: no two epochs are alike.
  EXPECT_NE(std::vector<uint64_t>(reference.begin(), reference.begin() + 13),
            std::vector<uint64_t>(reference.begin() + 13, reference.begin() + 26));
  for (const auto& k : kKinds) {
    EXPECT_EQ(hashes(with(k, base), 3), reference) << k.name;
  }
  // Another seed, other batches.
  auto other = base;
  other.seed = 6;
  EXPECT_NE(hashes(with(kKinds[2], other), 1),
            std::vector<uint64_t>(reference.begin(), reference.begin() + 13));
}

TEST(Loader, EpochsCanBeReplayedWithSetEpoch) {
  fd::Loader loader(dataset(), noise(),
                    {.batch_size = 32, .workers = 2, .seed = 1, .shuffle = true});
  std::vector<uint64_t> first, again;
  while (auto b = loader.next()) first.push_back(hash_batch(*b));
  EXPECT_EQ(loader.epoch(), 1u);
  loader.set_epoch(0);
  while (auto b = loader.next()) again.push_back(hash_batch(*b));
  EXPECT_EQ(first, again);
}

TEST(Loader, AsReadyDeliversEveryBatchOnce) {
  for (size_t workers : {0, 3}) {
    fd::Loader loader(
        dataset(), noise(),
        {.batch_size = 8, .workers = workers, .delivery = fd::Delivery::kAsReady, .seed = 2});
    std::set<size_t> seen;
    std::set<size_t> samples;
    while (auto b = loader.next()) {
      EXPECT_TRUE(seen.insert(b->number()).second) << "batch " << b->number() << " twice";
      samples.insert(b->indices().begin(), b->indices().end());
    }
    EXPECT_EQ(seen.size(), loader.size()) << workers << " workers";
    EXPECT_EQ(samples.size(), 200u) << workers << " workers";
  }
}

TEST(Loader, WorkerKilledBetweenEpochsNeverHangsTheNextOnes) {
  fd::Loader loader(dataset(64), noise(),
                    {.batch_size = 8,
                     .workers = 2,
                     .worker_kind = fd::WorkerKind::kProcess,
                     .timeout = std::chrono::seconds(10)});
  while (loader.next()) {
  }
  auto pids = loader.worker_pids();
  ASSERT_EQ(pids.size(), 2u);
  ASSERT_EQ(::kill(pids[1], SIGKILL), 0);
  // The death surfaces in this epoch (as a WorkerError) or, if it is noticed only after the
  // worker's batches, the epoch completes; either way the epochs after it run in full.
  try {
    while (loader.next()) {
    }
  } catch (const fd::WorkerError& e) {
    EXPECT_NE(std::string(e.what()).find("SIGKILL"), std::string::npos) << e.what();
  }
  for (int e = 0; e < 2; ++e) {
    size_t n = 0;
    while (loader.next()) ++n;
    EXPECT_EQ(n, loader.size());
  }
}

TEST(Loader, DropLastAndBatchShape) {
  fd::Loader loader(dataset(), noise(), {.batch_size = 64, .drop_last = true});
  EXPECT_EQ(loader.size(), 3u);
  size_t n = 0;
  while (auto b = loader.next()) {
    EXPECT_EQ(b->size(), 64u);
    EXPECT_EQ(b->placement(), fd::Placement::kHost);
    EXPECT_EQ(b->labels()[0], static_cast<int64_t>(b->indices()[0] % 10));
    EXPECT_EQ(b->key(1), fmt::format("synthetic/{:08}", b->indices()[1]));
    ++n;
  }
  EXPECT_EQ(n, 3u);
}

// A dead zygote failed every later process loader with "Broken pipe" and stayed a zombie.
TEST(Loader, ADeadForkServerIsReapedAndReplaced) {
  const fd::LoaderOptions o = with(kKinds[5], {.batch_size = 16, .seed = 5, .shuffle = true});
  const auto reference = hashes(with(kKinds[0], o), 1);
  const pid_t old = zygote();
  ASSERT_EQ(::kill(old, SIGKILL), 0);
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(old), &info, WEXITED | WNOWAIT | __WALL),
            0);  // dead now
  ::testing::internal::CaptureStderr();
  const auto after = hashes(o, 1);
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(after, reference);
  EXPECT_NE(zygote(), old);
  EXPECT_EQ(::waitpid(old, nullptr, WNOHANG | __WALL), -1) << "the dead zygote is reaped";
  EXPECT_EQ(errno, ECHILD);
  EXPECT_NE(said.find(fmt::format("forkguard: the fork server (PID {}) died (killed by signal 9 "
                                  "(SIGKILL)); started a new one (PID {})",
                                  old, zygote())),
            std::string::npos)
      << said;
  EXPECT_EQ(hashes(o, 1), reference) << "the new one serves the loaders after it";
}

// A negative count converted to size_t (2^64-1) was cast to int -1 and accepted.
TEST(Loader, AbsurdWorkerCountsAreRefusedByName) {
  for (size_t workers : {fd::kMaxWorkers + 1, static_cast<size_t>(-1)}) {
    EXPECT_EQ(ft::data_error_of([&] { fd::Loader(dataset(), noise(), {.workers = workers}); }),
              fmt::format("Loader: workers must be at most 1024, not {}", workers));
  }
}

TEST(Loader, BadSampleErrorNamesIndexAndKeyAndTheEpochGoesOn) {
  for (const auto& k : {kKinds[0], kKinds[2], kKinds[5]}) {
    fd::Loader loader(dataset(40, {13}), noise(), with(k, {.batch_size = 10}));
    std::vector<size_t> got;
    bool raised = false;
    while (true) {
      try {
        auto b = loader.next();
        if (!b) break;
        got.push_back(b->number());
      } catch (const fd::DataError& e) {
        raised = true;
        EXPECT_EQ(e.index(), 13u) << k.name;
        EXPECT_EQ(e.key(), "synthetic/00000013");
        EXPECT_NE(std::string(e.what()).find("batch 1 of epoch 0: sample 13 (synthetic/00000013): "
                                             "corrupt record"),
                  std::string::npos)
            << e.what();
      }
    }
    EXPECT_TRUE(raised) << k.name;
    EXPECT_EQ(got, (std::vector<size_t>{0, 2, 3})) << k.name;
  }
}

TEST(Loader, SkipSubstitutesDeterministicallyRecordsAndLogsOnce) {
  std::vector<uint64_t> reference;
  for (const auto& k : kKinds) {
    std::vector<std::string> log;
    auto o = with(k, {.batch_size = 10, .bad_sample = fd::BadSample::kSkip, .seed = 3});
    o.log = [&](const std::string& m) { log.push_back(m); };
    fd::Loader loader(dataset(40, {13, 27}), noise(), o);
    std::vector<uint64_t> h;
    size_t skipped_seen = 0;
    for (int e = 0; e < 2; ++e) {
      while (auto b = loader.next()) {
        h.push_back(hash_batch(*b));
        for (const auto& s : b->skipped()) {
          ++skipped_seen;
          EXPECT_TRUE(s.index == 13 || s.index == 27);
          EXPECT_EQ(s.reason, "corrupt record");
          EXPECT_EQ(b->indices()[s.position], s.index);  // the batch says which index it was
          EXPECT_EQ(b->key(s.position), fmt::format("synthetic/{:08}", s.substitute));
          EXPECT_NE(s.substitute, s.index);
          // the first substitute_index() that is not a bad sample itself
          uint64_t attempt = 0, first = 0;
          do {
            first = fd::substitute_index(3, b->epoch(), s.index, attempt++, 40);
          } while (first == 13 || first == 27);
          EXPECT_EQ(s.substitute, first);
        }
      }
    }
    EXPECT_EQ(skipped_seen, 4u) << k.name;
    EXPECT_EQ(loader.stats().skipped, 4u) << k.name;
    EXPECT_EQ(log.size(), 2u) << k.name;  // once per skipped index
    if (!log.empty()) {
      EXPECT_NE(log[0].find("skipped sample 13"), std::string::npos) << log[0];
    }
    if (reference.empty()) reference = h;
    EXPECT_EQ(h, reference) << k.name;
  }
}

// The epoch's first batch is filled by every worker, in parts: a bad sample in each part is
// reported as the earliest one, skip records come in position order, and the bytes do not change
// when the first batch is not split.
TEST(Loader, FirstBatchSplitOverWorkersReportsTheEarliestBadSampleAndKeepsTheBytes) {
  for (const auto& k : {kKinds[2], kKinds[3], kKinds[5], kKinds[6]}) {
    for (bool split : {true, false}) {
      // Batch 0 holds samples 0-15 (sequential): 3 in the first part, 12 in the last.
      auto o = with(k, {.batch_size = 16, .split_first_batch = split});
      fd::Loader loader(dataset(48, {3, 12}), noise(), o);
      try {
        loader.next();
        ADD_FAILURE() << k.name << ": batch 0 has bad samples";
      } catch (const fd::DataError& e) {
        EXPECT_EQ(e.index(), 3u) << k.name << " split " << split;
      }
      EXPECT_EQ(loader.next()->number(), 1u);
    }
    std::vector<std::vector<std::pair<size_t, size_t>>> skips;
    std::vector<uint64_t> hashes;
    for (bool split : {true, false}) {
      auto o = with(
          k, {.batch_size = 16, .split_first_batch = split, .bad_sample = fd::BadSample::kSkip});
      o.log = [](const std::string&) {};
      fd::Loader loader(dataset(48, {12, 3}), noise(), o);
      auto b = loader.next();
      ASSERT_TRUE(b);
      std::vector<std::pair<size_t, size_t>> got;
      for (const auto& sk : b->skipped()) got.emplace_back(sk.position, sk.index);
      skips.push_back(got);
      hashes.push_back(hash_batch(*b));
    }
    EXPECT_EQ(skips[0], (std::vector<std::pair<size_t, size_t>>{{3, 3}, {12, 12}})) << k.name;
    EXPECT_EQ(skips[0], skips[1]) << k.name;
    EXPECT_EQ(hashes[0], hashes[1]) << k.name;
  }
}

// The first batch's workers claim its samples one at a time: one slow sample holds up only the
// worker that took it, the others take the rest (fixed halves would leave half the batch behind
// the slow sample).
TEST(Loader, FirstBatchWorkersTakeTheSamplesASlowOneLeaves) {
  for (const auto& k : {kKinds[2], kKinds[5], kKinds[6]}) {
    const std::string trace = ::testing::TempDir() + "/first-batch-trace";
    std::remove(trace.c_str());
    NoiseOptions n{.slow_at = 0, .slow_ms = 600, .trace = trace};
    n.bytes = kBytes;
    fd::Loader loader(dataset(128), std::make_shared<NoiseTransform>(n),
                      with(k, {.batch_size = 64}));
    auto b = loader.next();
    ASSERT_TRUE(b);
    ASSERT_EQ(b->number(), 0u);
    std::set<std::string> first;
    for (size_t i = 0; i < b->size(); ++i) first.insert(std::string(b->key(i)));
    std::map<std::string, std::string> who;  // key -> thread, for the first batch's samples
    std::ifstream in(trace);
    for (std::string key, tid; in >> key >> tid;) {
      if (first.count(key) != 0) {
        EXPECT_TRUE(who.emplace(key, tid).second) << key << " twice";
      }
    }
    ASSERT_EQ(who.size(), 64u) << k.name;
    std::map<std::string, int> count;
    for (const auto& [key, tid] : who) ++count[tid];
    ASSERT_EQ(count.size(), 2u) << k.name;
    const std::string slow = who.at(std::string(b->key(0)));
    EXPECT_LT(count[slow], 16) << k.name << ": the worker with the slow sample filled "
                               << count[slow] << " of 64";
    std::remove(trace.c_str());
  }
}

// A batch of 40 000 samples: its indices travel in the slot (a task message, bounded by the
// socket's buffer, would hold about 26 000), and the bytes are the same for every worker kind.
TEST(Loader, ProcessWorkersTakeBatchesOfAnySize) {
  const size_t n = 40000;
  auto ds = std::make_shared<FlakyDataset>(
      fd::SyntheticOptions{.size = n, .sample_bytes = 8, .seed = 3}, std::set<size_t>{});
  NoiseOptions o;
  o.bytes = 8;
  std::vector<uint64_t> hashes;
  for (const auto& k : {kKinds[2], kKinds[5], kKinds[6]}) {
    fd::Loader loader(ds, std::make_shared<NoiseTransform>(o),
                      with(k, {.batch_size = n, .seed = 4, .shuffle = true, .key_bytes = 32}));
    auto b = loader.next();
    ASSERT_TRUE(b) << k.name;
    EXPECT_EQ(b->size(), n) << k.name;
    hashes.push_back(hash_batch(*b));
  }
  EXPECT_EQ(hashes[0], hashes[1]);
  EXPECT_EQ(hashes[0], hashes[2]);
}

TEST(Loader, ProcessWorkersFillFreshSlotsWithoutMappingTheirImages) {
  // A fresh slot's pages cost a process worker about 3 us each to fault in on a VM (9400 for a
  // float32 batch of 64): its first fill goes through the memfd, so the worker maps only the
  // labels' and keys' pages. Held batches are never reused, so every slot so far is fresh.
  constexpr size_t kBig = 64 * 1024;
  auto ds = std::make_shared<FlakyDataset>(
      fd::SyntheticOptions{.size = 256, .sample_bytes = kBig, .seed = 3}, std::set<size_t>{});
  NoiseOptions o;
  o.bytes = kBig;
  for (const auto& k : {kKinds[5], kKinds[6]}) {
    fd::Loader loader(ds, std::make_shared<NoiseTransform>(o),
                      with(k, {.batch_size = 16, .prefetch = 2, .seed = 4}));
    std::vector<fd::Batch> held;
    for (int i = 0; i < 4; ++i) {
      auto b = loader.next();
      ASSERT_TRUE(b) << k.name;
      held.push_back(std::move(*b));
    }
    auto pids = loader.worker_pids();
    ASSERT_EQ(pids.size(), 2u) << k.name;
    for (pid_t pid : pids) {
      // Each holds 16 images of 64 KiB per slot it filled; mapped, that would be 1 MiB a slot.
      EXPECT_LT(ft::mapped_bytes(pid, "forkguard-batch"), 256u * 1024)
          << k.name << ", worker PID " << pid;
    }
    for (size_t i = 0; i < held.size(); ++i) {
      EXPECT_EQ(held[i].size(), 16u);
    }
  }
}

TEST(Loader, DlpackTensorsShareTheSlotAndKeepItAlive) {
  fd::Loader loader(dataset(64), noise(), {.batch_size = 16, .workers = 1, .prefetch = 1});
  std::vector<DLManagedTensor*> held;
  std::vector<uint64_t> at_delivery;
  while (auto b = loader.next()) {
    DLManagedTensor* t = b->images_dlpack();
    EXPECT_EQ(t->dl_tensor.data, b->images_data());  // no copy
    EXPECT_EQ(t->dl_tensor.ndim, 2);
    EXPECT_EQ(t->dl_tensor.shape[0], 16);
    EXPECT_EQ(t->dl_tensor.shape[1], static_cast<int64_t>(kBytes));
    EXPECT_EQ(t->dl_tensor.dtype.code, kDLUInt);
    EXPECT_EQ(t->dl_tensor.device.device_type, kDLCPU);
    DLManagedTensor* labels = b->labels_dlpack();
    EXPECT_EQ(static_cast<const int64_t*>(labels->dl_tensor.data)[3], b->labels()[3]);
    labels->deleter(labels);
    held.push_back(t);
    at_delivery.push_back(fnv1a(b->images_data(), b->images_bytes()));
  }
  // Every tensor still holds its own batch: held slots are never handed to a worker again.
  ASSERT_EQ(held.size(), 4u);
  for (size_t i = 0; i < held.size(); ++i) {
    EXPECT_EQ(fnv1a(held[i]->dl_tensor.data, 16 * kBytes), at_delivery[i]);
  }
  const size_t slots = loader.stats().slots;
  EXPECT_GE(slots, 4u);
  for (auto* t : held) t->deleter(t);
  // Released: the next epoch runs in the slots there are.
  while (auto b = loader.next()) {
  }
  EXPECT_EQ(loader.stats().slots, slots);
}

TEST(Loader, SlotsAreRecycledWhenBatchesAreReleased) {
  fd::Loader loader(dataset(400), noise(), {.batch_size = 8, .workers = 2, .prefetch = 2});
  for (int e = 0; e < 2; ++e) {
    while (auto b = loader.next()) {
    }
  }
  // Two workers, two batches in flight each, one held by the consumer: a handful of slots.
  EXPECT_LE(loader.stats().slots, 6u);
  EXPECT_EQ(loader.stats().batches, 100u);
}

TEST(Loader, WorkerInitHookRunsOncePerWorkerWithItsIdAndSeed) {
  static std::atomic<int> calls{0};
  static std::atomic<uint64_t> seeds{0};
  fd::register_worker_init("test_count", [](const fd::WorkerInfo& info) {
    calls += 1;
    seeds += info.seed + static_cast<uint64_t>(info.id);
  });
  fd::Loader loader(dataset(), noise(),
                    {.batch_size = 50, .workers = 3, .seed = 9, .worker_init = "test_count"});
  for (int e = 0; e < 2; ++e) {
    while (auto b = loader.next()) {
    }
  }
  EXPECT_EQ(calls.load(), 3);  // persistent workers: once each
  uint64_t expect = 0;
  for (uint64_t id = 0; id < 3; ++id) expect += fd::sample_key(9, 0, id, 1) + id;
  EXPECT_EQ(seeds.load(), expect);
}

// A hook for process workers: each writes its id to a file (the test cannot see their memory).
static const bool g_hooks = [] {
  fd::register_worker_init("test_touch_file", [](const fd::WorkerInfo& info) {
    std::ofstream(
        fmt::format("{}/worker-{}-of-{}", std::getenv("LOADER_TEST_DIR"), info.id, info.workers))
        << info.seed;
  });
  fd::register_worker_init("test_stuck_init", [](const fd::WorkerInfo&) {
    std::this_thread::sleep_for(std::chrono::seconds(60));
  });
  fd::register_worker_init("test_cuda_init", [](const fd::WorkerInfo&) {
    void* h = ::dlopen(ft::kFakeCuda.c_str(), RTLD_NOW | RTLD_GLOBAL);
    auto init = reinterpret_cast<forkguard::cuda::PFN_cuInit>(::dlsym(h, "cuInit"));
    init(0);
  });
  return true;
}();

TEST(Loader, ProcessWorkerInitHookAndRestartsWithoutPersistence) {
  ft::TempDir dir;
  ::setenv("LOADER_TEST_DIR", dir.path().c_str(), 1);
  for (auto start : {fd::ProcessStart::kFork}) {  // the zygote's environment predates setenv
    fd::Loader loader(dataset(), noise(),
                      {.batch_size = 50,
                       .workers = 2,
                       .worker_kind = fd::WorkerKind::kProcess,
                       .process_start = start,
                       .persistent_workers = false,
                       .worker_init = "test_touch_file"});
    for (int e = 0; e < 2; ++e) {
      while (auto b = loader.next()) {
      }
      EXPECT_TRUE(loader.worker_pids().empty());  // stopped at the end of the epoch
    }
    EXPECT_EQ(loader.stats().worker_starts, 4u);
    EXPECT_EQ(loader.stats().worker_restarts, 2u);
    EXPECT_EQ(ft::read_file(dir.path() + "/worker-1-of-2"),
              std::to_string(fd::sample_key(0, 1, 1, 1)));
  }
}

TEST(Loader, KilledProcessWorkerIsReportedWithinASecondAndNothingIsLeft) {
  for (auto start : {fd::ProcessStart::kForkServer, fd::ProcessStart::kFork}) {
    const auto fds_before = ft::open_fds();
    {
      fd::Loader loader(dataset(), noise({.sleep_ms = 5}),
                        {.batch_size = 4,
                         .workers = 2,
                         .worker_kind = fd::WorkerKind::kProcess,
                         .process_start = start});
      ASSERT_TRUE(loader.next().has_value());
      auto pids = loader.worker_pids();
      ASSERT_EQ(pids.size(), 2u);
      const pid_t victim = pids[1];
      const uint64_t epoch = loader.epoch();
      ASSERT_EQ(::kill(victim, SIGKILL), 0);
      const auto killed_at = Clock::now();
      try {
        while (loader.next()) {
        }
        FAIL() << "no error after a worker was killed";
      } catch (const fd::WorkerError& e) {
        const double s = std::chrono::duration<double>(Clock::now() - killed_at).count();
        EXPECT_LT(s, 1.0);
        std::string msg = e.what();
        EXPECT_NE(msg.find(fmt::format("worker 1 (PID {})", victim)), std::string::npos) << msg;
        EXPECT_NE(msg.find("killed by signal 9 (SIGKILL)"), std::string::npos) << msg;
        EXPECT_NE(msg.find("(samples "), std::string::npos) << msg;
        EXPECT_EQ(e.pid(), victim);
        EXPECT_FALSE(e.indices().empty());
      }
      EXPECT_TRUE(loader.worker_pids().empty());  // the other worker was stopped too
      // The epoch is over: the loader goes on with fresh workers at the next one.
      EXPECT_EQ(loader.epoch(), epoch + 1);
      size_t n = 0;
      while (auto b = loader.next()) {
        EXPECT_EQ(b->epoch(), epoch + 1);
        ++n;
      }
      EXPECT_EQ(n, loader.size());
      EXPECT_EQ(loader.stats().worker_restarts, 2u);
    }
    expect_clean(fds_before);
  }
}

TEST(Loader, DestroyedMidEpochLeavesNothingBehind) {
  for (const auto& k : kKinds) {
    const auto fds_before = ft::open_fds();
    {
      fd::Loader loader(dataset(), noise({.sleep_ms = 1}), with(k, {.batch_size = 8}));
      auto b = loader.next();
      ASSERT_TRUE(b.has_value());
      auto held = *b;  // a batch outliving its loader keeps its memory
      b.reset();
      EXPECT_EQ(held.key(0), "synthetic/00000000");
    }
    expect_clean(fds_before);
  }
}

TEST(Loader, TimeoutNamesTheBatchAndTheWorker) {
  fd::Loader loader(dataset(), noise({.sleep_ms = 400}),
                    {.batch_size = 4,
                     .workers = 1,
                     .worker_kind = fd::WorkerKind::kProcess,
                     .timeout = std::chrono::milliseconds(200)});
  const auto t0 = Clock::now();
  try {
    loader.next();
    FAIL() << "no timeout";
  } catch (const fd::TimeoutError& e) {
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 1.5);
    std::string msg = e.what();
    EXPECT_NE(msg.find("batch 0 of epoch 0 was not ready within 200 ms; waiting on worker 0 (PID "),
              std::string::npos)
        << msg;
  }
  EXPECT_EQ(loader.epoch(), 1u);  // the epoch is over
}

// A process worker that never gets ready (its init hook hangs) fails the start within
// start_timeout, naming it, and nothing is left behind.
// A dataset whose description is larger than any socket message (the receive buffer was 4 MiB,
// the send buffer about 208 KiB): the setup travels in a memfd, so the workers start.
class HugeDescription : public FlakyDataset {
 public:
  HugeDescription() : FlakyDataset({.size = 8, .sample_bytes = kBytes, .seed = 11}, {}) {}
  std::optional<fd::Description> describe() const override {
    auto d = FlakyDataset::describe();
    d->params["padding"] = std::string(size_t(5) << 20, 'x');
    return d;
  }
};

TEST(Loader, ProcessWorkersGetASetupLargerThanAnySocketMessage) {
  const auto fds_before = ft::open_fds();
  {
    fd::Loader loader(std::make_shared<HugeDescription>(), noise(),
                      {.batch_size = 4,
                       .workers = 2,
                       .worker_kind = fd::WorkerKind::kProcess,
                       .process_start = fd::ProcessStart::kForkServer});
    size_t samples = 0;
    while (auto b = loader.next()) samples += b->size();
    EXPECT_EQ(samples, 8u);
    EXPECT_EQ(loader.stats().worker_starts, 2u);
  }
  expect_clean(fds_before);
}

// An ImageFolder of 30 000 files (hard links to one 768-byte file): its description lists every
// file (about 500 KB), more than a socket's send buffer. Process workers from the fork server
// start and read the loader's files (the issue: "cannot send process worker 0 its setup (...):
// Message too long" from about 5 000 files on).
TEST(Loader, ProcessWorkersStartOnAnImageFolderOfThirtyThousandFiles) {
  ft::TempDir dir;
  const std::string root = dir.path() + "/train";
  ASSERT_EQ(::mkdir(root.c_str(), 0700), 0);
  const std::string first = root + "/a/00000.jpg";
  for (const char* c : {"/a", "/b"}) ASSERT_EQ(::mkdir((root + c).c_str(), 0700), 0);
  std::ofstream(first, std::ios::binary) << std::string(kBytes, 'j');
  constexpr int kFiles = 30000;
  for (int i = 1; i < kFiles; ++i) {
    const auto p = fmt::format("{}/{}/{:05}.jpg", root, i < kFiles / 2 ? "a" : "b", i);
    ASSERT_EQ(::link(first.c_str(), p.c_str()), 0) << p;
  }
  auto ds = std::make_shared<fd::ImageFolder>(root);
  ASSERT_EQ(ds->size(), size_t(kFiles));
  // More than one socket message can carry here (the send buffer's default size).
  size_t wmem_default = 212992;
  std::ifstream("/proc/sys/net/core/wmem_default") >> wmem_default;
  ASSERT_GT(ds->describe()->params.dump().size(), 2 * wmem_default);
  const auto fds_before = ft::open_fds();
  {
    fd::Loader loader(ds, noise(),
                      {.batch_size = 16,
                       .workers = 2,
                       .worker_kind = fd::WorkerKind::kProcess,
                       .process_start = fd::ProcessStart::kForkServer});
    for (int n = 0; n < 3; ++n) {
      auto b = loader.next();
      ASSERT_TRUE(b.has_value());
      for (size_t i = 0; i < b->size(); ++i) {
        EXPECT_EQ(b->key(i), ds->key(b->indices()[i]));
      }
    }
    EXPECT_EQ(loader.worker_pids().size(), 2u);
  }
  expect_clean(fds_before);
}

TEST(Loader, ProcessWorkerThatNeverGetsReadyFailsWithinTheTimeout) {
  for (auto start : {fd::ProcessStart::kForkServer, fd::ProcessStart::kFork}) {
    const auto fds_before = ft::open_fds();
    const auto t0 = Clock::now();
    try {
      fd::Loader loader(dataset(), noise(),
                        {.workers = 2,
                         .worker_kind = fd::WorkerKind::kProcess,
                         .process_start = start,
                         .start_timeout = std::chrono::milliseconds(300),
                         .worker_init = "test_stuck_init"});
      loader.next();
      ADD_FAILURE() << "no error";
    } catch (const fd::WorkerError& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("process workers could not start: worker 0 (PID "), std::string::npos)
          << msg;
      EXPECT_NE(msg.find("it was not ready within 300 ms (LoaderOptions::start_timeout)"),
                std::string::npos)
          << msg;
    }
    EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
    expect_clean(fds_before);
  }
}

// A thread stuck in a transform cannot be killed: the timeout still fires on time, the thread is
// left behind (its slot kept out of the pool until its task returns), and the next epochs run
// with fresh threads and the right bytes, also once the stuck task has returned.
TEST(Loader, TimeoutWithAThreadStuckInATransformFiresAndTheLoaderGoesOn) {
  NoiseOptions stuck{.slow_at = 5, .slow_ms = 1500, .slow_once = true};
  stuck.bytes = kBytes;
  const fd::LoaderOptions o{
      .batch_size = 4, .workers = 2, .timeout = std::chrono::milliseconds(200)};
  fd::Loader reference(dataset(40), noise(), o);
  std::vector<std::vector<uint64_t>> expected(3);
  for (auto& e : expected) {
    while (auto b = reference.next()) e.push_back(hash_batch(*b));
  }
  fd::Loader loader(dataset(40), std::make_shared<NoiseTransform>(stuck), o);
  const auto t0 = Clock::now();
  try {
    while (loader.next()) {
    }
    FAIL() << "no timeout";
  } catch (const fd::TimeoutError& e) {
    EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1)) << "the timeout waited for the thread";
    EXPECT_NE(std::string(e.what()).find("(a thread)"), std::string::npos) << e.what();
  }
  EXPECT_EQ(loader.epoch(), 1u);
  for (uint64_t epoch = 1; epoch < 3; ++epoch) {
    std::vector<uint64_t> got;
    while (auto b = loader.next()) got.push_back(hash_batch(*b));
    EXPECT_EQ(got, expected[epoch]) << "epoch " << epoch;
    if (epoch == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1600));  // it returns
  }
}

TEST(Loader, ALoaderDestroyedMidEpochLeavesNoThreadWorkingOnItsBatches) {
  // Thread workers drop their batches between samples when the loader goes: none is left behind
  // finishing a batch nobody will read, taking the cores from whatever the program does next.
  // A thread left behind would keep the transform alive (the loader gives it a reference) until
  // its task returned: 32 samples of 20 ms each, 640 ms a worker.
  const std::string trace = ::testing::TempDir() + "/forkguard-abandoned-trace";
  std::remove(trace.c_str());
  NoiseOptions slow{.sleep_ms = 20, .trace = trace};
  slow.bytes = kBytes;
  auto lines = [&] {
    std::ifstream in(trace);
    return std::count(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>(), '\n');
  };
  auto transform = std::make_shared<NoiseTransform>(slow);
  std::weak_ptr<NoiseTransform> alive = transform;
  std::optional<fd::Loader> loader;
  loader.emplace(dataset(400), std::move(transform),
                 fd::LoaderOptions{.batch_size = 32, .workers = 2, .prefetch = 2});
  ASSERT_TRUE(loader->next());
  const auto at_reset = lines();
  const auto t0 = Clock::now();
  loader.reset();
  while (!alive.expired() && Clock::now() - t0 < std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const auto gone = Clock::now() - t0;
  ASSERT_TRUE(alive.expired()) << "a thread still held the transform 5 s after the loader went";
  // At most the sample each worker was in; a stall of 300 ms in one sample is the only excuse.
  EXPECT_LT(gone, std::chrono::milliseconds(300)) << "a thread went on with its batch";
  EXPECT_LE(lines() - at_reset, 2) << "a thread went on filling a batch of a destroyed loader";
  std::remove(trace.c_str());
}

TEST(Loader, ProcessWorkersFromTheForkServerWorkAfterThisProcessInitializedCuda) {
  const auto& drv = init_cuda_here();
  auto reference = hashes({.batch_size = 16, .seed = 4}, 1);
  for (auto start : {fd::ProcessStart::kAuto, fd::ProcessStart::kForkServer}) {
    EXPECT_EQ(hashes({.batch_size = 16,
                      .workers = 2,
                      .worker_kind = fd::WorkerKind::kProcess,
                      .process_start = start,
                      .seed = 4},
                     1),
              reference);
  }
  // A guarded fork from here is refused, with the evidence.
  try {
    fd::Loader loader(dataset(), noise(),
                      {.workers = 2,
                       .worker_kind = fd::WorkerKind::kProcess,
                       .process_start = fd::ProcessStart::kFork});
    loader.next();
    FAIL() << "forked workers from a CUDA-initialized process";
  } catch (const fd::DataError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("refusing to fork process workers"), std::string::npos) << msg;
    EXPECT_NE(msg.find("initialized"), std::string::npos) << msg;
  }
  forkguard::cuda::CUdeviceptr p;
  EXPECT_EQ(drv.api().cuMemAlloc_v2(&p, 64), forkguard::cuda::CUDA_SUCCESS);
  EXPECT_EQ(drv.api().cuMemFree_v2(p), forkguard::cuda::CUDA_SUCCESS);
}

TEST(Loader, ProcessWorkerWhoseTransformInitializesCudaStopsNamingIt) {
  const auto& drv = init_cuda_here();  // the main process uses the GPU meanwhile
  fd::Loader loader(dataset(), noise({.cuda_at = 21, .driver = ft::kFakeCuda}),
                    {.batch_size = 8, .workers = 2, .worker_kind = fd::WorkerKind::kProcess});
  size_t delivered = 0;
  try {
    while (loader.next()) ++delivered;
    FAIL() << "no error";
  } catch (const fd::WorkerError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("transform \"noise\" initialized CUDA in the worker while processing "
                       "sample 21 (synthetic/00000021)"),
              std::string::npos)
        << msg;
    EXPECT_EQ(e.worker(), 0);  // batch 2 (samples 16-23) is worker 0's
  }
  EXPECT_EQ(delivered, 2u);
  forkguard::cuda::CUdeviceptr p;
  EXPECT_EQ(drv.api().cuMemAlloc_v2(&p, 64), forkguard::cuda::CUDA_SUCCESS);
  EXPECT_EQ(drv.api().cuMemFree_v2(p), forkguard::cuda::CUDA_SUCCESS);
}

TEST(Loader, ProcessWorkerInitHookThatInitializesCudaIsNamed) {
  try {
    fd::Loader loader(
        dataset(), noise(),
        {.workers = 1, .worker_kind = fd::WorkerKind::kProcess, .worker_init = "test_cuda_init"});
    loader.next();
    FAIL() << "no error";
  } catch (const fd::WorkerError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("its init hook \"test_cuda_init\" initialized CUDA in the worker"),
              std::string::npos)
        << msg;
  }
}

// Thread workers that cannot all be created (out of address space for their stacks) are stopped
// and reported, instead of std::terminate from a joinable std::thread's destructor.
TEST(Loader, ThreadWorkersThatCannotStartAreReported) {
#ifdef FORKGUARD_SANITIZED_BUILD
  GTEST_SKIP() << "a sanitizer's runtime reserves terabytes of address space: no RLIMIT_AS fits";
#else
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Room for this process as it is and a few thread stacks, not for 256 of them (8 MiB each).
    std::ifstream status("/proc/self/status");
    size_t vm_kb = 0;
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("VmSize:", 0) == 0) vm_kb = std::strtoull(line.c_str() + 7, nullptr, 10);
    }
    rlimit lim{};
    lim.rlim_cur = lim.rlim_max = (vm_kb + 64 * 1024) * 1024;
    if (vm_kb == 0 || ::setrlimit(RLIMIT_AS, &lim) != 0) ::_exit(3);
    try {
      fd::Loader loader(dataset(), noise(), {.workers = 256});
      loader.next();
      ::_exit(4);
    } catch (const fd::WorkerError& e) {
      ::_exit(std::string(e.what()).find("cannot start thread worker ") == 0 ? 0 : 5);
    } catch (...) {
      ::_exit(6);
    }
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
#endif
}

TEST(Loader, DeviceHandOffCopiesExactBytesAndReusesSlotsOnlyAfterTheCopy) {
  // The test driver performs each async copy only when it completes, 15 ms later: a slot reused
  // before its copy's event completed would put the next batch's bytes on the "device".
  ::setenv("FAKE_CUDA_COPY_DELAY_MS", "15", 1);
  ft::TempDir dir;
  ::setenv("FAKE_CUDA_DEV_DIR", dir.path().c_str(), 1);
  const auto& drv = init_cuda_here();
  const fd::LoaderOptions base{
      .batch_size = 16, .workers = 2, .prefetch = 1, .seed = 8, .shuffle = true};
  auto reference = hashes(base, 2);
  auto o = base;
  o.device.enabled = true;
  fd::Loader loader(dataset(), noise(), o);
  std::vector<uint64_t> got;
  std::vector<char> host(16 * kBytes);
  for (int e = 0; e < 2; ++e) {
    while (auto b = loader.next()) {
      ASSERT_EQ(b->placement(), fd::Placement::kDevice);
      EXPECT_NE(b->stream(), 0u);
      DLManagedTensor* t = b->images_dlpack();
      EXPECT_EQ(t->dl_tensor.device.device_type, kDLCUDA);
      t->deleter(t);
      b->synchronize();
      ASSERT_EQ(drv.api().cuMemcpyDtoH_v2(
                    host.data(), reinterpret_cast<forkguard::cuda::CUdeviceptr>(b->images_data()),
                    b->images_bytes()),
                forkguard::cuda::CUDA_SUCCESS);
      uint64_t h = fnv1a(host.data(), b->images_bytes());
      h = fnv1a(b->labels(), b->size() * sizeof(int64_t), h);
      for (size_t i = 0; i < b->size(); ++i) h = fnv1a(b->key(i).data(), b->key(i).size(), h);
      got.push_back(fnv1a(b->indices().data(), b->indices().size() * sizeof(size_t), h));
    }
  }
  EXPECT_EQ(got, reference);
  // Pinned once per slot, never per batch.
  EXPECT_LE(loader.stats().slots, 6u);
}

TEST(Loader, DeviceBatchesRecordedOnAnotherStreamAreReusedOnlyAfterItsWork) {
  // The consumer copies each batch back on its own stream and releases the batch at once; the test
  // driver performs that copy only when it completes (15 ms later) or its stream is synchronized.
  // A device buffer reused before that work ran would hand the consumer a later batch's bytes:
  // record_stream() makes the loader's next copy into the buffer wait for it.
  ::setenv("FAKE_CUDA_COPY_DELAY_MS", "15", 1);
  ft::TempDir dir;
  ::setenv("FAKE_CUDA_DEV_DIR", dir.path().c_str(), 1);
  const auto& drv = init_cuda_here();
  const auto& api = drv.api();
  const fd::LoaderOptions base{.batch_size = 16, .workers = 2, .seed = 8, .shuffle = true};
  std::vector<uint64_t> reference;
  {
    fd::Loader host(dataset(), noise(), base);
    while (auto b = host.next()) reference.push_back(fnv1a(b->images_data(), b->images_bytes()));
  }
  auto o = base;
  o.device.enabled = true;
  for (bool record : {true, false}) {
    fd::Loader loader(dataset(), noise(), o);
    forkguard::cuda::CUstream mine = nullptr;
    ASSERT_EQ(api.cuStreamCreate(&mine, 0x1), forkguard::cuda::CUDA_SUCCESS);
    std::vector<std::vector<char>> back;
    while (auto b = loader.next()) {
      b->synchronize();
      back.emplace_back(b->images_bytes());
      ASSERT_EQ(
          api.cuMemcpyDtoHAsync_v2(back.back().data(),
                                   reinterpret_cast<forkguard::cuda::CUdeviceptr>(b->images_data()),
                                   b->images_bytes(), mine),
          forkguard::cuda::CUDA_SUCCESS);
      if (record) b->record_stream(reinterpret_cast<uintptr_t>(mine));
    }  // each batch released with its copy still queued on `mine`
    ASSERT_EQ(api.cuStreamSynchronize(mine), forkguard::cuda::CUDA_SUCCESS);
    api.cuStreamDestroy_v2(mine);
    std::vector<uint64_t> got;
    for (const auto& h : back) got.push_back(fnv1a(h.data(), h.size()));
    if (record) {
      EXPECT_EQ(got, reference);
    } else {  // the test can tell: without it the buffers are overwritten under the copies
      EXPECT_NE(got, reference);
    }
  }
}

int main(int argc, char** argv) {
  forkguard::init(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
