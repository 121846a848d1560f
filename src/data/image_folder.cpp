#include "forkguard/data/image_folder.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "detail/fd.hpp"
#include "forkguard/data/error.hpp"

namespace forkguard::data {
namespace fs = std::filesystem;
namespace {

bool is_image(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  static const char* const kExtensions[] = {".jpg", ".jpeg", ".png",  ".ppm", ".bmp",
                                            ".pgm", ".tif",  ".tiff", ".webp"};
  return std::any_of(std::begin(kExtensions), std::end(kExtensions),
                     [&](const char* e) { return ext == e; });
}

}  // namespace

std::vector<unsigned char> read_file_bytes(const std::string& path, size_t limit) {
  forkguard::detail::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) throw DataError(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    throw DataError(fmt::format("{}: cannot stat: {}", path, std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) throw DataError(fmt::format("{}: not a regular file", path));
  if (st.st_size == 0) throw DataError(fmt::format("{}: empty file (0 bytes)", path));
  if (static_cast<size_t>(st.st_size) > limit) {
    throw DataError(
        fmt::format("{}: {} bytes, more than the {}-byte limit", path, st.st_size, limit));
  }
  std::vector<unsigned char> out(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < out.size()) {
    ssize_t n = ::read(fd.get(), out.data() + done, out.size() - done);
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

ImageFolder::ImageFolder(std::string root) : root_(std::move(root)) {
  std::error_code ec;
  if (!fs::is_directory(root_, ec)) {
    throw DataError(fmt::format("{}: not a directory ({})", root_,
                                ec ? ec.message() : std::string("missing or not a directory")));
  }
  for (const auto& e : fs::directory_iterator(root_, ec)) {
    if (e.is_directory()) classes_.push_back(e.path().filename().string());
  }
  if (ec) throw DataError(fmt::format("{}: cannot list: {}", root_, ec.message()));
  std::sort(classes_.begin(), classes_.end());
  if (classes_.empty()) {
    throw DataError(
        fmt::format("{}: no class directories (ImageFolder expects root/<class>/<image>)", root_));
  }
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
      if (is_image(p) && !it->is_directory()) {
        found.emplace_back(p.parent_path().string(), p.filename().string());
      }
    }
    if (ec) throw DataError(fmt::format("{}: cannot list: {}", dir.string(), ec.message()));
    std::sort(found.begin(), found.end());
    for (auto& [d, name] : found) {
      files_.push_back({d + "/" + name, static_cast<int64_t>(c)});
    }
  }
  if (files_.empty()) throw DataError(fmt::format("{}: no image files under any class", root_));
}

std::optional<Description> ImageFolder::describe() const {
  return Description{"image_folder", {{"root", root_}}};
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
    long long label = sp == std::string::npos ? 0 : std::strtoll(line.c_str() + sp + 1, &end, 10);
    if (sp == std::string::npos || end == line.c_str() + sp + 1 || *end != '\0') {
      throw DataError(fmt::format("{}:{}: expected \"path label\", got \"{}\"", list_, n, line));
    }
    std::string path = line.substr(0, sp);
    while (!path.empty() && (path.back() == ' ' || path.back() == '\t')) path.pop_back();
    fs::path p(path);
    files_.push_back({p.is_absolute() ? path : (base / p).string(), label});
  }
  if (files_.empty()) throw DataError(fmt::format("{}: no samples listed", list_));
}

std::optional<Description> FileList::describe() const {
  return Description{"file_list", {{"list", list_}}};
}

FORKGUARD_REGISTER_DATASET(image_folder, [](const nlohmann::json& p) {
  return std::make_unique<ImageFolder>(p.at("root").get<std::string>());
});
FORKGUARD_REGISTER_DATASET(file_list, [](const nlohmann::json& p) {
  return std::make_unique<FileList>(p.at("list").get<std::string>());
});

}  // namespace forkguard::data
