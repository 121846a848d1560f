#include "forkguard/data/tar_shards.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <limits>
#include <set>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "detail/fd.hpp"
#include "detail/fnv.hpp"
#include "forkguard/data/error.hpp"

namespace forkguard::data {
namespace fs = std::filesystem;
namespace {

constexpr uint64_t kBlock = 512;
constexpr uint64_t kNone = std::numeric_limits<uint64_t>::max();
// Bytes of other members we read through rather than issue a second pread for.
constexpr uint64_t kMaxGap = 64 * 1024;
// A pax header or GNU long name larger than this is corruption, not a name.
constexpr uint64_t kMaxMetadata = 1 << 20;
constexpr uint64_t kMaxClsBytes = 64;
constexpr size_t kMaxKey = 4096;
constexpr size_t kMaxRange = 1'000'000;

uint64_t round_up(uint64_t n) {
  return (n + kBlock - 1) / kBlock * kBlock;
}

// Quoted and printable, for messages about bytes from the file.
std::string printable(std::string_view s, size_t limit = 40) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size() && i < limit; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  if (s.size() > limit) out += "...";
  return out + "\"";
}

// ---- brace patterns -----------------------------------------------------------------------------

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::vector<std::string> expand_braces(const std::string& whole, std::string_view p) {
  const size_t open = p.find('{');
  const size_t stray = p.find('}');
  if (stray != std::string_view::npos && stray < open) {
    throw DataError(fmt::format("\"{}\": '}}' without '{{' in the shard pattern", whole));
  }
  if (open == std::string_view::npos) return {std::string(p)};
  const size_t close = p.find('}', open);
  if (close == std::string_view::npos) {
    throw DataError(fmt::format("\"{}\": '{{' without '}}' in the shard pattern", whole));
  }
  const std::string_view body = p.substr(open + 1, close - open - 1);
  if (body.find('{') != std::string_view::npos) {
    throw DataError(fmt::format("\"{}\": nested braces are not supported", whole));
  }
  std::vector<std::string> alternatives;
  if (const size_t dots = body.find(".."); dots != std::string_view::npos) {
    const std::string_view lo = body.substr(0, dots), hi = body.substr(dots + 2);
    uint64_t a = 0, b = 0;
    if (!all_digits(lo) || !all_digits(hi) ||
        std::from_chars(lo.data(), lo.data() + lo.size(), a).ec != std::errc() ||
        std::from_chars(hi.data(), hi.data() + hi.size(), b).ec != std::errc()) {
      throw DataError(
          fmt::format("\"{}\": {{{}}}: a range needs two non-negative integers", whole, body));
    }
    if (a > b) {
      throw DataError(
          fmt::format("\"{}\": {{{}}}: the range is empty (first > last)", whole, body));
    }
    if (b - a >= kMaxRange) {
      throw DataError(
          fmt::format("\"{}\": {{{}}}: more than {} shards in one range", whole, body, kMaxRange));
    }
    for (uint64_t v = a; v <= b; ++v) alternatives.push_back(fmt::format("{:0{}}", v, lo.size()));
  } else if (body.find(',') != std::string_view::npos) {
    size_t start = 0;
    for (size_t comma; (comma = body.find(',', start)) != std::string_view::npos;
         start = comma + 1) {
      alternatives.emplace_back(body.substr(start, comma - start));
    }
    alternatives.emplace_back(body.substr(start));
  } else {
    throw DataError(
        fmt::format("\"{}\": {{{}}}: expected {{first..last}} or {{a,b,...}}", whole, body));
  }
  const std::string prefix(p.substr(0, open));
  const std::vector<std::string> rests = expand_braces(whole, p.substr(close + 1));
  // Groups multiply: {0..999999}{0..999999} asked for 10^12 names (an allocation that ASan
  // refused, found by tests/fuzz/shard_pattern_fuzz.cpp).
  if (alternatives.size() * rests.size() > kMaxRange) {
    throw DataError(fmt::format("\"{}\": names more than {} shards", whole, kMaxRange));
  }
  std::vector<std::string> out;
  out.reserve(alternatives.size() * rests.size());
  for (const auto& alt : alternatives) {
    for (const auto& rest : rests) out.push_back(prefix + alt + rest);
  }
  return out;
}

int64_t mtime_ns(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
}

// A modification time as UTC, to the nanosecond (a rewrite within one second differs there).
std::string time_text(int64_t ns) {
  const time_t sec = static_cast<time_t>(ns / 1'000'000'000);
  struct tm tm {};
  ::gmtime_r(&sec, &tm);
  char buf[32];
  ::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return fmt::format("{}.{:09} UTC", buf, ns % 1'000'000'000);
}

// ---- reading a shard ----------------------------------------------------------------------------

// Header reads through a window that adapts to the members' sizes: a run of small members costs
// one pread for many, a large member (a typical image) a 2 KiB read of the headers around it, not
// a copy of its data.
class BlockReader {
 public:
  BlockReader(int fd, const std::string& path, uint64_t size) : fd_(fd), path_(path), size_(size) {}

  // n bytes at offset (offset + n <= size, checked by the caller).
  std::string_view get(uint64_t offset, size_t n) {
    const uint64_t end = start_ + buffer_.size();
    if (offset < start_ || offset + n > end) {
      const bool near = !buffer_.empty() && offset >= end && offset - end <= window_;
      window_ = near ? std::min(window_ * 2, kMaxWindow) : kMinWindow;
      const size_t want =
          static_cast<size_t>(std::min<uint64_t>(std::max<uint64_t>(n, window_), size_ - offset));
      buffer_.resize(want);
      size_t done = 0;
      while (done < want) {
        ssize_t r =
            ::pread(fd_, buffer_.data() + done, want - done, static_cast<off_t>(offset + done));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
          throw DataError(fmt::format("{}: read failed at offset {}: {}", path_, offset + done,
                                      std::strerror(errno)));
        }
        if (r == 0) {
          throw DataError(
              fmt::format("{}: the file ended at offset {} while it was being indexed "
                          "(it was {} bytes: did it change?)",
                          path_, offset + done, size_));
        }
        done += static_cast<size_t>(r);
      }
      start_ = offset;
    }
    return std::string_view(buffer_.data() + (offset - start_), n);
  }

 private:
  static constexpr uint64_t kMinWindow = 2 * 1024;
  static constexpr uint64_t kMaxWindow = 64 * 1024;
  uint64_t window_ = kMinWindow;
  int fd_;
  const std::string& path_;
  uint64_t size_;
  uint64_t start_ = 0;
  std::string buffer_;
};

std::string_view c_string(std::string_view field) {
  return field.substr(0, std::min(field.find('\0'), field.size()));
}

// A tar numeric field: octal digits (leading spaces allowed, ended by NUL or space), or GNU's
// base-256 (first byte's high bit set). nullopt: malformed.
std::optional<uint64_t> parse_number(std::string_view f) {
  const auto* u = reinterpret_cast<const unsigned char*>(f.data());
  if (u[0] & 0x80) {
    if (u[0] != 0x80) return std::nullopt;  // negative or over 64 bits
    uint64_t v = 0;
    for (size_t i = 1; i < f.size(); ++i) {
      if (v >> 56) return std::nullopt;
      v = (v << 8) | u[i];
    }
    return v;
  }
  size_t i = 0;
  while (i < f.size() && f[i] == ' ') ++i;
  uint64_t v = 0;
  for (; i < f.size() && f[i] >= '0' && f[i] <= '7'; ++i) {
    if (v >> 61) return std::nullopt;
    v = v * 8 + static_cast<uint64_t>(f[i] - '0');
  }
  for (; i < f.size(); ++i) {
    if (f[i] != ' ' && f[i] != '\0') return std::nullopt;
  }
  return v;
}

bool checksum_ok(std::string_view h, uint64_t* stored, int64_t* computed) {
  auto s = parse_number(h.substr(148, 8));
  uint64_t unsigned_sum = 0;
  int64_t signed_sum = 0;
  for (size_t i = 0; i < kBlock; ++i) {
    const bool field = i >= 148 && i < 156;
    unsigned_sum += field ? ' ' : static_cast<unsigned char>(h[i]);
    signed_sum += field ? ' ' : static_cast<signed char>(h[i]);
  }
  *stored = s.value_or(kNone);
  *computed = static_cast<int64_t>(unsigned_sum);
  // Some old tars summed signed chars; both are accepted, as GNU tar does.
  return s && (*s == unsigned_sum || static_cast<int64_t>(*s) == signed_sum);
}

// A pax extended header's records ("<len> <key>=<value>\n"): path and size for the next member.
void parse_pax(std::string_view data, const std::string& shard, uint64_t offset,
               std::optional<std::string>& path, uint64_t& size) {
  auto bad = [&](const std::string& why) {
    return DataError(
        fmt::format("{}: corrupt pax header at offset {}: {} (not a tar file, or corrupt)", shard,
                    offset, why));
  };
  size_t pos = 0;
  while (pos < data.size()) {
    if (data[pos] == '\0') break;  // padding
    const size_t space = data.find(' ', pos);
    size_t len = 0;
    if (space == std::string_view::npos ||
        std::from_chars(data.data() + pos, data.data() + space, len).ptr != data.data() + space ||
        len <= space - pos || pos + len > data.size() || data[pos + len - 1] != '\n') {
      throw bad(fmt::format("bad record at byte {}", pos));
    }
    const std::string_view record = data.substr(space + 1, pos + len - 1 - (space + 1));
    const size_t eq = record.find('=');
    if (eq == std::string_view::npos) throw bad(fmt::format("record without '=' at byte {}", pos));
    const std::string_view key = record.substr(0, eq), value = record.substr(eq + 1);
    if (key == "path") {
      path = std::string(value);
    } else if (key == "size") {
      uint64_t v = 0;
      if (!all_digits(value) ||
          std::from_chars(value.data(), value.data() + value.size(), v).ec != std::errc() ||
          v == kNone) {
        throw bad(fmt::format("size {} is not a number", printable(value)));
      }
      size = v;
    }
    pos += len;
  }
}

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

// The image extensions, best first.
constexpr const char* kImageExtensions[] = {"jpg", "jpeg", "png"};

int image_rank(std::string_view ext) {
  for (int i = 0; i < 3; ++i) {
    if (ext == kImageExtensions[i]) return i;
  }
  return -1;
}

}  // namespace

std::vector<std::string> expand_shard_pattern(const std::string& pattern) {
  if (pattern.empty()) throw DataError("tar shards: the shard pattern is empty");
  if (pattern.find_first_of("{}") != std::string::npos) return expand_braces(pattern, pattern);
  std::error_code ec;
  if (!fs::is_directory(pattern, ec)) return {pattern};
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(pattern, ec)) {
    if (e.path().extension() == ".tar" && e.is_regular_file()) out.push_back(e.path().string());
  }
  if (ec) throw DataError(fmt::format("{}: cannot list: {}", pattern, ec.message()));
  if (out.empty()) {
    throw DataError(
        fmt::format("{}: no *.tar files in this directory (expected WebDataset shards)", pattern));
  }
  std::sort(out.begin(), out.end());
  return out;
}

