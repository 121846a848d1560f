// `forkguard bench loader` on a small ImageFolder made here: the digest does not depend on the
// number or kind of workers; bad files are skipped and counted, or named in the error.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include <jpeglib.h>

#include "paths.hpp"
#include "process.hpp"

namespace ft = forkguard::testing;
namespace fs = std::filesystem;

namespace {

void write_jpeg(const fs::path& path, int w, int h, int seed) {
  std::vector<uint8_t> rgb(static_cast<size_t>(w) * h * 3);
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      uint8_t* p = &rgb[(static_cast<size_t>(y) * w + x) * 3];
      p[0] = static_cast<uint8_t>((x * 255) / w + seed);
      p[1] = static_cast<uint8_t>((y * 255) / h);
      p[2] = static_cast<uint8_t>(128 + 100 * std::sin((x + seed) * 0.1));
    }
  }
  jpeg_compress_struct c{};
  jpeg_error_mgr err{};
  c.err = jpeg_std_error(&err);
  jpeg_create_compress(&c);
  FILE* f = std::fopen(path.c_str(), "wb");
  jpeg_stdio_dest(&c, f);
  c.image_width = static_cast<JDIMENSION>(w);
  c.image_height = static_cast<JDIMENSION>(h);
  c.input_components = 3;
  c.in_color_space = JCS_RGB;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, 90, TRUE);
  jpeg_start_compress(&c, TRUE);
  while (c.next_scanline < c.image_height) {
    JSAMPROW row = &rgb[static_cast<size_t>(c.next_scanline) * w * 3];
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  jpeg_destroy_compress(&c);
  std::fclose(f);
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
  for (auto extra : std::vector<std::vector<std::string>>{
           {"--workers", "2"},
           {"--workers", "2", "--worker-kind", "process"},
           {"--workers", "1", "--worker-kind", "process", "--dtype", "float32"}}) {
    EXPECT_EQ(bench(root, extra)["digest"], ref["digest"]) << extra[1];
  }
  EXPECT_NE(bench(root, {"--dtype", "uint8"})["digest"], ref["digest"]);
}

TEST(BenchLoaderCli, BadFilesAreSkippedAndCountedOrNamed) {
  ft::TempDir dir;
  auto root = make_folder(dir.path() + "/imgs");
  std::ofstream(root + "/class_1/empty.jpg").close();
  std::ofstream(root + "/class_2/notes.jpg") << "not an image at all";
  auto skip = bench(root, {"--bad-sample", "skip", "--workers", "2"});
  EXPECT_EQ(skip["skipped"], 4);  // two bad files, two epochs
  EXPECT_EQ(skip["images"], 84);  // 42 files a epoch: the bad ones replaced, none dropped
  auto r = ft::run({ft::kForkguard, "bench", "loader", "--data", root, "--epochs", "1"});
  EXPECT_NE(r.exit_code, 0);
  const bool named = r.err.find("class_1/empty.jpg: empty file (0 bytes)") != std::string::npos ||
                     r.err.find("class_2/notes.jpg: not an image") != std::string::npos;
  EXPECT_TRUE(named) << r.err;
}
