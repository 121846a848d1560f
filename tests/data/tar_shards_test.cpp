// WebDataset tar shards, written here by real tools: Python's tarfile (Debian's /usr/bin/python3:
// ustar, GNU and pax formats) and GNU tar, from JPEG and PNG files made with libjpeg and libpng.
#include "forkguard/data/tar_shards.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <png.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include <jpeglib.h>

#include "detail/fd.hpp"
#include "forkguard/data/error.hpp"
#include "forkguard/data/image_transform.hpp"
#include "forkguard/data/loader.hpp"
#include "paths.hpp"
#include "process.hpp"
#include "test_images.hpp"

namespace fd = forkguard::data;
namespace ft = forkguard::testing;
namespace fs = std::filesystem;

namespace {

using Bytes = std::vector<unsigned char>;

Bytes jpeg(int w, int h, int seed) {
  return ft::encode_jpeg(ft::gradient_picture(w, h, seed), w, h);
}

Bytes png(int w, int h, int seed) {
  return ft::encode_png(ft::gradient_picture(w, h, seed).data(), w, h, PNG_FORMAT_RGB);
}

Bytes text(const std::string& s) {
  return Bytes(s.begin(), s.end());
}

void write(const fs::path& p, const Bytes& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
}

// Members (name -> bytes) in the order they go into the tar.
using Members = std::vector<std::pair<std::string, Bytes>>;

// Writes the members under staging/ and archives them, in order, with `tool`: "ustar", "gnu",
// "pax" (Python's tarfile formats) or "gnutar" (GNU tar's default format), "gnutar-posix".
// Python's pax shard also carries a pax size record for every member.
void make_tar(const fs::path& tar, const fs::path& staging, const Members& members,
              const std::string& tool) {
  std::vector<std::string> names;
  for (const auto& [name, bytes] : members) {
    if (name.back() == '/') {
      fs::create_directories(staging / name);
    } else {
      write(staging / name, bytes);
    }
    names.push_back(name.back() == '/' ? name.substr(0, name.size() - 1) : name);
  }
  std::vector<std::string> argv;
  if (tool == "gnutar" || tool == "gnutar-posix") {
    argv = {"/usr/bin/tar", "--no-recursion", "-cf", tar.string(), "-C", staging.string()};
    if (tool == "gnutar-posix") argv.insert(argv.begin() + 1, "--format=posix");
  } else {
    static const char* const kScript = R"(
import sys, tarfile
out, fmt, src = sys.argv[1:4]
formats = {'ustar': tarfile.USTAR_FORMAT, 'gnu': tarfile.GNU_FORMAT, 'pax': tarfile.PAX_FORMAT}
def pax_size(ti):
    if fmt == 'pax' and ti.isreg():
        ti.pax_headers = {'size': str(ti.size), 'comment': 'written by tarfile'}
    return ti
with tarfile.open(out, 'w', format=formats[fmt]) as t:
    for name in sys.argv[4:]:
        t.add(src + '/' + name, arcname=name, recursive=False, filter=pax_size)
)";
    argv = {"/usr/bin/python3", "-c", kScript, tar.string(), tool, staging.string()};
  }
  argv.insert(argv.end(), names.begin(), names.end());
  auto r = ft::run(argv);
  ASSERT_EQ(r.exit_code, 0) << tool << ": " << r.err;
}

#define EXPECT_CONTAINS(haystack, needle)                                  \
  do {                                                                     \
    const std::string h_ = (haystack);                                     \
    EXPECT_NE(h_.find(needle), std::string::npos) << "in: " << h_ << "\n"; \
  } while (0)

// A sample of a shard: its key, its image's extension and bytes, its label.
struct Expected {
  std::string key;
  std::string ext;
  Bytes image;
  int64_t label;
};

// `n` good samples "<prefix>NNNN" (JPEG, every third a PNG), each with a .cls and a .json.
std::vector<Expected> good_samples(const std::string& prefix, int n, int seed) {
  std::vector<Expected> out;
  for (int i = 0; i < n; ++i) {
    const bool is_png = i % 3 == 2;
    const int s = seed + i;
    out.push_back({fmt::format("{}{:04}", prefix, i), is_png ? "png" : "jpg",
                   is_png ? png(40 + i, 30 + i, s) : jpeg(260 + 3 * i, 240 + 2 * i, s),
                   static_cast<int64_t>((s * 7) % 11)});
  }
  return out;
}