struct TarShards::Index {
  // 40 bytes a sample and its key (ImageNet's 1.28 M samples: about 80 MB), built again in every
  // fork-server worker: no strings of its own.
  struct Entry {
    uint64_t key_at = 0;     // its key is keys.substr(key_at, key_size)
    uint64_t image = kNone;  // data offset of the image member
    uint64_t image_size = 0;
    uint64_t label = kNone;  // data offset of the .cls member
    uint32_t shard = 0;      // index into shards
    uint16_t key_size = 0;   // keys are at most kMaxKey bytes
    uint8_t label_size = 0;  // capped at kMaxClsBytes + 1
    int8_t image_rank = -1;  // index into kImageExtensions
  };
  // For a sample without an image or a label only, for its message.
  struct Note {
    uint64_t offset = 0;  // its first member's header
    std::string members;  // its members' extensions
  };
  // What a shard was when it was indexed: a shard rewritten in place (`cp new.tar shard.tar`) or
  // replaced (a worker indexing it again) no longer holds the samples at the indexed offsets.
  struct Identity {
    uint64_t size = 0;
    int64_t mtime_ns = 0;
    uint64_t digest = 0;  // of its samples' keys, offsets and sizes
    bool operator==(const Identity&) const = default;
  };
  std::vector<std::string> shards;
  std::vector<detail::UniqueFd> fds;
  std::vector<Identity> identities;  // per shard
  std::vector<Entry> samples;
  std::string keys;  // every sample's key, back to back
  std::unordered_map<size_t, Note> notes;

