// Datasets: random access to samples. The loader reads them in worker threads or processes.
//
//   class Shards : public forkguard::data::Dataset {
//    public:
//     size_t size() const override { return n_; }
//     forkguard::data::Sample read(size_t i) const override { return {bytes_of(i), label_of(i),
//                                                                    key(i)}; }
//     std::string key(size_t i) const override { return path_of(i); }
//     // Optional: how a process worker forked from the fork server rebuilds this dataset.
//     std::optional<forkguard::data::Description> describe() const override {
//       return forkguard::data::Description{"shards", {{"root", root_}}};
//     }
//   };
//   FORKGUARD_REGISTER_DATASET(shards, [](const nlohmann::json& p) {
//     return std::make_unique<Shards>(p.at("root").get<std::string>()); });
//
// Thread-safety: read() and key() are const and are called concurrently from every worker.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace forkguard::data {

struct Sample {
  std::vector<unsigned char> data;  // the encoded bytes (a file, a record)
  int64_t label = 0;
  std::string key;  // names the sample in errors and in Batch::key(): a path, a record id
};

// A registered type and its parameters: enough for a process worker, forked from the fork
// server, to rebuild the object (see register_dataset / register_transform).
struct Description {
  std::string type;
  nlohmann::json params;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual size_t size() const = 0;
  // The sample at index (< size()); throws to report a bad sample (the loader adds the index and
  // the key to the message).
  virtual Sample read(size_t index) const = 0;
  // The key of a sample without reading it, for messages about a sample that could not be read.
  virtual std::string key(size_t index) const { return "#" + std::to_string(index); }
  // nullopt: this dataset cannot be rebuilt in a fork-server worker (thread workers, and process
  // workers by guarded fork, still take it).
  virtual std::optional<Description> describe() const { return std::nullopt; }
};

using DatasetFactory = std::function<std::unique_ptr<Dataset>(const nlohmann::json& params)>;
// Registers a dataset type; returns true so it can initialize a static. Register at
// static-initialization time: the fork server is a fork of the program made in init(). A type
// registered twice keeps its first factory: the second call returns false and says so on stderr,
// naming both places.
bool register_dataset(const std::string& type, DatasetFactory factory,
                      const char* file = __builtin_FILE(), int line = __builtin_LINE());
// Rebuilds a dataset from its description; throws DataError for an unknown type.
std::unique_ptr<Dataset> make_dataset(const Description& description);

// Built in: `size` samples of `sample_bytes` pseudo-random bytes each, a pure function of
// (seed, index); label = index % classes; key "synthetic/<index>". For tests and benchmarks.
struct SyntheticOptions {
  size_t size = 1024;          // samples
  size_t sample_bytes = 4096;  // bytes per sample
  int64_t classes = 10;        // labels are index % classes
  uint64_t seed = 0;           // the bytes' seed
};

class SyntheticDataset : public Dataset {
 public:
  explicit SyntheticDataset(SyntheticOptions options) : o_(options) {}
  size_t size() const override { return o_.size; }
  Sample read(size_t index) const override;
  std::string key(size_t index) const override;
  std::optional<Description> describe() const override;
  // The bytes read(index) returns, written into out (sample_bytes long).
  void fill(size_t index, unsigned char* out) const;

 private:
  SyntheticOptions o_;
};

}  // namespace forkguard::data

#define FORKGUARD_DATA_CONCAT2(a, b) a##b
#define FORKGUARD_DATA_CONCAT(a, b) FORKGUARD_DATA_CONCAT2(a, b)
#define FORKGUARD_REGISTER_DATASET(type, ...)                                              \
  [[maybe_unused]] static const bool FORKGUARD_DATA_CONCAT(forkguard_dataset_, __LINE__) = \
      ::forkguard::data::register_dataset(#type, __VA_ARGS__)