Members members_of(const std::vector<Expected>& samples) {
  Members m;
  for (const auto& s : samples) {
    // WebDataset's writers emit a sample's members together; the order within one varies.
    m.push_back({s.key + ".cls", text(std::to_string(s.label) + "\n")});
    m.push_back({s.key + "." + s.ext, s.image});
    m.push_back({s.key + ".json", text("{\"id\": \"" + s.key + "\"}")});
  }
  return m;
}

// Three shards shard-00000{0,1,2}.tar of 8 samples each; returns the brace pattern.
std::string make_three_shards(const fs::path& dir, std::vector<Expected>* all = nullptr) {
  for (int k = 0; k < 3; ++k) {
    auto samples = good_samples(fmt::format("s{}_", k), 8, 10 * k);
    make_tar(dir / fmt::format("shard-{:06}.tar", k), dir / fmt::format("staging{}", k),
             members_of(samples), k == 1 ? "gnutar" : "pax");
    if (all) all->insert(all->end(), samples.begin(), samples.end());
  }
  return (dir / "shard-{000000..000002}.tar").string();
}

}  // namespace

TEST(TarShards, ReadsEveryTarFormatWithLongNamesAndSkipsNonRegularEntries) {
  ft::TempDir dir;
  const fs::path root(dir.path());
  // Over 100 characters, with a '/' so that ustar can split it into prefix and name.
  const std::string long_key = std::string(70, 'd') + "/" + std::string(60, 'n') + "_long";
  for (const std::string tool : {"ustar", "gnu", "pax", "gnutar", "gnutar-posix"}) {
    SCOPED_TRACE(tool);
    auto samples = good_samples("img_", 5, 1);
    samples.push_back({long_key, "jpg", jpeg(300, 200, 9), 42});
    samples.push_back({"caps", "JPEG", jpeg(256, 256, 3), -3});  // extensions are lowercased
    Members members = members_of(samples);
    members.insert(members.begin(), {"notes/", {}});  // a directory entry: skipped
    members.push_back({"README", text("no extension: not a member of any sample")});
    const fs::path tar = root / (tool + ".tar");
    make_tar(tar, root / ("staging-" + tool), members, tool);

    fd::TarShards ds(tar.string());
    ASSERT_EQ(ds.size(), samples.size());
    EXPECT_EQ(ds.shards(), std::vector<std::string>{tar.string()});
    for (size_t i = 0; i < samples.size(); ++i) {
      EXPECT_EQ(ds.key(i), tar.string() + ":" + samples[i].key);
      auto s = ds.read(i);
      EXPECT_EQ(s.key, ds.key(i));
      EXPECT_EQ(s.label, samples[i].label) << samples[i].key;
      EXPECT_TRUE(s.data == samples[i].image) << samples[i].key << ": " << s.data.size()
                                              << " bytes, expected " << samples[i].image.size();
    }
  }
}

