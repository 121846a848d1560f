#include "forkguard/data/dataset.hpp"

#include <fmt/format.h>

#include <cstring>

#include "detail/registry.hpp"
#include "forkguard/data/error.hpp"
#include "forkguard/data/rng.hpp"

namespace forkguard::data {
namespace {

forkguard::detail::Registry<DatasetFactory>& datasets() {
  static forkguard::detail::Registry<DatasetFactory> r("dataset type",
                                                       "FORKGUARD_REGISTER_DATASET");
  return r;
}

}  // namespace

bool register_dataset(const std::string& type, DatasetFactory factory, const char* file, int line) {
  return datasets().add(type, std::move(factory), file, line);
}

std::unique_ptr<Dataset> make_dataset(const Description& d) {
  auto factory = datasets().find(d.type);
  if (!factory) throw DataError(datasets().unknown(d.type));
  return (*factory)(d.params);
}

void SyntheticDataset::fill(size_t index, unsigned char* out) const {
  Rng rng(o_.seed, 0, index, 0x5e);
  size_t i = 0;
  for (; i + 8 <= o_.sample_bytes; i += 8) {
    uint64_t v = rng.next();
    std::memcpy(out + i, &v, 8);
  }
  if (i < o_.sample_bytes) {
    uint64_t v = rng.next();
    std::memcpy(out + i, &v, o_.sample_bytes - i);
  }
}

Sample SyntheticDataset::read(size_t index) const {
  if (index >= o_.size) {
    throw DataError(fmt::format("index {} is out of range (size {})", index, o_.size), index);
  }
  Sample s;
  s.data.resize(o_.sample_bytes);
  fill(index, s.data.data());
  s.label = o_.classes > 0 ? static_cast<int64_t>(index % static_cast<size_t>(o_.classes)) : 0;
  s.key = key(index);
  return s;
}

std::string SyntheticDataset::key(size_t index) const {
  return fmt::format("synthetic/{:08}", index);
}

std::optional<Description> SyntheticDataset::describe() const {
  return Description{"synthetic",
                     {{"size", o_.size},
                      {"sample_bytes", o_.sample_bytes},
                      {"classes", o_.classes},
                      {"seed", o_.seed}}};
}

FORKGUARD_REGISTER_DATASET(synthetic, [](const nlohmann::json& p) {
  return std::make_unique<SyntheticDataset>(SyntheticOptions{
      .size = p.at("size").get<size_t>(),
      .sample_bytes = p.at("sample_bytes").get<size_t>(),
      .classes = p.at("classes").get<int64_t>(),
      .seed = p.at("seed").get<uint64_t>(),
  });
});

}  // namespace forkguard::data
