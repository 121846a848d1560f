// The hostile-input suite: a tree of what real machines hold — a FIFO or socket named like an
// image, a symlink loop, names with a newline or bytes that are not UTF-8, hard links, a 0-byte
// file, a 2 GB sparse file, a file that disappears between scan and read, a class directory that
// becomes unreadable mid-epoch, a tar shard rewritten mid-epoch or replaced before the workers
// index it — through the real image pipeline, for no workers, 2 thread workers and 2 process
// workers (fork server), under bad_sample error and skip. Each case: a named error or a counted
// skip, within a bounded time, and nothing left behind (fds, memfd mappings, /dev/shm files,
// processes). Its own main() calls forkguard::init(), so the fork server exists.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "data/test_images.hpp"
#include "forkguard/data/image_folder.hpp"
#include "forkguard/data/image_transform.hpp"
#include "forkguard/data/loader.hpp"
#include "forkguard/data/tar_shards.hpp"
#include "forkguard/init.hpp"
#include "launch/fork_server.hpp"
#include "process.hpp"

namespace fd = forkguard::data;
namespace ft = forkguard::testing;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// Sanitizer builds run several times slower; every bound scales with them.
constexpr int kScale = FORKGUARD_HOSTILE_TIME_SCALE;
constexpr double kBoundSeconds = 10.0 * kScale;  // one epoch over a hostile tree, at most

struct Kind {
  size_t workers;
  fd::WorkerKind kind;
  const char* name;
};
constexpr Kind kKinds[] = {{0, fd::WorkerKind::kThread, "no workers"},
                           {2, fd::WorkerKind::kThread, "2 thread workers"},
                           {2, fd::WorkerKind::kProcess, "2 process workers"}};
constexpr fd::BadSample kPolicies[] = {fd::BadSample::kError, fd::BadSample::kSkip};

pid_t zygote() {
  return forkguard::launch::detail::ForkServer::get()->pid();
}

void write_bytes(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::vector<unsigned char> jpeg(int seed) {
  return ft::encode_jpeg(ft::gradient_picture(40, 30, seed), 40, 30);
}

// root/a/00..(na-1).jpg and root/b/00..(nb-1).jpg, each a small JPEG.
void good_tree(const std::string& root, int na = 12, int nb = 4) {
  for (const auto& [cls, n] : {std::pair{"a", na}, std::pair{"b", nb}}) {
    fs::create_directories(fs::path(root) / cls);
    for (int i = 0; i < n; ++i) {
      write_bytes(fmt::format("{}/{}/{:02}.jpg", root, cls, i), jpeg(i + (cls[0] == 'b') * 50));
    }
  }
}

std::shared_ptr<fd::Transform> transform() {
  return std::make_shared<fd::ImageTransform>(
      fd::ImageOptions{.train = false, .size = 16, .resize = 16, .dtype = fd::DType::kUInt8});
}

// What a process holds that a loader could leave behind.
struct Holdings {
  std::vector<int> fds;
  size_t memfd_mappings = 0;
  std::set<std::string> shm;
  std::vector<pid_t> zygote_children;
  std::vector<pid_t> own_children;

  static Holdings now() {
    Holdings h;
    h.fds = ft::open_fds();
    std::ifstream maps("/proc/self/maps");
    for (std::string line; std::getline(maps, line);) {
      if (line.find("/memfd:") != std::string::npos) ++h.memfd_mappings;
    }
    // /dev/shm is the machine's: other programs' files come and go there. Ours would be named
    // forkguard*, or still be mapped or open here.
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/dev/shm", ec)) {
      if (e.path().filename().string().starts_with("forkguard")) h.shm.insert(e.path().string());
    }
    std::ifstream again("/proc/self/maps");
    for (std::string line; std::getline(again, line);) {
      if (const size_t at = line.find("/dev/shm/"); at != std::string::npos) {
        h.shm.insert(line.substr(at));
      }
    }
    for (int f : h.fds) {
      std::error_code link_ec;
      const auto target = fs::read_symlink(fmt::format("/proc/self/fd/{}", f), link_ec).string();
      if (target.starts_with("/dev/shm/")) h.shm.insert(target);
    }
    h.zygote_children = ft::children_of(zygote());
    for (pid_t c : ft::children_of(::getpid())) {
      if (c != zygote()) h.own_children.push_back(c);
    }
    return h;
  }
};