TEST(TarShards, BracePatternsDirectoriesAndDescribe) {
  ft::TempDir dir;
  const fs::path root(dir.path());
  std::vector<Expected> all;
  const std::string pattern = make_three_shards(root, &all);
  fd::TarShards ds(pattern);
  ASSERT_EQ(ds.size(), 24u);
  ASSERT_EQ(ds.shards().size(), 3u);
  EXPECT_EQ(ds.shards()[2], (root / "shard-000002.tar").string());
  EXPECT_EQ(ds.key(9), (root / "shard-000001.tar").string() + ":s1_0001");
  for (size_t i = 0; i < ds.size(); ++i) {
    auto s = ds.read(i);
    EXPECT_EQ(s.label, all[i].label);
    EXPECT_TRUE(s.data == all[i].image) << ds.key(i);
  }
  // Rebuilt from its description, as a fork-server worker does.
  auto rebuilt = fd::make_dataset(*ds.describe());
  ASSERT_EQ(rebuilt->size(), 24u);
  EXPECT_EQ(rebuilt->key(23), ds.key(23));
  EXPECT_TRUE(rebuilt->read(17).data == all[17].image);

  // A list, several groups, a directory.
  EXPECT_EQ(fd::TarShards((root / "shard-00000{2,0}.tar").string()).key(0),
            (root / "shard-000002.tar").string() + ":s2_0000");
  EXPECT_EQ(fd::TarShards(root.string()).shards(), ds.shards());
  EXPECT_EQ(fd::expand_shard_pattern("a/{8..11}-{x,y}.tar"),
            (std::vector<std::string>{"a/8-x.tar", "a/8-y.tar", "a/9-x.tar", "a/9-y.tar",
                                      "a/10-x.tar", "a/10-y.tar", "a/11-x.tar", "a/11-y.tar"}));
  EXPECT_EQ(fd::expand_shard_pattern("{098..100}.tar"),
            (std::vector<std::string>{"098.tar", "099.tar", "100.tar"}));
  EXPECT_CONTAINS(ft::data_error_of([] { fd::expand_shard_pattern("s-{3..1}.tar"); }),
                  "\"s-{3..1}.tar\": {3..1}: the range is empty");
  EXPECT_CONTAINS(ft::data_error_of([] { fd::expand_shard_pattern("s-{000..9.tar"); }),
                  "'{' without '}'");
  EXPECT_CONTAINS(ft::data_error_of([] { fd::expand_shard_pattern("s-{abc}.tar"); }),
                  "expected {first..last} or {a,b,...}");
  // Groups multiply: 10^12 names were allocated for (tests/fuzz/shard_pattern_fuzz.cpp).
  EXPECT_CONTAINS(ft::data_error_of([] { fd::expand_shard_pattern("{0..999999}{0..999999}.tar"); }),
                  "names more than 1000000 shards");
  EXPECT_EQ(fd::expand_shard_pattern("{0..999}{0..999}.tar").size(), 1'000'000u);
}

// A FIFO named like a shard is refused, not waited on: open() of a FIFO blocks until a writer
// comes, so it is opened O_NONBLOCK and its type checked.
TEST(TarShards, AFifoNamedLikeAShardIsRefusedNotWaitedOn) {
  ft::TempDir dir;
  const fs::path fifo = fs::path(dir.path()) / "pipe.tar";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto index = std::async(std::launch::async, [&] {
    return ft::data_error_of([&] { fd::TarShards shards(fifo.string()); });
  });
  if (index.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "indexing a FIFO hangs";
    // Be the writer it waits for, so that the test ends.
    forkguard::detail::UniqueFd w(::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC));
  }
  EXPECT_EQ(index.get(), fifo.string() + ": not a regular file");
}