  std::string_view key(const Entry& e) const {
    return std::string_view(keys).substr(e.key_at, e.key_size);
  }
  void index_shard(uint32_t shard, uint64_t file_size);
};

void TarShards::Index::index_shard(uint32_t shard, uint64_t file_size) {
  const std::string& path = shards[shard];
  BlockReader reader(fds[shard].get(), path, file_size);
  if (file_size == 0) throw DataError(fmt::format("{}: empty file (0 bytes), not a tar", path));

  // The sample being grouped: its key, its members' extensions and header offsets.
  std::optional<Entry> open;
  std::string open_key;
  std::vector<std::pair<std::string, uint64_t>> open_members;
  std::unordered_map<std::string, uint64_t> seen;  // key -> offset, in this shard
  auto close = [&] {
    if (!open) return;
    if (open->image == kNone || open->label == kNone) {
      Note note{.offset = open_members.front().second, .members = {}};
      for (const auto& member : open_members) {
        note.members += (note.members.empty() ? "." : " .") + member.first;
      }
      notes.emplace(samples.size(), std::move(note));
    }
    open->key_at = keys.size();
    open->key_size = static_cast<uint16_t>(open_key.size());
    keys += open_key;
    samples.push_back(*open);
    open.reset();
    open_members.clear();
  };

  std::optional<std::string> pax_path, long_name;
  uint64_t pax_size = kNone;  // kNone: no pax size record
  uint64_t off = 0;
  for (;;) {
    if (off + kBlock > file_size) {
      if (off == file_size) {
        throw DataError(fmt::format(
            "{}: the file ends at offset {} without the end-of-archive blocks: truncated", path,
            off));
      }
      throw DataError(
          fmt::format("{}: a partial header at offset {} (the file ends at {}): "
                      "truncated",
                      path, off, file_size));
    }
    const std::string_view h = reader.get(off, kBlock);
    if (std::all_of(h.begin(), h.end(), [](char c) { return c == '\0'; })) break;  // the end
    uint64_t stored = 0;
    int64_t computed = 0;
    if (!checksum_ok(h, &stored, &computed)) {
      throw DataError(fmt::format(
          "{}: bad tar header checksum at offset {} (stored {}, computed {}): not a tar file, or "
          "corrupt",
          path, off, stored == kNone ? std::string("unreadable") : fmt::format("{:o}", stored),
          fmt::format("{:o}", computed)));
    }
    const char type = h[156];
    std::string name;
    if (pax_path) {
      name = std::move(*pax_path);
    } else if (long_name) {
      name = std::move(*long_name);
    } else {
      name = std::string(c_string(h.substr(0, 100)));
      // POSIX ustar splits long paths into prefix/name; GNU's "ustar  " uses that space otherwise.
      if (h.substr(257, 6) == std::string_view("ustar\0", 6)) {
        const std::string_view prefix = c_string(h.substr(345, 155));
        if (!prefix.empty()) name = std::string(prefix) + "/" + name;
      }
    }
    std::optional<uint64_t> size =
        pax_size != kNone ? std::optional<uint64_t>(pax_size) : parse_number(h.substr(124, 12));
    pax_path.reset();
    long_name.reset();
    pax_size = kNone;
    if (!size) {
      throw DataError(fmt::format("{}: member {} at offset {}: bad size field {}: corrupt", path,
                                  printable(name), off, printable(h.substr(124, 12))));
    }
    // Links, devices, FIFOs and directories carry no data, whatever their size field says.
    const bool has_data = std::string_view("123456").find(type) == std::string_view::npos;
    const uint64_t data = off + kBlock;
    const uint64_t length = has_data ? *size : 0;
    if (length > file_size - data) {
      throw DataError(fmt::format(
          "{}: member {} at offset {}: its {} bytes of data run past the end of the file ({} "
          "bytes): truncated",
          path, printable(name), off, length, file_size));
    }
    if (type == 'x' || type == 'L') {
      if (length > kMaxMetadata) {
        throw DataError(fmt::format("{}: {} header at offset {} of {} bytes: corrupt", path,
                                    type == 'x' ? "pax" : "GNU long-name", off, length));
      }
      const std::string_view bytes = reader.get(data, static_cast<size_t>(length));
      if (type == 'x') {
        parse_pax(bytes, path, off, pax_path, pax_size);
      } else {
        long_name = std::string(c_string(bytes));
      }
    } else if (type == '0' || type == '\0' || type == '7') {
      // A regular file: a member of a sample when its base name has a key and an extension.
      const size_t slash = name.rfind('/');
      const size_t base = slash == std::string::npos ? 0 : slash + 1;
      const size_t dot = name.find('.', base);
      if (dot != std::string::npos && dot > base) {
        std::string key = name.substr(0, dot);
        std::string ext = lower(std::string_view(name).substr(dot + 1));
        if (key.size() > kMaxKey) {
          throw DataError(
              fmt::format("{}: member {} at offset {}: its key is {} bytes long, more "
                          "than {}",
                          path, printable(name), off, key.size(), kMaxKey));
        }
        if (!open || open_key != key) {
          close();
          if (auto [it, fresh] = seen.emplace(key, off); !fresh) {
            throw DataError(fmt::format(
                "{}: member {} at offset {}: key {} appears again after other keys (first at "
                "offset {}): a sample's members must be consecutive (write the shard in key "
                "order)",
                path, printable(name), off, printable(key), it->second));
          }
          open.emplace();
          open->shard = shard;
          open_key = std::move(key);
        }
        for (const auto& [e, first] : open_members) {
          if (e == ext) {
            throw DataError(fmt::format(
                "{}: member {} at offset {}: a second .{} member for key {} (the first at offset "
                "{})",
                path, printable(name), off, ext, printable(open_key), first));
          }
        }
        open_members.emplace_back(ext, off);
        const int rank = image_rank(ext);
        if (rank >= 0 && (open->image_rank < 0 || rank < open->image_rank)) {
          open->image = data;
          open->image_size = length;
          open->image_rank = static_cast<int8_t>(rank);
        } else if (ext == "cls") {
          open->label = data;
          open->label_size = static_cast<uint8_t>(std::min(length, kMaxClsBytes + 1));
        }
      }
    }
    // Everything else ('g' global pax, 'K' long link names, GNU's volume and sparse entries,
    // directories and links) is skipped.
    off = data + round_up(length);
  }
  close();
}

