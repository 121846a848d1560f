#include "forkguard/data/image_folder.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string_view>

#include "detail/fd.hpp"
#include "detail/fnv.hpp"
#include "forkguard/data/error.hpp"

namespace forkguard::data {
namespace fs = std::filesystem;
namespace {

// torchvision's IMG_EXTENSIONS, in its order.
constexpr std::string_view kExtensions[] = {".jpg", ".jpeg", ".png",  ".ppm", ".bmp",
                                            ".pgm", ".tif",  ".tiff", ".webp"};

bool is_image(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return std::any_of(std::begin(kExtensions), std::end(kExtensions),
                     [&](std::string_view e) { return ext == e; });
}

uint64_t digest_of(const std::vector<ImageFile>& files) {
  uint64_t h = forkguard::detail::kFnvOffset;
  for (const auto& f : files) {
    // With the terminating NUL: "ab" + "c" != "a" + "bc".
    h = forkguard::detail::fnv1a(f.path.c_str(), f.path.size() + 1, h);
    h = forkguard::detail::fnv1a(&f.label, sizeof f.label, h);
  }
  return h;
}

// Whether `s` is valid UTF-8 (a JSON string must be; a file name need not be), by RFC 3629 as
// nlohmann's dump() checks it: no overlong forms, no surrogates, nothing past U+10FFFF. A looser
// check (any 0xF0-0xF7 lead byte) let such a name into the description, and dump() threw
// type_error 316 when the process workers were started (tests/fuzz/file_list_fuzz.cpp).
bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
    if (c < 0x80) {
      n = 1;
    } else if (c >= 0xC2 && c <= 0xDF) {
      n = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 3;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 4;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // past U+10FFFF
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if (k == 1 ? (b < lo || b > hi) : (b >> 6) != 0x2) return false;
    }
    i += n;
  }
  return true;
}

// Adds "count", "digest" and the list: "paths" (relative to `prefix`) as one string of
// NUL-terminated names (no path holds a NUL; one JSON string parses far faster than thousands),
// and "labels" as [label, run length] pairs in file order. The worker then reads exactly the files
// the loader indexed, without scanning again. A list JSON cannot carry (a name that is not UTF-8)
// is left out: the worker scans again and checks its count and digest against the loader's.
void describe_files(nlohmann::json& params, const std::vector<ImageFile>& files,
                    const std::string& prefix) {
  params["count"] = files.size();
  params["digest"] = fmt::format("{:016x}", digest_of(files));
  size_t bytes = 0;
  for (const auto& f : files) {
    if (f.path.compare(0, prefix.size(), prefix) != 0) return;
    bytes += f.path.size() - prefix.size() + 1;
    if (!valid_utf8(std::string_view(f.path).substr(prefix.size()))) return;
  }
  std::string paths;
  paths.reserve(bytes);
  std::vector<std::pair<int64_t, size_t>> runs;
  for (const auto& f : files) {
    paths.append(f.path, prefix.size());
    paths.push_back('\0');
    if (!runs.empty() && runs.back().first == f.label) {
      ++runs.back().second;
    } else {
      runs.emplace_back(f.label, 1);
    }
  }
  params["paths"] = std::move(paths);
  params["labels"] = runs;
}

// The files a description lists, or nullopt when it lists none (scan, then check_files()).
std::optional<std::vector<ImageFile>> described_files(const nlohmann::json& p,
                                                      const std::string& prefix) {
  if (!p.contains("paths")) return std::nullopt;
  const auto& paths = p.at("paths").get_ref<const std::string&>();
  const auto runs = p.at("labels").get<std::vector<std::pair<int64_t, size_t>>>();
  std::vector<ImageFile> files;
  files.reserve(p.at("count").get<size_t>());
  auto run = runs.begin();
  size_t left = run == runs.end() ? 0 : run->second;
  for (size_t at = 0; at < paths.size();) {
    const size_t end = paths.find('\0', at);
    while (left == 0 && run != runs.end() && ++run != runs.end()) left = run->second;
    if (end == std::string::npos || run == runs.end()) {
      throw DataError("a dataset description whose file list is malformed");
    }
    files.push_back({prefix + paths.substr(at, end - at), run->first});
    --left;
    at = end + 1;
  }
  if (files.size() != p.at("count").get<size_t>()) {
    throw DataError("a dataset description whose file list is malformed");
  }
  return files;
}

// A worker's own scan must find what the loader's found, or every index would name another file.
void check_files(const nlohmann::json& p, const std::vector<ImageFile>& files,
                 const std::string& what) {
  if (!p.contains("count")) return;
  const size_t count = p.at("count");
  const std::string digest = p.at("digest");
  if (count != files.size() || digest != fmt::format("{:016x}", digest_of(files))) {
    throw DataError(fmt::format(
        "{}: changed since the loader listed it ({} files then, {} now{}): a worker would "
        "read other files than the loader's indices name",
        what, count, files.size(), count == files.size() ? ", different names or labels" : ""));
  }
}