void expect_same(const Holdings& before, const Holdings& after, const std::string& what) {
  EXPECT_EQ(after.fds, before.fds) << what << ": file descriptors left open";
  EXPECT_EQ(after.memfd_mappings, before.memfd_mappings) << what << ": memfd mappings left";
  EXPECT_EQ(after.shm, before.shm) << what << ": /dev/shm files left";
  EXPECT_EQ(after.zygote_children, before.zygote_children) << what << ": workers left running";
  EXPECT_EQ(after.own_children, before.own_children) << what << ": processes left running";
}

struct Outcome {
  size_t batches = 0;
  size_t samples = 0;
  uint64_t skipped = 0;
  std::vector<std::string> errors;    // DataError messages
  std::vector<std::string> failures;  // WorkerError / TimeoutError / other messages
  std::set<std::string> keys;         // of the samples delivered
  double seconds = 0;
};

struct Case {
  std::function<std::shared_ptr<fd::Dataset>()> dataset{};
  std::function<void()> after_scan{};         // between the dataset's scan and the loader
  std::function<void()> after_first_batch{};  // mid-epoch
  size_t batch_size = 2;
};

// One epoch of `c` for every worker kind and bad-sample policy; `check` judges each outcome.
void for_every_configuration(const Case& c,
                             const std::function<void(const Outcome&, const Kind&, fd::BadSample,
                                                      const std::string&)>& check) {
  for (const Kind& k : kKinds) {
    for (fd::BadSample policy : kPolicies) {
      const std::string what = fmt::format("{}, bad_sample={}", k.name,
                                           policy == fd::BadSample::kSkip ? "skip" : "error");
      SCOPED_TRACE(what);
      const Holdings before = Holdings::now();
      Outcome o;
      {
        auto ds = c.dataset();
        if (c.after_scan) c.after_scan();
        fd::LoaderOptions opts{.batch_size = c.batch_size,
                               .workers = k.workers,
                               .worker_kind = k.kind,
                               .process_start = fd::ProcessStart::kForkServer,
                               .timeout = std::chrono::seconds(5 * kScale),
                               .bad_sample = policy};
        opts.log = [](const std::string&) {};
        const auto start = Clock::now();
        fd::Loader loader(ds, transform(), opts);
        bool first = true;
        for (bool more = true; more;) {
          try {
            auto b = loader.next();
            if (!b) break;
            ++o.batches;
            o.samples += b->size();
            for (size_t i = 0; i < b->size(); ++i) o.keys.insert(std::string(b->key(i)));
          } catch (const fd::DataError& e) {
            o.errors.push_back(e.what());
          } catch (const std::exception& e) {
            o.failures.push_back(e.what());
            more = false;  // the epoch is over
          }
          if (first && c.after_first_batch) c.after_first_batch();
          first = false;
          if (std::chrono::duration<double>(Clock::now() - start).count() > 3 * kBoundSeconds) {
            ADD_FAILURE() << "the epoch does not end";
            break;
          }
        }
        o.skipped = loader.stats().skipped;
        o.seconds = std::chrono::duration<double>(Clock::now() - start).count();
      }
      EXPECT_LT(o.seconds, kBoundSeconds);
      check(o, k, policy, what);
      expect_same(before, Holdings::now(), what);
    }
  }
}