TarShards::TarShards(std::string pattern)
    : pattern_(std::move(pattern)), index_(std::make_unique<Index>()) {
  Index& x = *index_;
  x.shards = expand_shard_pattern(pattern_);
  if (x.shards.size() > std::numeric_limits<uint32_t>::max()) {
    throw DataError(fmt::format("\"{}\": too many shards", pattern_));
  }
  {
    std::set<std::string_view> names;
    for (const auto& s : x.shards) {
      if (!names.insert(s).second) {
        throw DataError(fmt::format("\"{}\": the shard {} is named twice", pattern_, s));
      }
    }
  }
  const std::string from = x.shards.size() == 1 && x.shards[0] == pattern_
                               ? ""
                               : fmt::format(" (from \"{}\")", pattern_);
  for (uint32_t i = 0; i < x.shards.size(); ++i) {
    const std::string& path = x.shards[i];
    // O_NONBLOCK: a FIFO named like a shard opens at once (and is refused below) instead of
    // waiting for a writer forever; for a regular file it changes nothing.
    detail::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
    if (!fd) {
      const int err = errno;
      if (err == ENOENT && x.shards.size() > 1 &&
          std::none_of(x.shards.begin(), x.shards.end(), [](const std::string& s) {
            std::error_code ec;
            return fs::exists(s, ec);
          })) {
        throw DataError(fmt::format("\"{}\": the pattern matches no file ({} .. {} do not exist)",
                                    pattern_, x.shards.front(), x.shards.back()));
      }
      throw DataError(fmt::format("{}: cannot open shard: {}{}", path, std::strerror(err), from));
    }
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) {
      throw DataError(fmt::format("{}: cannot stat: {}{}", path, std::strerror(errno), from));
    }
    if (!S_ISREG(st.st_mode)) {
      throw DataError(fmt::format("{}: not a regular file{}", path, from));
    }
    x.fds.push_back(std::move(fd));
    const size_t first = x.samples.size();
    x.index_shard(i, static_cast<uint64_t>(st.st_size));
    uint64_t h = forkguard::detail::kFnvOffset;
    for (size_t k = first; k < x.samples.size(); ++k) {
      const Index::Entry& e = x.samples[k];
      const std::string_view key = x.key(e);
      h = forkguard::detail::fnv1a(key.data(), key.size(), h);
      const uint64_t fields[] = {key.size(), e.image, e.image_size, e.label, e.label_size};
      h = forkguard::detail::fnv1a(fields, sizeof fields, h);
    }
    x.identities.push_back({static_cast<uint64_t>(st.st_size), mtime_ns(st), h});
  }
  if (x.samples.empty()) {
    throw DataError(fmt::format("\"{}\": no samples in {} shard{}", pattern_, x.shards.size(),
                                x.shards.size() == 1 ? "" : "s"));
  }
  x.samples.shrink_to_fit();
}