bool not_found(const std::error_code& ec) {
  return ec == std::errc::no_such_file_or_directory || ec == std::errc::not_a_directory;
}

const char* file_type(mode_t mode) {
  return S_ISFIFO(mode)   ? "a FIFO"
         : S_ISSOCK(mode) ? "a socket"
         : S_ISCHR(mode)  ? "a character device"
         : S_ISBLK(mode)  ? "a block device"
         : S_ISDIR(mode)  ? "a directory"
                          : "an unknown kind of file";
}

std::string directory_prefix(const std::string& dir) {
  return (fs::path(dir) / "").string();
}

}  // namespace

std::vector<unsigned char> read_file_bytes(const std::string& path, size_t limit) {
  // Refused by type before open(): opening a FIFO waits for a writer forever, and opening a device
  // can act on it. O_NONBLOCK is the second line: a file swapped for a FIFO after the stat opens
  // at once (and fstat refuses it); for a regular file it changes nothing.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw DataError(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    throw DataError(fmt::format("{}: not a regular file ({})", path, file_type(st.st_mode)));
  }
  forkguard::detail::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (!fd) throw DataError(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  if (::fstat(fd.get(), &st) != 0) {
    throw DataError(fmt::format("{}: cannot stat: {}", path, std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    throw DataError(fmt::format("{}: not a regular file ({})", path, file_type(st.st_mode)));
  }
  if (st.st_size == 0) throw DataError(fmt::format("{}: empty file (0 bytes)", path));
  if (static_cast<size_t>(st.st_size) > limit) {
    throw DataError(
        fmt::format("{}: {} bytes, more than the {}-byte limit", path, st.st_size, limit));
  }
  // A sparse file is refused before it is read: `truncate -s 2G x.jpg` (a placeholder, a failed
  // download) held no data, yet read() would allocate and fill 2 GB of zeros per sample in every
  // worker. SEEK_HOLE finds the first hole (the end of the file where there is none, or where the
  // file system cannot tell); a file with one that holds data for less than half its size is no
  // image anyone wrote (a few zero blocks an image made sparse by `cp --sparse=always` pass).
  if (const off_t hole = ::lseek(fd.get(), 0, SEEK_HOLE);
      hole >= 0 && hole < st.st_size && st.st_blocks * 512 < st.st_size / 2) {
    throw DataError(fmt::format(
        "{}: a sparse file ({} bytes, {} of them data; a hole at offset {}): not an image", path,
        st.st_size, static_cast<int64_t>(st.st_blocks) * 512, hole));
  }
  std::vector<unsigned char> out(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < out.size()) {
    ssize_t n = ::pread(fd.get(), out.data() + done, out.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw DataError(fmt::format("{}: read failed: {}", path, std::strerror(errno)));
    if (n == 0) break;  // shrank while we read it
    done += static_cast<size_t>(n);
  }
  out.resize(done);
  if (out.empty()) throw DataError(fmt::format("{}: empty file (0 bytes)", path));
  return out;
}

Sample FileDataset::read(size_t index) const {
  const auto& f = files_.at(index);
  return Sample{read_file_bytes(f.path), f.label, f.path};
}

ImageFolder::ImageFolder(std::string root, ImageFolderOptions options)
    : root_(std::move(root)), options_(options) {
  std::error_code ec;
  if (!fs::is_directory(root_, ec)) {
    throw DataError(fmt::format("{}: not a directory ({})", root_,
                                ec ? ec.message() : std::string("missing or not a directory")));
  }
  for (auto it = fs::directory_iterator(root_, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    // A class entry whose type cannot be told (a symlink loop, no permission) is an error, as in
    // torchvision (os.scandir's is_dir() raises); a dangling symlink is no class.
    std::error_code type_ec;
    const bool dir = it->is_directory(type_ec);
    if (type_ec && !not_found(type_ec)) {
      throw DataError(fmt::format("{}: cannot stat: {}", it->path().string(), type_ec.message()));
    }
    if (dir) classes_.push_back(it->path().filename().string());
  }
  if (ec) throw DataError(fmt::format("{}: cannot list: {}", root_, ec.message()));
  std::sort(classes_.begin(), classes_.end());
  if (classes_.empty()) {
    throw DataError(
        fmt::format("{}: no class directories (ImageFolder expects root/<class>/<image>)", root_));
  }
  std::vector<std::string> empty;  // classes without a file: no label would ever be trained
  for (size_t c = 0; c < classes_.size(); ++c) {
    // (directory, file name) pairs: torchvision sorts the walk by directory, then the names
    // within each directory, comparing strings as Python does (by code point: byte order for
    // UTF-8), not path elements. Split once, not in every comparison.
    std::vector<std::pair<std::string, std::string>> found;
    fs::path dir = fs::path(root_) / classes_[c];
    auto opts = fs::directory_options::follow_directory_symlink |
                fs::directory_options::skip_permission_denied;
    for (auto it = fs::recursive_directory_iterator(dir, opts, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      const fs::path& p = it->path();
      // An entry whose type cannot be told (a symlink loop, a dangling link) is a file, as in
      // torchvision's os.walk: its read names it and the error (a bad sample, skipped under
      // BadSample::kSkip), and the indices stay torchvision's.
      std::error_code type_ec;
      // A directory symlink that leads back to one of its own ancestors (`ln -s .. up`) would be
      // followed until the path is too long to resolve: each image listed 41 times here, as in
      // os.walk(followlinks=True). Named instead; a link to a directory elsewhere is followed.
      if (it->is_symlink(type_ec) && it->is_directory(type_ec)) {
        std::error_code target_ec, here_ec;
        const fs::path target = fs::canonical(p, target_ec);
        const fs::path here = fs::canonical(p.parent_path(), here_ec);
        if (!target_ec && !here_ec) {
          const fs::path up = here.lexically_relative(target);
          if (!up.empty() && *up.begin() != "..") {
            throw DataError(fmt::format(
                "{}: a symlink loop: it leads back to {}, a directory it is in (remove the link)",
                p.string(), target.string()));
          }
        }
      }
      if (is_image(p) && !it->is_directory(type_ec)) {
        found.emplace_back(p.parent_path().string(), p.filename().string());
      }
    }
    if (ec) throw DataError(fmt::format("{}: cannot list: {}", dir.string(), ec.message()));
    if (found.empty()) empty.push_back(classes_[c]);
    std::sort(found.begin(), found.end());
    for (auto& [d, name] : found) {
      files_.push_back({d + "/" + name, static_cast<int64_t>(c)});
    }
  }
  if (files_.empty()) throw DataError(fmt::format("{}: no image files under any class", root_));
  if (!empty.empty() && !options_.allow_empty) {
    // torchvision's message (ImageFolder without allow_empty), after the root.
    throw DataError(fmt::format(
        "{}: Found no valid file for the classes {}. Supported extensions are: {} (an unreadable "
        "class directory counts as empty; ImageFolderOptions::allow_empty accepts them)",
        root_, fmt::join(empty, ", "), fmt::join(kExtensions, ", ")));
  }
}

ImageFolder::ImageFolder(std::string root, std::vector<std::string> classes,
                         std::vector<ImageFile> files)
    : root_(std::move(root)), classes_(std::move(classes)) {
  files_ = std::move(files);
}

std::optional<Description> ImageFolder::describe() const {
  nlohmann::json p{{"root", root_}, {"classes", classes_}, {"allow_empty", options_.allow_empty}};
  describe_files(p, files_, directory_prefix(root_));
  return Description{"image_folder", std::move(p)};
}

FileList::FileList(std::string list) : list_(std::move(list)) {
  std::ifstream in(list_);
  if (!in) throw DataError(fmt::format("{}: cannot open: {}", list_, std::strerror(errno)));
  const fs::path base = fs::path(list_).parent_path();
  std::string line;
  for (size_t n = 1; std::getline(in, line); ++n) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    auto sp = line.find_last_of(" \t");
    char* end = nullptr;
    errno = 0;
    long long label = sp == std::string::npos ? 0 : std::strtoll(line.c_str() + sp + 1, &end, 10);
    if (sp == std::string::npos || end == line.c_str() + sp + 1 || *end != '\0') {
      throw DataError(fmt::format("{}:{}: expected \"path label\", got \"{}\"", list_, n, line));
    }
    if (errno == ERANGE) {  // strtoll clamped it to the nearest int64
      throw DataError(fmt::format("{}:{}: label {} is out of range (a 64-bit signed integer)",
                                  list_, n, line.substr(sp + 1)));
    }
    std::string path = line.substr(0, sp);
    while (!path.empty() && (path.back() == ' ' || path.back() == '\t')) path.pop_back();
    fs::path p(path);
    files_.push_back({p.is_absolute() ? path : (base / p).string(), label});
  }
  if (files_.empty()) throw DataError(fmt::format("{}: no samples listed", list_));
}

FileList::FileList(std::string list, std::vector<ImageFile> files) : list_(std::move(list)) {
  files_ = std::move(files);
}

std::optional<Description> FileList::describe() const {
  nlohmann::json p{{"list", list_}};
  describe_files(p, files_, "");
  return Description{"file_list", std::move(p)};
}

FORKGUARD_REGISTER_DATASET(image_folder, [](const nlohmann::json& p) {
  std::string root = p.at("root");
  if (auto files = described_files(p, directory_prefix(root))) {
    return std::make_unique<ImageFolder>(root, p.at("classes").get<std::vector<std::string>>(),
                                         std::move(*files));
  }
  auto scanned = std::make_unique<ImageFolder>(
      root, ImageFolderOptions{.allow_empty = p.value("allow_empty", false)});
  check_files(p, scanned->files(), root);
  return scanned;
});
FORKGUARD_REGISTER_DATASET(file_list, [](const nlohmann::json& p) {
  std::string list = p.at("list");
  if (auto files = described_files(p, "")) {
    return std::make_unique<FileList>(list, std::move(*files));
  }
  auto read = std::make_unique<FileList>(list);
  check_files(p, read->files(), list);
  return read;
});

}  // namespace forkguard::data
