#include "forkguard/data/image_folder.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>

#include "detail/fd.hpp"
#include "forkguard/data/error.hpp"
#include "process.hpp"
#include "test_images.hpp"

namespace fd = forkguard::data;
namespace fs = std::filesystem;
namespace ft = forkguard::testing;

namespace {

void write(const fs::path& p, const std::string& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << bytes;
}

}  // namespace

TEST(ImageFolder, ClassesAndFilesAreOrderedAsTorchvisionDoes) {
  forkguard::testing::TempDir dir;
  fs::path root = fs::path(dir.path()) / "train";
  write(root / "dog" / "b.jpg", "b");
  write(root / "dog" / "a.JPEG", "a");
  write(root / "dog" / "notes.txt", "ignored");
  write(root / "dog" / "sub" / "c.png", "c");
  write(root / "cat" / "z.png", "z");
  write(root / "README", "not a class");
  fd::ImageFolder ds(root.string());
  EXPECT_EQ(ds.classes(), (std::vector<std::string>{"cat", "dog"}));
  ASSERT_EQ(ds.size(), 4u);
  EXPECT_EQ(ds.key(0), (root / "cat" / "z.png").string());
  EXPECT_EQ(ds.key(1), (root / "dog" / "a.JPEG").string());
  EXPECT_EQ(ds.key(2), (root / "dog" / "b.jpg").string());
  EXPECT_EQ(ds.key(3), (root / "dog" / "sub" / "c.png").string());
  auto s = ds.read(2);
  EXPECT_EQ(std::string(s.data.begin(), s.data.end()), "b");
  EXPECT_EQ(s.label, 1);
  EXPECT_EQ(s.key, ds.key(2));
  auto rebuilt = fd::make_dataset(*ds.describe());
  EXPECT_EQ(rebuilt->key(3), ds.key(3));
}