TarShards::~TarShards() = default;

size_t TarShards::size() const {
  return index_->samples.size();
}

const std::vector<std::string>& TarShards::shards() const {
  return index_->shards;
}

std::string TarShards::key(size_t index) const {
  const auto& e = index_->samples.at(index);
  return fmt::format("{}:{}", index_->shards[e.shard], index_->key(e));
}

Sample TarShards::read(size_t index) const {
  const auto& e = index_->samples.at(index);
  const std::string& shard = index_->shards[e.shard];
  const std::string_view key = index_->key(e);
  if (e.image == kNone || e.label == kNone) {
    const Index::Note& note = index_->notes.at(index);
    throw DataError(fmt::format(
        "{}: sample {} (offset {}): {}; its members: {}", shard, printable(key), note.offset,
        e.image == kNone ? "no image member (.jpg, .jpeg or .png)" : "no .cls member (the label)",
        note.members));
  }
  if (e.image_size == 0) {
    throw DataError(fmt::format(
        "{}: sample {}: the image member {} at offset {} is empty (0 bytes)", shard, printable(key),
        printable(fmt::format("{}.{}", key, kImageExtensions[e.image_rank])), e.image - kBlock));
  }
  if (e.label_size > kMaxClsBytes) {
    throw DataError(
        fmt::format("{}: sample {}: bad .cls member at offset {}: {} bytes, not an "
                    "integer label",
                    shard, printable(key), e.label - kBlock, e.label_size));
  }

  // One preadv for the image and the label when little lies between them, straight into the
  // image's buffer; two when far apart.
  Sample s;
  s.key = fmt::format("{}:{}", shard, key);
  s.data.resize(e.image_size);
  std::string label(static_cast<size_t>(e.label_size), '\0');
  std::string between;
  const uint64_t image_end = e.image + e.image_size, label_end = e.label + e.label_size;
  struct Part {
    uint64_t offset;
    std::vector<iovec> iov;
  };
  std::vector<Part> parts;
  const uint64_t gap = e.label < e.image ? e.image - label_end : e.label - image_end;
  if (gap <= kMaxGap) {
    between.resize(static_cast<size_t>(gap));
    iovec img{s.data.data(), s.data.size()}, lab{label.data(), label.size()},
        mid{between.data(), between.size()};
    if (e.label < e.image) {
      parts.push_back({e.label, {lab, mid, img}});
    } else {
      parts.push_back({e.image, {img, mid, lab}});
    }
  } else {
    parts.push_back({e.image, {{s.data.data(), s.data.size()}}});
    parts.push_back({e.label, {{label.data(), label.size()}}});
  }
  const int fd = index_->fds[e.shard].get();
  // A shard rewritten since it was indexed would give other bytes than the sample's (or a short
  // read): named, not delivered. One fstat per sample; a shard replaced by rename is still read
  // through the descriptor opened at indexing, which holds the indexed file.
  if (struct stat st{}; ::fstat(fd, &st) == 0) {
    const Index::Identity& then = index_->identities[e.shard];
    if (static_cast<uint64_t>(st.st_size) != then.size || mtime_ns(st) != then.mtime_ns) {
      throw DataError(fmt::format(
          "{}: sample {}: the shard changed since it was indexed ({} bytes, modified {} then; {} "
          "bytes, modified {} now): its samples are no longer where the index says; open the "
          "dataset again",
          shard, printable(key), then.size, time_text(then.mtime_ns), st.st_size,
          time_text(mtime_ns(st))));
    }
  }
  for (auto& part : parts) {
    std::erase_if(part.iov, [](const iovec& v) { return v.iov_len == 0; });
    uint64_t offset = part.offset;
    size_t first = 0;
    while (first < part.iov.size()) {
      ssize_t n = ::preadv(fd, part.iov.data() + first, static_cast<int>(part.iov.size() - first),
                           static_cast<off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        throw DataError(fmt::format("{}: sample {}: read failed at offset {}: {}", shard,
                                    printable(key), offset, std::strerror(errno)));
      }
      if (n == 0) {
        throw DataError(
            fmt::format("{}: sample {}: the shard ends at offset {}, before the "
                        "sample's end (did it change since it was indexed?)",
                        shard, printable(key), offset));
      }
      offset += static_cast<uint64_t>(n);
      for (size_t done = static_cast<size_t>(n); done > 0 && first < part.iov.size();) {
        iovec& v = part.iov[first];
        const size_t take = std::min(done, v.iov_len);
        v.iov_base = static_cast<char*>(v.iov_base) + take;
        v.iov_len -= take;
        done -= take;
        if (v.iov_len == 0) ++first;
      }
    }
  }

  // WebDataset's labels are Python int(text): surrounding whitespace and a sign allowed.
  std::string_view text(label);
  const auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!text.empty() && space(text.front())) text.remove_prefix(1);
  while (!text.empty() && space(text.back())) text.remove_suffix(1);
  std::string_view digits = text;
  if (!digits.empty() && digits.front() == '+') digits.remove_prefix(1);
  int64_t value = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size() ||
      (digits.size() != text.size() && digits.front() == '-')) {
    throw DataError(
        fmt::format("{}: sample {}: bad .cls member at offset {}: {} is not an "
                    "integer label",
                    shard, printable(key), e.label - kBlock, printable(label)));
  }
  s.label = value;
  return s;
}

