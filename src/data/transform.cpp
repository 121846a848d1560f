#include "forkguard/data/transform.hpp"

#include <fmt/format.h>

#include <cstring>

#include "detail/registry.hpp"
#include "forkguard/data/error.hpp"

namespace forkguard::data {
namespace {

forkguard::detail::Registry<TransformFactory>& transforms() {
  static forkguard::detail::Registry<TransformFactory> r("transform type",
                                                         "FORKGUARD_REGISTER_TRANSFORM");
  return r;
}

}  // namespace

size_t dtype_size(DType d) {
  switch (d) {
    case DType::kUInt8: return 1;
    case DType::kFloat16: return 2;
    case DType::kFloat32: return 4;
    case DType::kInt64: return 8;
  }
  return 1;
}

std::string to_string(DType d) {
  switch (d) {
    case DType::kUInt8: return "uint8";
    case DType::kFloat16: return "float16";
    case DType::kFloat32: return "float32";
    case DType::kInt64: return "int64";
  }
  return "?";
}

std::string to_string(Layout l) {
  switch (l) {
    case Layout::kAny: return "any";
    case Layout::kNCHW: return "NCHW";
    case Layout::kNHWC: return "NHWC";
  }
  return "?";
}

size_t OutputSpec::elements() const {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

nlohmann::json to_json(const OutputSpec& spec) {
  return {{"shape", spec.shape},
          {"dtype", static_cast<int>(spec.dtype)},
          {"layout", static_cast<int>(spec.layout)}};
}

OutputSpec output_spec_from_json(const nlohmann::json& j) {
  return OutputSpec{j.at("shape").get<std::vector<int64_t>>(),
                    static_cast<DType>(j.at("dtype").get<int>()),
                    static_cast<Layout>(j.at("layout").get<int>())};
}

bool register_transform(const std::string& type, TransformFactory factory, const char* file,
                        int line) {
  return transforms().add(type, std::move(factory), file, line);
}

std::unique_ptr<Transform> make_transform(const Description& d) {
  auto factory = transforms().find(d.type);
  if (!factory) throw DataError(transforms().unknown(d.type));
  return (*factory)(d.params);
}

void CopyTransform::apply(const Sample& in, std::span<std::byte> out, Rng&) const {
  if (in.data.size() != out.size()) {
    throw DataError(
        fmt::format("sample has {} bytes, the output spec needs {}", in.data.size(), out.size()));
  }
  std::memcpy(out.data(), in.data.data(), out.size());
}

std::optional<Description> CopyTransform::describe() const {
  return Description{"copy", {{"output", to_json(spec_)}}};
}

FORKGUARD_REGISTER_TRANSFORM(copy, [](const nlohmann::json& p) {
  return std::make_unique<CopyTransform>(output_spec_from_json(p.at("output")));
});

}  // namespace forkguard::data
