// `forkguard bench loader` on a small ImageFolder made here: the digest does not depend on the
// number or kind of workers; bad files are skipped and counted, or named in the error.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <vector>

#include <jpeglib.h>

#include "paths.hpp"
#include "process.hpp"
#include "test_images.hpp"

namespace ft = forkguard::testing;
namespace fs = std::filesystem;

namespace {

void write_jpeg(const fs::path& path, int w, int h, int seed) {
  ft::write_bytes(path, ft::encode_jpeg(ft::gradient_picture(w, h, seed), w, h));
}

std::string make_folder(const std::string& root) {
  for (int i = 0; i < 40; ++i) {
    fs::path p = fs::path(root) / ("class_" + std::to_string(i % 3)) / (std::to_string(i) + ".jpg");
    fs::create_directories(p.parent_path());
    write_jpeg(p, 200 + 13 * i, 150 + 7 * i, i);
  }
  return root;
}

nlohmann::json bench(const std::string& dir, std::vector<std::string> extra) {
  std::vector<std::string> argv{ft::kForkguard, "bench", "loader",   "--data", dir, "--epochs", "2",
                                "--batch-size", "8",     "--digest", "--json"};
  if (std::find(extra.begin(), extra.end(), "--epochs") != extra.end()) {
    argv.erase(argv.begin() + 5, argv.begin() + 7);  // the caller's epoch count instead
  }
  argv.insert(argv.end(), extra.begin(), extra.end());
  auto r = ft::run(argv);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return nlohmann::json::parse(r.out.empty() ? std::string("{}") : r.out);
}

}  // namespace

TEST(BenchLoaderCli, DigestIsTheSameForEveryWorkerCountAndKind) {
  ft::TempDir dir;
  auto root = make_folder(dir.path() + "/imgs");
  auto ref = bench(root, {"--workers", "1"});
  ASSERT_TRUE(ref.contains("digest"));
  EXPECT_EQ(ref["images"], 80);
  EXPECT_EQ(ref["skipped"], 0);
  EXPECT_GT(ref["images_per_second"].get<double>(), 0);
  EXPECT_GT(ref["first_batch_seconds"].get<double>(), 0);
  EXPECT_GT(ref["peak_rss_bytes"].get<double>(), 0);
  // Three fresh loaders after the epochs, each timed to its first batch; the median reported.
  auto fresh = ref["fresh_first_batches_seconds"].get<std::vector<double>>();
  ASSERT_EQ(fresh.size(), 3u);
  std::sort(fresh.begin(), fresh.end());
  EXPECT_GT(fresh[0], 0);
  EXPECT_EQ(ref["fresh_first_batch_seconds"].get<double>(), fresh[1]);
  for (auto extra : std::vector<std::vector<std::string>>{
           {"--workers", "2"},
           {"--workers", "2", "--worker-kind", "process"},
           {"--workers", "1", "--worker-kind", "process", "--dtype", "float32"}}) {
    EXPECT_EQ(bench(root, extra)["digest"], ref["digest"]) << extra[1];
  }
  auto u8 = bench(root, {"--dtype", "uint8", "--fresh-loaders", "0"});
  EXPECT_NE(u8["digest"], ref["digest"]);
  EXPECT_TRUE(u8["fresh_first_batches_seconds"].empty());
}

// Memory is flat across epochs: what the loader and its workers hold after the first epoch (slots,
// decode buffers) is all they ever hold.
TEST(BenchLoaderCli, MemoryIsFlatAcrossEpochs) {
#ifdef FORKGUARD_SANITIZED_BUILD
  GTEST_SKIP() << "a sanitizer's runtime keeps freed memory (ASan's quarantine, TSan's shadow): "
                  "memory grows by design there";
#endif
  ft::TempDir dir;
  auto root = make_folder(dir.path() + "/imgs");
  for (const char* kind : {"thread", "process"}) {
    auto j = bench(root, {"--epochs", "6", "--workers", "2", "--worker-kind", kind});
    auto pss = j["epoch_pss_bytes"].get<std::vector<double>>();
    ASSERT_EQ(pss.size(), 6u) << kind;
    for (size_t e = 2; e < pss.size(); ++e) {
      EXPECT_LT(pss[e], pss[1] * 1.05 + 2e6) << kind << " epoch " << e << ": " << j.dump();
    }
  }
}

