// WebDataset-style tar shards as a Dataset: random access to (image, label) samples stored as
// consecutive members of .tar files, through an index built once by walking the tar headers.
//
//   forkguard::data::TarShards train("/data/imagenet/train-{000000..001281}.tar");
//   forkguard::data::TarShards val("/data/imagenet/val");        // every *.tar in it, sorted
//   forkguard::data::Sample s = train.read(17);  // the image's bytes, the .cls label
//   train.key(17);  // "/data/imagenet/train-000000.tar:n01440764_10026"
//
// Shards: a single .tar; a brace pattern, `{000000..000099}` ranges (padded to the width of the
// first bound) and `{a,b,c}` lists, several groups allowed, where every expanded name must exist;
// or a directory (its regular *.tar files, sorted by name). A shard named twice is an error.
//
// Samples, as WebDataset groups them: a member's key is its path up to the first '.' of its base
// name, its extension the rest (lowercased); consecutive members with the same key form one
// sample (never across shards). The image is the member with extension jpg, jpeg or png (the
// first of them in that order when there are several); the label is the `.cls` member, an ASCII
// integer (surrounding whitespace allowed). Other members (.json, .txt, ...) are ignored, and so
// are members whose base name has no extension or starts with '.' (WebDataset's `__name__`
// metadata, dot files), directories, links and every other non-regular entry. Keys are per shard:
// the same key in two shards is two samples (key() tells them apart), but a key that reappears in
// one shard after other keys, or a member that appears twice in one sample, is an error (the
// sample's members are not consecutive: the shard was written out of order, e.g. `tar -cf s.tar
// *.jpg *.cls`).
//
// The index keeps, per sample, the shard and the offset and size of its image and label (40
// bytes plus the key), so read() is one preadv() straight into the image's buffer (two when over
// 64 KiB of other members lie between image and label) on a descriptor held open (O_CLOEXEC) for
// each shard. Tar formats: ustar (with its name prefix), GNU (long names 'L', base-256 sizes) and
// pax ('x' headers: path and size); every header's checksum is verified.
// describe() names the pattern and each shard's identity: a fork-server worker rebuilds the
// dataset by indexing again and checks it found the same shards.
//
// Errors (DataError). At construction, naming the pattern or the shard, the member and the byte
// offset: a pattern or directory that matches no file, a malformed brace pattern, a shard that
// cannot be opened or read, a corrupt or truncated tar (bad header checksum, bad size or pax
// record, a member past the end of the file, no end-of-archive blocks), the member-order errors
// above, a key over 4 KiB, no samples at all. At read(), so the loader's `bad_sample = skip` policy
// counts and names them instead of dropping them silently: a sample without an image (or an empty
// one), without a .cls member, or whose .cls is not an integer; a shard whose size or
// modification time is no longer what it was when indexed (rewritten in place: its samples are
// not where the index says), named with both. A shard replaced by rename is still read through
// the descriptor opened at indexing (the indexed file); a fork-server worker, which indexes the
// shards again, refuses to start when any shard's size, time or index differs from the loader's.
//
// Thread-safety: read() and key() are const and may run concurrently (pread on shared fds).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "forkguard/data/dataset.hpp"

namespace forkguard::data {

class TarShards : public Dataset {
 public:
  // pattern: a .tar file, a brace pattern of them, or a directory of them.
  explicit TarShards(std::string pattern);
  ~TarShards() override;
  TarShards(const TarShards&) = delete;
  TarShards& operator=(const TarShards&) = delete;

  size_t size() const override;
  Sample read(size_t index) const override;
  std::string key(size_t index) const override;  // "<shard path>:<sample key>"
  std::optional<Description> describe() const override;

  const std::string& pattern() const { return pattern_; }
  const std::vector<std::string>& shards() const;  // the shard paths, in order
  // Throws DataError naming the first shard whose identity (size, modification time, index
  // digest) differs from `described` (describe()'s "identities"): a fork-server worker indexes
  // the shards again and must find what the loader indexed.
  void check_identities(const nlohmann::json& described) const;

 private:
  struct Index;
  std::string pattern_;
  std::unique_ptr<Index> index_;
};

// The shard paths a pattern names, in order: brace groups expanded (without checking that the
// files exist), a directory listed. Throws DataError for a malformed pattern or an empty or
// unreadable directory.
std::vector<std::string> expand_shard_pattern(const std::string& pattern);

}  // namespace forkguard::data