TEST(TarShards, MissingUnreadableAndCorruptShardsFailConstructionNamingTheShard) {
  ft::TempDir dir;
  const fs::path root(dir.path());
  const std::string pattern = make_three_shards(root);
  const std::string shard1 = (root / "shard-000001.tar").string();

  EXPECT_CONTAINS(ft::data_error_of([&] { fd::TarShards((root / "nope-{0..3}.tar").string()); }),
                  "nope-{0..3}.tar\": the pattern matches no file");
  EXPECT_CONTAINS(
      ft::data_error_of([&] { fd::TarShards((root / "shard-{000000..000003}.tar").string()); }),
      (root / "shard-000003.tar").string() +
          ": cannot open shard: No such file or directory (from \"");
  EXPECT_CONTAINS(ft::data_error_of([&] { fd::TarShards((root / "missing.tar").string()); }),
                  (root / "missing.tar").string() + ": cannot open shard: No such file");
  fs::create_directories(root / "empty");
  EXPECT_CONTAINS(ft::data_error_of([&] { fd::TarShards((root / "empty").string()); }),
                  (root / "empty").string() + ": no *.tar files in this directory");
  EXPECT_CONTAINS(
      ft::data_error_of([&] { fd::TarShards((root / "shard-00000{0,1,0}.tar").string()); }),
      "the shard " + (root / "shard-000000.tar").string() + " is named twice");

  // Not a tar at all: a JPEG under a .tar name.
  write(root / "photo.tar", jpeg(64, 64, 1));
  EXPECT_CONTAINS(
      ft::data_error_of([&] { fd::TarShards((root / "photo.tar").string()); }),
      (root / "photo.tar").string() + ": bad tar header checksum at offset 0 (stored unreadable");
  write(root / "zero.tar", {});
  EXPECT_CONTAINS(ft::data_error_of([&] { fd::TarShards((root / "zero.tar").string()); }),
                  "zero.tar: empty file (0 bytes), not a tar");

  // A flipped byte in the second member's header (at 512 + the first member's padded data).
  std::ifstream in(shard1, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t first_size = std::stoul(bytes.substr(124, 11), nullptr, 8);
  const size_t second = 512 + (first_size + 511) / 512 * 512;
  std::string corrupt = bytes;
  corrupt[second + 3] ^= 0x20;  // in the name
  write(root / "corrupt.tar", text(corrupt));
  EXPECT_CONTAINS(ft::data_error_of([&] { fd::TarShards((root / "corrupt.tar").string()); }),
                  fmt::format("{}: bad tar header checksum at offset {}",
                              (root / "corrupt.tar").string(), second));

  // Truncated inside a member's data, and at a member boundary (no end-of-archive blocks).
  write(root / "cut.tar", text(bytes.substr(0, second + 512 + 100)));
  EXPECT_CONTAINS(ft::data_error_of([&] { fd::TarShards((root / "cut.tar").string()); }),
                  fmt::format("{}: member \"s1_0000.jpg\" at offset {}: its ",
                              (root / "cut.tar").string(), second));
  EXPECT_CONTAINS(ft::data_error_of([&] { fd::TarShards((root / "cut.tar").string()); }),
                  "run past the end of the file");
  write(root / "boundary.tar", text(bytes.substr(0, second)));
  EXPECT_CONTAINS(
      ft::data_error_of([&] { fd::TarShards((root / "boundary.tar").string()); }),
      fmt::format("{}: the file ends at offset {} without the end-of-archive blocks: truncated",
                  (root / "boundary.tar").string(), second));

  // A shard in the middle of the pattern that cannot be read.
  fs::create_directories(root / "dir.tar");
  EXPECT_CONTAINS(
      ft::data_error_of([&] { fd::TarShards((root / "{shard-000000,dir}.tar").string()); }),
      (root / "dir.tar").string() + ": not a regular file (from \"");
  if (::geteuid() != 0) {  // root reads anything
    ::chmod(shard1.c_str(), 0);
    EXPECT_CONTAINS(ft::data_error_of([&] { fd::TarShards{pattern}; }),
                    shard1 + ": cannot open shard: Permission denied (from \"" + pattern + "\")");
    ::chmod(shard1.c_str(), 0644);
  }

  // Members of one key not consecutive: `tar -cf s.tar *.jpg *.cls` order.
  auto samples = good_samples("k", 2, 0);
  Members scattered = {{"k0000.jpg", samples[0].image},
                       {"k0001.jpg", samples[1].image},
                       {"k0000.cls", text("1")},
                       {"k0001.cls", text("2")}};
  make_tar(root / "scattered.tar", root / "staging-scattered", scattered, "gnutar");
  EXPECT_CONTAINS(ft::data_error_of([&] { fd::TarShards((root / "scattered.tar").string()); }),
                  (root / "scattered.tar").string() + ": member \"k0000.cls\" at offset ");
  EXPECT_CONTAINS(ft::data_error_of([&] { fd::TarShards((root / "scattered.tar").string()); }),
                  ": key \"k0000\" appears again after other keys (first at offset 0): a "
                  "sample's members must be consecutive");
}

TEST(TarShards, SamplesWithoutImageOrLabelOrWithABadLabelFailAtRead) {
  ft::TempDir dir;
  const fs::path root(dir.path());
  auto samples = good_samples("g", 4, 0);
  Members m = members_of(samples);
  m.push_back({"noimage.cls", text("3")});
  m.push_back({"noimage.json", text("{}")});
  m.push_back({"nolabel.jpg", samples[0].image});
  m.push_back({"badlabel.cls", text("cat\n")});
  m.push_back({"badlabel.jpg", samples[1].image});
  m.push_back({"emptyimage.cls", text(" 5 ")});
  m.push_back({"emptyimage.png", {}});
  const fs::path tar = root / "bad.tar";
  make_tar(tar, root / "staging", m, "pax");
  fd::TarShards ds(tar.string());
  ASSERT_EQ(ds.size(), 8u);
  EXPECT_EQ(ds.read(3).label, samples[3].label);
  const std::string t = tar.string();
  EXPECT_CONTAINS(ft::data_error_of([&] { ds.read(4); }), t + ": sample \"noimage\" (offset ");
  EXPECT_CONTAINS(ft::data_error_of([&] { ds.read(4); }),
                  "): no image member (.jpg, .jpeg or .png); its members: .cls .json");
  EXPECT_CONTAINS(ft::data_error_of([&] { ds.read(5); }), t + ": sample \"nolabel\" (offset ");
  EXPECT_CONTAINS(ft::data_error_of([&] { ds.read(5); }),
                  "no .cls member (the label); its members: .jpg");
  EXPECT_CONTAINS(ft::data_error_of([&] { ds.read(6); }),
                  t + ": sample \"badlabel\": bad .cls member at offset ");
  EXPECT_CONTAINS(ft::data_error_of([&] { ds.read(6); }), "\"cat\\x0a\" is not an integer label");
  EXPECT_CONTAINS(ft::data_error_of([&] { ds.read(7); }),
                  t + ": sample \"emptyimage\": the image member \"emptyimage.png\" at offset ");
  EXPECT_EQ(ds.key(6), t + ":badlabel");
}

TEST(TarShards, TheLoaderSkipsAndNamesBadSamples) {
  ft::TempDir dir;
  const fs::path root(dir.path());
  auto samples = good_samples("g", 10, 0);
  Members m = members_of(samples);
  m.insert(m.begin() + 6, {"noimage.cls", text("3")});
  m.push_back({"badlabel.cls", text("1.5")});
  m.push_back({"badlabel.jpg", samples[1].image});
  const fs::path tar = root / "mixed.tar";
  make_tar(tar, root / "staging", m, "gnu");
  auto ds = std::make_shared<fd::TarShards>(tar.string());
  ASSERT_EQ(ds->size(), 12u);
  auto tf = std::make_shared<fd::ImageTransform>(
      fd::ImageOptions{.train = false, .size = 32, .resize = 32, .dtype = fd::DType::kUInt8});
  std::vector<std::string> log;
  fd::LoaderOptions o{.batch_size = 5,
                      .workers = 2,
                      .bad_sample = fd::BadSample::kSkip,
                      .seed = 7,
                      .shuffle = true};
  o.log = [&](const std::string& line) { log.push_back(line); };
  fd::Loader loader(ds, tf, o);
  std::map<std::string, std::string> skipped;  // key -> reason
  size_t delivered = 0;
  while (auto b = loader.next()) {
    delivered += b->size();
    for (const auto& s : b->skipped()) skipped[s.key] = s.reason;
  }
  EXPECT_EQ(delivered, 12u);  // replaced, not dropped
  EXPECT_EQ(loader.stats().skipped, 2u);
  ASSERT_EQ(skipped.size(), 2u);
  EXPECT_CONTAINS(skipped[tar.string() + ":noimage"], "no image member");
  EXPECT_CONTAINS(skipped[tar.string() + ":badlabel"], "\"1.5\" is not an integer label");
  EXPECT_EQ(log.size(), 2u);

  // Under `error` the first bad sample stops the epoch, named.
  fd::Loader strict(ds, tf, {.batch_size = 12});
  try {
    strict.next();
    ADD_FAILURE() << "no error";
  } catch (const fd::DataError& e) {
    EXPECT_CONTAINS(e.what(), tar.string() + ":noimage");
    EXPECT_CONTAINS(e.what(), "no image member");
  }
}

TEST(TarShards, BenchLoaderDigestIsTheSameForThreadAndProcessWorkers) {
  ft::TempDir dir;
  const std::string pattern = make_three_shards(fs::path(dir.path()));
  auto bench = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv{
        ft::kForkguard, "bench", "loader",       "--data", pattern,    "--format", "wds",
        "--epochs",     "2",     "--batch-size", "8",      "--digest", "--json"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto r = ft::run(argv);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(r.out.empty() ? std::string("{}") : r.out);
  };
  auto one = bench({"--workers", "1"});
  ASSERT_TRUE(one.contains("digest"));
  EXPECT_EQ(one["images"], 48);
  EXPECT_EQ(one["skipped"], 0);
  auto process = bench({"--workers", "2", "--worker-kind", "process"});
  EXPECT_EQ(process["digest"], one["digest"]);
  EXPECT_EQ(process["images"], 48);

  // The decode ceiling reads the same samples.
  auto r =
      ft::run({ft::kForkguard, "bench", "decode", "--data", pattern, "--format", "wds", "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_CONTAINS(r.out, "\"images\":24");
}