// Every kind of bad input, alone in an otherwise good folder: under `error` the run fails naming
// the file and what is wrong with it; under `skip` the file is counted once per epoch and replaced
// (the image count is unchanged: nothing is dropped).
TEST(BenchLoaderCli, EveryBadInputIsNamedUnderErrorAndCountedUnderSkip) {
  struct Bad {
    const char* file;
    std::function<void(const fs::path&)> make;
    const char* reason;
  };
  const std::vector<Bad> cases = {
      {"empty.jpg", [](const fs::path& p) { std::ofstream(p).close(); }, "empty file (0 bytes)"},
      {"notes.jpg", [](const fs::path& p) { std::ofstream(p) << "not an image at all"; },
       "not an image (neither JPEG nor PNG)"},
      {"cut.jpg",
       [](const fs::path& p) {
         write_jpeg(p, 300, 200, 1);
         fs::resize_file(p, fs::file_size(p) / 2);
       },
       "corrupt JPEG: truncated JPEG (premature end of data)"},
      {"garbled.jpg",
       [](const fs::path& p) {
         write_jpeg(p, 300, 200, 2);
         std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(4);
         for (int i = 0; i < 300; ++i) f.put(static_cast<char>(0x5a));
       },
       "corrupt JPEG: "},
      {"bomb.jpg",
       [](const fs::path& p) {
         // A real JPEG whose frame header claims 20000 x 20000 pixels (400 MP > 100 MP).
         write_jpeg(p, 64, 64, 3);
         std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
         std::vector<char> b((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
         for (size_t i = 0; i + 8 < b.size(); ++i) {
           if (static_cast<uint8_t>(b[i]) == 0xFF && static_cast<uint8_t>(b[i + 1]) == 0xC0) {
             f.seekp(static_cast<long>(i) + 5);
             const char dims[4] = {0x4E, 0x20, 0x4E, 0x20};
             f.write(dims, 4);
             break;
           }
         }
       },
       "20000x20000 = 400000000 pixels, more than max_pixels (100000000)"},
      {"gone.jpg", [](const fs::path& p) { fs::create_symlink(p.string() + ".missing", p); },
       "cannot open: No such file or directory"},
      // Opened, a FIFO waits for a writer forever: refused by its type.
      {"pipe.jpg", [](const fs::path& p) { ASSERT_EQ(::mkfifo(p.c_str(), 0600), 0); },
       "not a regular file (a FIFO)"},
      {"loop.jpg", [](const fs::path& p) { fs::create_symlink(p.filename(), p); },
       "cannot open: Too many levels of symbolic links"},
  };
  for (const auto& bad : cases) {
    ft::TempDir dir;
    auto root = make_folder(dir.path() + "/imgs");
    const fs::path file = fs::path(root) / "class_1" / bad.file;
    bad.make(file);
    for (const char* kind : {"thread", "process"}) {
      auto r = ft::run({ft::kForkguard, "bench", "loader", "--data", root, "--epochs", "1",
                        "--batch-size", "8", "--workers", "2", "--worker-kind", kind});
      EXPECT_NE(r.exit_code, 0) << bad.file;
      EXPECT_NE(r.err.find(file.string() + ": " + bad.reason), std::string::npos)
          << bad.file << " " << kind << ": " << r.err;
      auto skip = bench(root, {"--bad-sample", "skip", "--workers", "2", "--worker-kind", kind});
      EXPECT_EQ(skip["skipped"], 2) << bad.file << " " << kind;  // once per epoch
      EXPECT_EQ(skip["images"], 82) << bad.file << " " << kind;  // 41 a epoch, none dropped
    }
  }
}

// A dataset that is not there, or has nothing in it, is named before anything starts, whatever the
// bad-sample policy.
TEST(BenchLoaderCli, MissingOrEmptyDatasetIsNamed) {
  ft::TempDir dir;
  fs::create_directories(dir.path() + "/empty");
  fs::create_directories(dir.path() + "/no_images/class_0");
  std::ofstream(dir.path() + "/no_images/class_0/readme.txt") << "text";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {dir.path() + "/nowhere", "not a directory"},
      {dir.path() + "/empty", "no class directories"},
      {dir.path() + "/no_images", "no image files under any class"},
      {dir.path() + "/empty_class", "Found no valid file for the classes b, c. "}};
  fs::create_directories(dir.path() + "/empty_class/a");
  write_jpeg(dir.path() + "/empty_class/a/x.jpg", 64, 48, 1);
  fs::create_directories(dir.path() + "/empty_class/b");
  fs::create_directories(dir.path() + "/empty_class/c");
  std::ofstream(dir.path() + "/empty_class/c/readme.txt") << "text";
  for (const auto& [path, reason] : cases) {
    for (const char* policy : {"error", "skip"}) {
      auto r = ft::run({ft::kForkguard, "bench", "loader", "--data", path, "--bad-sample", policy});
      EXPECT_NE(r.exit_code, 0) << path;
      EXPECT_NE(r.err.find(path + ": " + reason), std::string::npos) << r.err;
    }
  }
}

// CLI11 reads "-1" into a size_t as 2^64-1: it ran "summed over 18446744073709551615 workers".
TEST(BenchCli, NegativeAndAbsurdWorkerCountsAreUsageErrors) {
  for (const char* bench : {"loader", "decode"}) {
    for (const char* workers : {"-1", "1025", "18446744073709551615", "two"}) {
      auto r =
          ft::run({ft::kForkguard, "bench", bench, "--data", "/nowhere", "--workers", workers});
      EXPECT_EQ(r.exit_code, 2) << bench << " " << workers << ": " << r.err;
      EXPECT_NE(r.err.find("--workers"), std::string::npos) << r.err;
      EXPECT_EQ(r.out.find("summed over"), std::string::npos) << r.out;
    }
  }
}

TEST(BenchCli, OtherCountsAreUsageErrorsWithAShortMessage) {
  // CLI11's own range check printed the whole double range (308 digits) for "abc".
  struct Case {
    const char* flag;
    const char* value;
    const char* says;
  };
  for (const auto& c :
       {Case{"--batch-size", "abc", "--batch-size is a whole number from 1 to 65536"},
        Case{"--batch-size", "0", "--batch-size is a whole number from 1 to 65536"},
        Case{"--epochs", "-1", "--epochs is a whole number from 1 to 1000000"},
        Case{"--fresh-loaders", "1e9", "--fresh-loaders is a whole number"}}) {
    auto r = ft::run({ft::kForkguard, "bench", "loader", "--data", "/nowhere", c.flag, c.value});
    EXPECT_EQ(r.exit_code, 2) << c.flag << " " << c.value << ": " << r.err;
    EXPECT_NE(r.err.find(c.says), std::string::npos) << r.err;
    EXPECT_LT(r.err.size(), 300u) << r.err;
  }
  auto r = ft::run({ft::kForkguard, "run", "--max-restarts", "-2", "--", "true"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--max-restarts is a whole number from 0 to 1000"), std::string::npos)
      << r.err;
}

// `forkguard bench` is the program forkguard-bench beside forkguard: flags and exit codes pass
// through both ways, and a forkguard without it says what is missing, where.
TEST(BenchCli, RunsForkguardBenchFromBesideForkguard) {
  auto help = ft::run({ft::kForkguard, "bench", "loader", "--help"});
  EXPECT_EQ(help.exit_code, 0) << help.err;
  EXPECT_NE(help.out.find("Usage: forkguard bench loader"), std::string::npos) << help.out;
  EXPECT_NE(help.out.find("--worker-kind"), std::string::npos) << help.out;
  auto none = ft::run({ft::kForkguard, "bench"});
  EXPECT_EQ(none.exit_code, 2) << none.err;

  ft::TempDir dir;
  const std::string alone = dir.path() + "/forkguard";
  fs::copy_file(ft::kForkguard, alone);
  auto r = ft::run({alone, "bench", "loader", "--data", "/nowhere"});
  EXPECT_EQ(r.exit_code, 127) << r.err;
  EXPECT_NE(r.err.find("cannot run " + dir.path() + "/forkguard-bench"), std::string::npos)
      << r.err;
  EXPECT_EQ(ft::run({alone, "--version"}).exit_code, 0) << "the rest works without it";
}

// `bench decode` reads every file in the main thread: a FIFO or a symlink loop among them is named,
// not a hang or an abort (exit 134).
TEST(BenchDecodeCli, FifosAndSymlinkLoopsAreNamed) {
  for (const char* name : {"pipe.jpg", "loop.jpg"}) {
    ft::TempDir dir;
    auto root = make_folder(dir.path() + "/imgs");
    const fs::path file = fs::path(root) / "class_2" / name;
    if (name[0] == 'p') {
      ASSERT_EQ(::mkfifo(file.c_str(), 0600), 0);
    } else {
      fs::create_symlink(file.filename(), file);
    }
    auto r = ft::run({ft::kForkguard, "bench", "decode", "--data", root, "--workers", "1"}, {},
                     std::chrono::seconds(20));
    EXPECT_EQ(r.exit_code, 1) << name << ": " << r.err;
    EXPECT_NE(r.err.find(file.string() + ": "), std::string::npos) << r.err;
  }
}

// The demo's rank program under `forkguard run`: two ranks, each with its process-worker loader,
// split the data set between them and hand their batches to the GPU (the test driver plays it)
// after initializing CUDA themselves; with --host they keep them on the host.
TEST(LoaderRanksDemo, TwoRanksUnderForkguardRunFeedTheirGpus) {
  ft::TempDir dir;
  auto root = make_folder(dir.path() + "/imgs");
  const std::string program = FORKGUARD_BIN_DIR "/loader_ranks";
  for (bool host : {false, true}) {
    std::vector<std::string> argv{ft::kForkguard, "run",   "--nproc-per-node", "2",
                                  "--",           program, "--data",           root,
                                  "--epochs",     "2",     "--batch-size",     "8"};
    if (host) argv.push_back("--host");
    auto r = ft::run(argv, ft::fake_cuda_env(dir.path()));
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    for (int rank : {0, 1}) {
      // 40 images, 2 ranks, 2 epochs: 40 each.
      const auto line = fmt::format("[rank{}]:rank {}: 40 images in ", rank, rank);
      EXPECT_NE(r.out.find(line), std::string::npos) << r.out;
    }
    const std::string where = host ? "to the host" : "to the GPU";
    EXPECT_NE(r.out.find(where), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("epoch 2/2 [##############################] 100%"), std::string::npos)
        << r.out;
  }
}