// The usual judgement: under error, the bad samples raise DataErrors that name each one and its
// reason, and every other batch arrives; under skip, they are counted and every batch arrives.
void expect_named_or_skipped(const Case& c, size_t total, const std::vector<std::string>& bad,
                             const std::string& reason) {
  for_every_configuration(
      c, [&](const Outcome& o, const Kind&, fd::BadSample policy, const std::string& what) {
        EXPECT_TRUE(o.failures.empty()) << what << ": " << fmt::format("{}", o.failures.front());
        const size_t batches = (total + c.batch_size - 1) / c.batch_size;
        if (policy == fd::BadSample::kError) {
          ASSERT_FALSE(o.errors.empty()) << what;
          std::set<std::string> named;
          for (const auto& e : o.errors) {
            EXPECT_NE(e.find(reason), std::string::npos) << e;
            for (const auto& p : bad) {
              if (e.find(p) != std::string::npos) named.insert(p);
            }
          }
          EXPECT_EQ(named.size(), std::min(bad.size(), o.errors.size()))
              << fmt::format("{}", fmt::join(o.errors, "\n"));
          EXPECT_EQ(o.batches + o.errors.size(), batches) << what;
          EXPECT_EQ(o.skipped, 0u);
        } else {
          EXPECT_TRUE(o.errors.empty()) << o.errors.front();
          EXPECT_EQ(o.skipped, bad.size()) << what;
          EXPECT_EQ(o.batches, batches);
          EXPECT_EQ(o.samples, total);
          for (const auto& p : bad) EXPECT_EQ(o.keys.count(p), 0u) << p << " was delivered";
        }
      });
}

Case folder_case(const std::string& root) {
  return Case{.dataset = [root] { return std::make_shared<fd::ImageFolder>(root); }};
}

// A single-sample bad entry in a, among 16 good files.
void expect_bad_entry(const std::string& root, const std::string& bad, const std::string& reason) {
  expect_named_or_skipped(folder_case(root), 17, {bad}, reason);
}

}  // namespace

TEST(Hostile, FifoNamedLikeAnImageIsRefusedByTypeNotWaitedOn) {
  ft::TempDir dir;
  good_tree(dir.path());
  const std::string fifo = dir.path() + "/a/fifo.jpg";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  expect_bad_entry(dir.path(), fifo, "not a regular file (a FIFO)");
}

