// Per-sample transforms: CPU work that turns a sample's bytes into its place in the batch.
//
//   class Invert : public forkguard::data::Transform {
//    public:
//     std::string name() const override { return "invert"; }
//     forkguard::data::OutputSpec output() const override { return {{3, 32, 32}}; }
//     void apply(const forkguard::data::Sample& in, std::span<std::byte> out,
//                forkguard::data::Rng& rng) const override { ... }
//   };
//
// apply() writes exactly output().bytes() bytes straight into the batch's shared memory: there
// is no copy between a transform's output and the batch the consumer sees (except in a slot's
// first batch, written through a private buffer and pwrite(), which costs less than faulting in
// the slot's fresh pages one by one). Randomness comes only
// from `rng`, seeded from (seed, epoch, sample index), so output does not depend on the worker.
// Transforms run in workers: they must never touch CUDA (a process worker that finds CUDA state
// in itself after a sample stops with an error naming the transform).
//
// Thread-safety: apply() is const and runs concurrently in every worker.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "forkguard/data/dataset.hpp"
#include "forkguard/data/rng.hpp"

namespace forkguard::data {

enum class DType { kUInt8, kFloat16, kFloat32, kInt64 };
enum class Layout { kAny, kNCHW, kNHWC };  // how `shape` is to be read; kAny: plain bytes

size_t dtype_size(DType d);
std::string to_string(DType d);
std::string to_string(Layout l);

// One sample's output tensor. A batch of B samples has shape [B, shape...].
struct OutputSpec {
  std::vector<int64_t> shape;    // per sample, e.g. {3, 224, 224}
  DType dtype = DType::kUInt8;   // element type
  Layout layout = Layout::kAny;  // a label for consumers; the bytes are row-major
  size_t elements() const;
  size_t bytes() const { return elements() * dtype_size(dtype); }
  bool operator==(const OutputSpec&) const = default;
};

class Transform {
 public:
  virtual ~Transform() = default;
  // Names the transform in errors ("transform \"decode+crop\" initialized CUDA ...").
  virtual std::string name() const = 0;
  virtual OutputSpec output() const = 0;
  // Throws to report a bad sample; out is output().bytes() long, in shared memory.
  virtual void apply(const Sample& in, std::span<std::byte> out, Rng& rng) const = 0;
  virtual std::optional<Description> describe() const { return std::nullopt; }
};

using TransformFactory = std::function<std::unique_ptr<Transform>(const nlohmann::json& params)>;
// Registers a transform type, with register_dataset's rules (the first of two keeps the name).
bool register_transform(const std::string& type, TransformFactory factory,
                        const char* file = __builtin_FILE(), int line = __builtin_LINE());
std::unique_ptr<Transform> make_transform(const Description& description);

// Built in: copies the sample's bytes as they are; a sample of another size is a bad sample.
class CopyTransform : public Transform {
 public:
  explicit CopyTransform(OutputSpec spec) : spec_(std::move(spec)) {}
  std::string name() const override { return "copy"; }
  OutputSpec output() const override { return spec_; }
  void apply(const Sample& in, std::span<std::byte> out, Rng& rng) const override;
  std::optional<Description> describe() const override;

 private:
  OutputSpec spec_;
};

nlohmann::json to_json(const OutputSpec& spec);
OutputSpec output_spec_from_json(const nlohmann::json& j);

}  // namespace forkguard::data

#define FORKGUARD_REGISTER_TRANSFORM(type, ...)                                              \
  [[maybe_unused]] static const bool FORKGUARD_DATA_CONCAT(forkguard_transform_, __LINE__) = \
      ::forkguard::data::register_transform(#type, __VA_ARGS__)