// A worker rebuilds the dataset from its description: it carries its file list (the worker reads
// exactly the loader's files, without a scan); one without (a name JSON cannot carry) is scanned
// again and must match what the loader found, or the rebuild fails naming the root.
TEST(ImageFolder, DescriptionCarriesTheFilesOrChecksTheRescan) {
  forkguard::testing::TempDir dir;
  fs::path root = fs::path(dir.path()) / "train";
  for (int i = 0; i < 5; ++i) write(root / (i < 3 ? "cat" : "dog") / fmt::format("{}.jpg", i), "x");
  fd::ImageFolder ds(root.string());
  auto d = *ds.describe();
  ASSERT_TRUE(d.params.contains("paths"));
  fs::remove(root / "cat" / "1.jpg");  // after the loader's scan: the list still names it
  write(root / "dog" / "9.jpg", "x");
  auto rebuilt = fd::make_dataset(d);
  ASSERT_EQ(rebuilt->size(), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(rebuilt->key(i), ds.key(i));
  EXPECT_EQ(dynamic_cast<fd::ImageFolder&>(*rebuilt).classes(), ds.classes());
  auto s = rebuilt->read(4);
  EXPECT_EQ(s.label, 1);
  // Without the list (as for a name that is not UTF-8): the rescan finds 5 other files.
  d.params.erase("paths");
  d.params.erase("labels");
  try {
    fd::make_dataset(d);
    ADD_FAILURE() << "a changed tree was accepted";
  } catch (const fd::DataError& e) {
    EXPECT_NE(std::string(e.what()).find(root.string() + ": changed since the loader listed it"),
              std::string::npos)
        << e.what();
  }
  fd::ImageFolder now(root.string());
  auto same = *now.describe();
  same.params.erase("paths");
  same.params.erase("labels");
  EXPECT_EQ(fd::make_dataset(same)->size(), 5u);  // unchanged since: the rescan is accepted
  // A name that is not UTF-8 cannot travel in JSON: no list, the worker scans (and checks).
  write(root / "dog" / "\xff.jpg", "x");
  fd::ImageFolder odd(root.string());
  auto d2 = *odd.describe();
  EXPECT_FALSE(d2.params.contains("paths"));
  EXPECT_NO_THROW((void)d2.params.dump());
  auto again = fd::make_dataset(d2);
  ASSERT_EQ(again->size(), odd.size());
  for (size_t i = 0; i < odd.size(); ++i) EXPECT_EQ(again->key(i), odd.key(i));
}

// Bytes a loose UTF-8 check took for UTF-8 (found by tests/fuzz/file_list_fuzz.cpp: a 0xF6 lead
// byte): each name stays out of the description's JSON list, whose dump() threw type_error 316.
TEST(FileList, NamesThatAreNotStrictUtf8DescribeWithoutTheList) {
  forkguard::testing::TempDir dir;
  for (const char* name : {"\xf6\x8f\xae\xb0.jpg", "\xc0\xaf.jpg", "\xed\xa0\x80.jpg",
                           "\xf4\x90\x80\x80.jpg", "\xe0\x80\xaf.jpg"}) {
    const fs::path list = fs::path(dir.path()) / "list.txt";
    write(list, std::string(name) + " 3\n");
    fd::FileList files(list.string());
    const auto d = *files.describe();
    EXPECT_FALSE(d.params.contains("paths")) << name;
    EXPECT_NO_THROW((void)d.params.dump()) << name;
  }
  // Valid UTF-8 of every length still travels in the list.
  const fs::path list = fs::path(dir.path()) / "ok.txt";
  write(list, "caf\xc3\xa9-\xe2\x82\xac-\xf0\x9f\x98\x80.jpg 1\n");
  EXPECT_TRUE(fd::FileList(list.string()).describe()->params.contains("paths"));
}

TEST(ImageFolder, BadRootsAndFilesAreNamed) {
  forkguard::testing::TempDir dir;
  fs::path root = fs::path(dir.path());
  EXPECT_NE(ft::data_error_of([&] {
              fd::ImageFolder((root / "missing").string());
            }).find((root / "missing").string() + ": not a directory"),
            std::string::npos);
  fs::create_directories(root / "empty");
  EXPECT_NE(ft::data_error_of([&] {
              fd::ImageFolder((root / "empty").string());
            }).find("no class directories"),
            std::string::npos);
  fs::create_directories(root / "noimg" / "a");
  write(root / "noimg" / "a" / "x.txt", "x");
  EXPECT_NE(
      ft::data_error_of([&] { fd::ImageFolder((root / "noimg").string()); }).find("no image files"),
      std::string::npos);
  write(root / "ok" / "a" / "zero.jpg", "");
  fd::ImageFolder ds((root / "ok").string());
  EXPECT_EQ(ft::data_error_of([&] { ds.read(0); }),
            (root / "ok" / "a" / "zero.jpg").string() + ": empty file (0 bytes)");
  if (::geteuid() != 0) {  // root reads anything
    write(root / "ok" / "a" / "zero.jpg", "x");
    ::chmod((root / "ok" / "a" / "zero.jpg").c_str(), 0);
    EXPECT_NE(ft::data_error_of([&] { ds.read(0); }).find("cannot open: Permission denied"),
              std::string::npos);
  }
}

// A FIFO, a socket or a device named like an image is refused by its type before it is opened:
// opening a FIFO waits for a writer forever (the loader hung, thread workers stuck in open()).
TEST(ImageFolder, SpecialFilesAreRefusedByTypeBeforeTheyAreOpened) {
  forkguard::testing::TempDir dir;
  const fs::path root = fs::path(dir.path()) / "train";
  write(root / "a" / "ok.jpg", "x");
  const fs::path fifo = root / "a" / "pipe.jpg";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const fs::path sock = root / "b" / "sock.png";
  fs::create_directories(sock.parent_path());
  {
    forkguard::detail::UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    ASSERT_LT(sock.string().size(), sizeof addr.sun_path);
    std::strcpy(addr.sun_path, sock.c_str());
    ASSERT_EQ(::bind(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  }
  fd::ImageFolder ds(root.string());
  ASSERT_EQ(ds.size(), 3u);  // listed as torchvision lists them; refused when read
  ASSERT_EQ(ds.key(1), fifo.string());
  auto read_fifo =
      std::async(std::launch::async, [&] { return ft::data_error_of([&] { ds.read(1); }); });
  if (read_fifo.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "read() of a FIFO hangs";
    // Be the writer it waits for, so that the test ends.
    forkguard::detail::UniqueFd w(::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC));
  }
  EXPECT_EQ(read_fifo.get(), fifo.string() + ": not a regular file (a FIFO)");
  EXPECT_EQ(ft::data_error_of([&] { ds.read(2); }),
            sock.string() + ": not a regular file (a socket)");
  // A file list naming a device: refused without opening it.
  write(root / "list.txt", "/dev/null 0\nb/sock.png 1\n");
  fd::FileList list((root / "list.txt").string());
  EXPECT_EQ(ft::data_error_of([&] { list.read(0); }),
            "/dev/null: not a regular file (a character device)");
  EXPECT_EQ(ft::data_error_of([&] { list.read(1); }),
            sock.string() + ": not a regular file (a socket)");
}

// A symlink loop named like an image is a sample that cannot be read, named with its path (as
// torchvision's os.walk lists it); a loop where a class directory would be fails the scan naming
// it. Neither may escape as std::filesystem_error (the CLI aborted: exit 134).
TEST(ImageFolder, SymlinkLoopsAreNamedWithTheirPath) {
  forkguard::testing::TempDir dir;
  const fs::path root = fs::path(dir.path()) / "train";
  write(root / "a" / "ok.jpg", "x");
  fs::create_directories(root / "b");
  write(root / "b" / "y.jpg", "y");
  const fs::path loop = root / "b" / "z.jpg";
  fs::create_symlink("z.jpg", loop);
  std::optional<fd::ImageFolder> ds;
  EXPECT_EQ(ft::data_error_of([&] { ds.emplace(root.string()); }), "(no error)");
  ASSERT_TRUE(ds.has_value());
  ASSERT_EQ(ds->size(), 3u);
  EXPECT_EQ(ds->key(2), loop.string());
  EXPECT_EQ(ft::data_error_of([&] { ds->read(2); }),
            loop.string() + ": cannot open: Too many levels of symbolic links");
  EXPECT_EQ(ds->read(1).label, 1);
  fs::create_symlink("c", root / "c");
  EXPECT_EQ(ft::data_error_of([&] { fd::ImageFolder again(root.string()); }),
            (root / "c").string() + ": cannot stat: Too many levels of symbolic links");
}

// A class directory with no image (or one that cannot be read) is an error naming it, as
// torchvision's: without it, the loader trains without that class. allow_empty accepts it.
TEST(ImageFolder, ClassesWithoutImagesAreNamedUnlessAllowed) {
  forkguard::testing::TempDir dir;
  const fs::path root = fs::path(dir.path()) / "train";
  write(root / "a" / "x.jpg", "x");
  fs::create_directories(root / "b");
  write(root / "c" / "readme.txt", "not an image");
  write(root / "d" / "deep" / "y.png", "y");
  EXPECT_EQ(ft::data_error_of([&] { fd::ImageFolder ds(root.string()); }),
            root.string() +
                ": Found no valid file for the classes b, c. Supported extensions are: .jpg, "
                ".jpeg, .png, .ppm, .bmp, .pgm, .tif, .tiff, .webp (an unreadable class directory "
                "counts as empty; ImageFolderOptions::allow_empty accepts them)");
  fd::ImageFolder ds(root.string(), {.allow_empty = true});
  EXPECT_EQ(ds.classes(), (std::vector<std::string>{"a", "b", "c", "d"}));
  ASSERT_EQ(ds.size(), 2u);
  EXPECT_EQ(ds.read(1).label, 3);  // labels keep the classes' positions
  // A worker that scans again (no list in the description) accepts them too.
  auto d = *ds.describe();
  d.params.erase("paths");
  d.params.erase("labels");
  EXPECT_EQ(fd::make_dataset(d)->size(), 2u);
}

TEST(FileList, PathsAreRelativeToTheListAndLinesAreChecked) {
  forkguard::testing::TempDir dir;
  fs::path root = fs::path(dir.path());
  write(root / "img" / "a.jpg", "A");
  write(root / "list.txt",
        "# comment\nimg/a.jpg 7\n\n" + (root / "img" / "a.jpg").string() + " 3\n");
  fd::FileList ds((root / "list.txt").string());
  ASSERT_EQ(ds.size(), 2u);
  EXPECT_EQ(ds.read(0).label, 7);
  EXPECT_EQ(ds.key(0), (root / "img" / "a.jpg").string());
  EXPECT_EQ(ds.read(1).label, 3);
  write(root / "bad.txt", "img/a.jpg seven\n");
  EXPECT_EQ(ft::data_error_of([&] { fd::FileList((root / "bad.txt").string()); }),
            (root / "bad.txt").string() + ":1: expected \"path label\", got \"img/a.jpg seven\"");
  // strtoll clamped these to the int64 limits: a label silently changed.
  for (const char* label :
       {"9223372036854775808", "-9223372036854775809", "99999999999999999999"}) {
    write(root / "huge.txt", std::string("img/a.jpg 1\nimg/a.jpg ") + label + "\n");
    EXPECT_EQ(ft::data_error_of([&] { fd::FileList((root / "huge.txt").string()); }),
              (root / "huge.txt").string() + ":2: label " + label +
                  " is out of range (a 64-bit signed integer)");
  }
  write(root / "max.txt", "img/a.jpg 9223372036854775807\nimg/a.jpg -9223372036854775808\n");
  fd::FileList extremes((root / "max.txt").string());
  EXPECT_EQ(extremes.read(0).label, INT64_MAX);
  EXPECT_EQ(extremes.read(1).label, INT64_MIN);
  write(root / "none.txt", "\n# nothing\n");
  EXPECT_NE(ft::data_error_of([&] {
              fd::FileList((root / "none.txt").string());
            }).find("no samples listed"),
            std::string::npos);
}