TEST(Hostile, SocketNamedLikeAnImageIsRefusedByType) {
  ft::TempDir dir;
  good_tree(dir.path());
  const std::string path = dir.path() + "/a/sock.jpg";
  {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    ASSERT_LT(path.size(), sizeof addr.sun_path);
    std::copy(path.begin(), path.end(), addr.sun_path);
    const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(s, 0);
    ASSERT_EQ(::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ::close(s);  // the socket file stays
  }
  expect_bad_entry(dir.path(), path, "not a regular file (a socket)");
}

TEST(Hostile, SymlinkLoopIsABadSampleNamingTheLink) {
  ft::TempDir dir;
  good_tree(dir.path());
  const std::string link = dir.path() + "/a/loop.jpg";
  fs::create_symlink("loop.jpg", link);
  expect_bad_entry(dir.path(), link, "Too many levels of symbolic links");
}

// Followed, `a/up -> ..` listed every image 41 times (until the path no longer resolved), and with
// b/elsewhere beside it the scan did not end.
TEST(Hostile, DirectorySymlinkLoopFailsTheScanNamingTheLink) {
  ft::TempDir dir;
  good_tree(dir.path());
  fs::create_directory_symlink("..", dir.path() + "/a/up");
  fs::create_directory_symlink(dir.path() + "/a", dir.path() + "/b/elsewhere");  // no loop
  EXPECT_EQ(ft::data_error_of([&] { fd::ImageFolder{dir.path()}; }),
            fmt::format("{0}/a/up: a symlink loop: it leads back to {1}, a directory it is in "
                        "(remove the link)",
                        dir.path(), fs::canonical(dir.path()).string()));
  fs::remove(dir.path() + "/a/up");
  EXPECT_EQ(fd::ImageFolder(dir.path()).size(), 28u) << "a's 12 images twice: in a and in b";
}

TEST(Hostile, NamesWithNewlinesAndInvalidUtf8AreOrdinarySamples) {
  ft::TempDir dir;
  good_tree(dir.path());
  const std::string newline = dir.path() + "/a/new\nline.jpg";
  const std::string latin1 = dir.path() + "/b/caf\xe9.jpg";  // ISO-8859-1, not UTF-8
  const std::string bytes = dir.path() + "/b/\xff\xfe.jpg";
  write_bytes(newline, jpeg(90));
  write_bytes(latin1, jpeg(91));
  write_bytes(bytes, jpeg(92));
  for_every_configuration(folder_case(dir.path()), [&](const Outcome& o, const Kind&, fd::BadSample,
                                                       const std::string& what) {
    EXPECT_TRUE(o.errors.empty() && o.failures.empty())
        << what << ": " << fmt::format("{}", fmt::join(o.errors, "; "))
        << fmt::format("{}", fmt::join(o.failures, "; "));
    EXPECT_EQ(o.samples, 19u);
    EXPECT_EQ(o.skipped, 0u);
    for (const auto& k : {newline, latin1, bytes}) EXPECT_EQ(o.keys.count(k), 1u) << k;
  });
}

TEST(Hostile, HardLinksAreTwoSamples) {
  ft::TempDir dir;
  good_tree(dir.path());
  const std::string twin = dir.path() + "/b/twin.jpg";
  fs::create_hard_link(dir.path() + "/a/00.jpg", twin);
  for_every_configuration(folder_case(dir.path()), [&](const Outcome& o, const Kind&, fd::BadSample,
                                                       const std::string& what) {
    EXPECT_TRUE(o.errors.empty() && o.failures.empty()) << what;
    EXPECT_EQ(o.samples, 17u);
    EXPECT_EQ(o.keys.count(twin), 1u);
    EXPECT_EQ(o.keys.count(dir.path() + "/a/00.jpg"), 1u);
  });
}

TEST(Hostile, ZeroByteFileIsNamed) {
  ft::TempDir dir;
  good_tree(dir.path());
  const std::string empty = dir.path() + "/a/empty.jpg";
  write_bytes(empty, {});
  expect_bad_entry(dir.path(), empty, "empty file (0 bytes)");
}

// Without the check, every read of it allocated and filled 2 GB of zeros (per worker).
TEST(Hostile, TwoGigabyteSparseFileIsRefusedBeforeItIsRead) {
  ft::TempDir dir;
  good_tree(dir.path());
  const std::string sparse = dir.path() + "/a/sparse.jpg";
  write_bytes(sparse, jpeg(1));  // a JPEG's start, then 2 GB of hole
  ASSERT_EQ(::truncate(sparse.c_str(), 2'000'000'000), 0);
  expect_bad_entry(dir.path(), sparse, "a sparse file (2000000000 bytes");
}

TEST(Hostile, FileThatDisappearsBetweenScanAndReadIsNamed) {
  ft::TempDir dir;
  good_tree(dir.path());
  const std::string gone = dir.path() + "/a/gone.jpg";
  Case c = folder_case(dir.path());
  c.dataset = [&] {
    write_bytes(gone, jpeg(7));
    return std::make_shared<fd::ImageFolder>(dir.path());
  };
  c.after_scan = [&] { ASSERT_EQ(::unlink(gone.c_str()), 0); };
  expect_named_or_skipped(c, 17, {gone}, "cannot open: No such file or directory");
}

// root ignores permissions: as root the case runs again as nobody.
TEST(Hostile, DirectoryThatBecomesUnreadableMidEpochIsNamedPerSample) {
  if (::geteuid() == 0) {
    if (!fs::exists("/usr/bin/setpriv")) GTEST_SKIP() << "no setpriv to run it as nobody";
    const auto r = ft::run({"/usr/bin/setpriv", "--reuid", "nobody", "--regid", "nogroup",
                            "--clear-groups", fs::read_symlink("/proc/self/exe").string(),
                            "--gtest_filter=Hostile.DirectoryThatBecomesUnreadableMidEpoch*"},
                           {{"TMPDIR", "/tmp"}}, std::chrono::seconds(60 * kScale));
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("[  PASSED  ] 1 test"), std::string::npos) << r.out << r.err;
    return;
  }
  ft::TempDir dir;
  // a: 20 files (10 batches of 2), b: 4, read last; at most 4 batches (2 workers x prefetch 2)
  // are made ahead of the consumer, so b is read after the chmod.
  good_tree(dir.path(), 20, 4);
  const std::string b = dir.path() + "/b";
  Case c = folder_case(dir.path());
  c.dataset = [&] {
    fs::permissions(b, fs::perms::owner_all);
    return std::make_shared<fd::ImageFolder>(dir.path());
  };
  c.after_first_batch = [&] { fs::permissions(b, fs::perms::none); };
  std::vector<std::string> bad;
  for (int i = 0; i < 4; ++i) bad.push_back(fmt::format("{}/{:02}.jpg", b, i));
  expect_named_or_skipped(c, 24, bad, "Permission denied");
  fs::permissions(b, fs::perms::owner_all);
}

namespace {

// A tar shard of `n` samples (NNN.jpg + NNN.cls), written with GNU tar.
void write_shard(const std::string& path, int n, int seed) {
  ft::TempDir staging;
  std::vector<std::string> argv{"/usr/bin/tar", "--format=ustar", "-cf", path,
                                "-C",           staging.path()};
  for (int i = 0; i < n; ++i) {
    write_bytes(fmt::format("{}/{:03}.jpg", staging.path(), i), jpeg(seed + i));
    std::ofstream(fmt::format("{}/{:03}.cls", staging.path(), i)) << (seed + i) % 5;
    argv.push_back(fmt::format("{:03}.jpg", i));
    argv.push_back(fmt::format("{:03}.cls", i));
  }
  const auto r = ft::run(argv);
  ASSERT_EQ(r.exit_code, 0) << r.err;
}

}  // namespace

// Rewritten in place (cp over it): the held descriptor now reads the new file at the old offsets.
TEST(Hostile, TarShardRewrittenMidEpochIsNamedNotMisread) {
  ft::TempDir dir;
  const std::string s0 = dir.path() + "/s0.tar", s1 = dir.path() + "/s1.tar";
  Case c{.dataset =
             [&] {
               write_shard(s0, 20, 0);  // 10 batches before s1's: read after the rewrite
               write_shard(s1, 4, 100);
               return std::make_shared<fd::TarShards>(dir.path() + "/s{0..1}.tar");
             },
         .after_first_batch =
             [&] {
               write_shard(dir.path() + "/new.tar", 5, 200);
               fs::copy_file(dir.path() + "/new.tar", s1, fs::copy_options::overwrite_existing);
             }};
  std::vector<std::string> bad;
  for (int i = 0; i < 4; ++i) bad.push_back(fmt::format("{}: sample \"{:03}\"", s1, i));
  expect_named_or_skipped(c, 24, bad, "the shard changed since it was indexed");
}

// Replaced by rename after the loader indexed it: threads read the indexed file through the
// descriptor held since; a fork-server worker indexes the shards again and must not read another
// file's samples under the loader's indices.
TEST(Hostile, TarShardReplacedBeforeProcessWorkersStartIsNamed) {
  ft::TempDir dir;
  const std::string s0 = dir.path() + "/s0.tar", s1 = dir.path() + "/s1.tar";
  Case c{.dataset =
             [&] {
               write_shard(s0, 6, 0);
               write_shard(s1, 4, 100);
               return std::make_shared<fd::TarShards>(dir.path() + "/s{0..1}.tar");
             },
         .after_scan =
             [&] {
               write_shard(dir.path() + "/new.tar", 5, 200);
               fs::rename(dir.path() + "/new.tar", s1);
             }};
  for_every_configuration(
      c, [&](const Outcome& o, const Kind& k, fd::BadSample, const std::string& what) {
        if (k.kind == fd::WorkerKind::kProcess) {
          ASSERT_FALSE(o.failures.empty()) << what << ": the workers read the new shard";
          EXPECT_NE(o.failures.front().find(s1 + ": the shard changed since the loader indexed it"),
                    std::string::npos)
              << o.failures.front();
          EXPECT_EQ(o.samples, 0u);
        } else {
          EXPECT_TRUE(o.errors.empty() && o.failures.empty()) << what;
          EXPECT_EQ(o.samples, 10u);
        }
      });
}

int main(int argc, char** argv) {
  forkguard::init(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
