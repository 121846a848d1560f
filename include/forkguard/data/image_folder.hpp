// Datasets of image files on disk: torchvision's ImageFolder layout, and a file list.
//
//   forkguard::data::ImageFolder train("/data/imagenet/train");   // root/<class>/<file>
//   forkguard::data::FileList val("/data/val.txt");              // "path label" per line
//
// ImageFolder follows torchvision: classes are the sorted names of root's subdirectories (label =
// position), files are found recursively (symlinks followed) with torchvision's image extensions
// (.jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp, any case), sorted by directory then name.
// FileList: one "path label" per line, paths relative to the list's directory unless absolute;
// blank lines and lines starting with '#' are ignored. read() returns the file's bytes; the key is
// its path. Both describe() themselves, so fork-server workers rebuild them: a description holds
// the file list itself, so the worker reads exactly the loader's files without scanning; a list
// with a name that is not UTF-8 (JSON cannot carry it) is scanned again in the worker and checked
// against the loader's count and digest (a tree that changed in between is an error, not samples
// silently swapped).
//
// Errors (DataError, naming the path): a missing or unreadable root or list, a root without
// class directories or without images, a class directory without images (unless
// ImageFolderOptions::allow_empty; torchvision's "Found no valid file for the classes ..."), a
// class entry whose type cannot be read, a malformed list line; at read(): an unreadable or
// zero-byte file, a sparse one (mostly holes: `truncate -s 2G x.jpg`, refused before a byte is
// read), or one that is not a regular file (a FIFO, socket or device is refused by its type
// before it is opened). Thread-safety: read() is const and may run concurrently.
#pragma once

#include <string>
#include <vector>

#include "forkguard/data/dataset.hpp"

namespace forkguard::data {

struct ImageFile {
  std::string path;
  int64_t label = 0;
};

class FileDataset : public Dataset {
 public:
  size_t size() const override { return files_.size(); }
  Sample read(size_t index) const override;
  std::string key(size_t index) const override { return files_.at(index).path; }
  const std::vector<ImageFile>& files() const { return files_; }

 protected:
  std::vector<ImageFile> files_;
};

struct ImageFolderOptions {
  // Accept class directories without an image file (or unreadable ones): their labels are never
  // drawn. false: an error naming them, as torchvision's ImageFolder without allow_empty.
  bool allow_empty = false;
};

class ImageFolder : public FileDataset {
 public:
  explicit ImageFolder(std::string root, ImageFolderOptions options = {});
  const std::vector<std::string>& classes() const { return classes_; }
  std::optional<Description> describe() const override;
  // From a description's list, no scan (the registered factory uses it).
  ImageFolder(std::string root, std::vector<std::string> classes, std::vector<ImageFile> files);

 private:
  std::string root_;
  ImageFolderOptions options_;
  std::vector<std::string> classes_;
};

class FileList : public FileDataset {
 public:
  explicit FileList(std::string list);
  std::optional<Description> describe() const override;
  // From a description's list, without reading the list file (the registered factory uses it).
  FileList(std::string list, std::vector<ImageFile> files);

 private:
  std::string list_;
};

// The whole file; throws DataError naming the path (unreadable, zero bytes, larger than limit).
std::vector<unsigned char> read_file_bytes(const std::string& path, size_t limit = size_t(1) << 31);

}  // namespace forkguard::data