std::optional<Description> TarShards::describe() const {
  nlohmann::json identities = nlohmann::json::array();
  for (const auto& id : index_->identities) {
    identities.push_back({id.size, id.mtime_ns, fmt::format("{:016x}", id.digest)});
  }
  return Description{"tar_shards", {{"pattern", pattern_}, {"identities", identities}}};
}

void TarShards::check_identities(const nlohmann::json& described) const {
  const Index& x = *index_;
  if (described.size() != x.identities.size()) {
    throw DataError(fmt::format(
        "\"{}\": names {} shards now, {} when the loader indexed it: a worker would read other "
        "samples than the loader's indices name",
        pattern_, x.identities.size(), described.size()));
  }
  for (size_t i = 0; i < x.identities.size(); ++i) {
    const auto& d = described.at(i);
    const Index::Identity then{d.at(0).get<uint64_t>(), d.at(1).get<int64_t>(),
                               std::stoull(d.at(2).get<std::string>(), nullptr, 16)};
    const Index::Identity& now = x.identities[i];
    if (now != then) {
      throw DataError(fmt::format(
          "{}: the shard changed since the loader indexed it ({} bytes, modified {} then; {} "
          "bytes, modified {} now{}): a worker would read other samples than the loader's "
          "indices name; open the dataset again",
          x.shards[i], then.size, time_text(then.mtime_ns), now.size, time_text(now.mtime_ns),
          now.digest != then.digest ? "; other members" : ""));
    }
  }
}

FORKGUARD_REGISTER_DATASET(tar_shards, [](const nlohmann::json& p) {
  auto shards = std::make_unique<TarShards>(p.at("pattern").get<std::string>());
  if (p.contains("identities")) shards->check_identities(p.at("identities"));
  return shards;
});

}  // namespace forkguard::data
