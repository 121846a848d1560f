#include "forkguard/data/batch.hpp"

#include <algorithm>
#include <mutex>

#include "data/batch_storage.hpp"
#include "forkguard/data/error.hpp"

namespace forkguard::data {
namespace {

// A DLPack tensor that keeps the batch's storage alive until its deleter runs.
struct Export {
  DLManagedTensor tensor{};
  std::vector<int64_t> shape;
  std::shared_ptr<detail::BatchStorage> keep;
};

DLDataType dl_type(DType d) {
  switch (d) {
    case DType::kUInt8: return {kDLUInt, 8, 1};
    case DType::kFloat16: return {kDLFloat, 16, 1};
    case DType::kFloat32: return {kDLFloat, 32, 1};
    case DType::kInt64: return {kDLInt, 64, 1};
  }
  return {kDLUInt, 8, 1};
}

DLManagedTensor* make_export(std::shared_ptr<detail::BatchStorage> keep, void* data,
                             DLDevice device, DLDataType type, std::vector<int64_t> shape) {
  auto* e = new Export;
  e->shape = std::move(shape);
  e->keep = std::move(keep);
  DLTensor& t = e->tensor.dl_tensor;
  t.data = data;
  t.device = device;
  t.ndim = static_cast<int32_t>(e->shape.size());
  t.dtype = type;
  t.shape = e->shape.data();
  t.strides = nullptr;  // compact, row-major
  t.byte_offset = 0;
  e->tensor.manager_ctx = e;
  e->tensor.deleter = [](DLManagedTensor* self) { delete static_cast<Export*>(self->manager_ctx); };
  return &e->tensor;
}

}  // namespace

const detail::BatchStorage& Batch::s() const {
  if (!s_) throw DataError("empty Batch handle");
  return *s_;
}

size_t Batch::size() const {
  return s().count;
}
size_t Batch::number() const {
  return s().number;
}
uint64_t Batch::epoch() const {
  return s().epoch;
}
const std::vector<size_t>& Batch::indices() const {
  return s().indices;
}
const std::vector<SkippedSample>& Batch::skipped() const {
  return s().skipped;
}
const OutputSpec& Batch::spec() const {
  return s().spec;
}
Placement Batch::placement() const {
  return s().device ? Placement::kDevice : Placement::kHost;
}
int Batch::device() const {
  return s().device ? s().device->ordinal() : -1;
}
uintptr_t Batch::stream() const {
  return s().device ? s().device->stream() : 0;
}

void Batch::synchronize() const {
  if (s().device) s().device->wait(s().buffer);
}

void Batch::record_stream(uintptr_t stream) const {
  const auto& st = s();
  if (!st.device) return;
  std::lock_guard lock(st.streams_mutex);
  if (std::find(st.streams.begin(), st.streams.end(), stream) == st.streams.end()) {
    st.streams.push_back(stream);
  }
}

void* Batch::images_data() const {
  return s().images;
}
size_t Batch::images_bytes() const {
  return s().count * s().layout.sample_bytes;
}
const int64_t* Batch::labels() const {
  return s().labels;
}

std::string_view Batch::key(size_t i) const {
  const auto& st = s();
  if (i >= st.count) throw DataError("Batch::key: position out of range");
  const char* k = st.keys + i * st.layout.key_bytes;
  size_t n = 0;
  while (n < st.layout.key_bytes && k[n] != '\0') ++n;
  return {k, n};
}

DLManagedTensor* Batch::images_dlpack() const {
  const auto& st = s();
  std::vector<int64_t> shape{static_cast<int64_t>(st.count)};
  shape.insert(shape.end(), st.spec.shape.begin(), st.spec.shape.end());
  DLDevice dev = st.device ? DLDevice{kDLCUDA, st.device->ordinal()} : DLDevice{kDLCPU, 0};
  return make_export(s_, st.images, dev, dl_type(st.spec.dtype), std::move(shape));
}

DLManagedTensor* Batch::labels_dlpack() const {
  const auto& st = s();
  std::vector<int64_t> shape{static_cast<int64_t>(st.count)};
  if (st.device) {
    return make_export(s_, reinterpret_cast<void*>(st.device_labels),
                       DLDevice{kDLCUDA, st.device->ordinal()}, dl_type(DType::kInt64),
                       std::move(shape));
  }
  return make_export(s_, const_cast<int64_t*>(st.labels), DLDevice{kDLCPU, 0},
                     dl_type(DType::kInt64), std::move(shape));
}

DLManagedTensor* Batch::keys_dlpack() const {
  const auto& st = s();
  std::vector<int64_t> shape{static_cast<int64_t>(st.count),
                             static_cast<int64_t>(st.layout.key_bytes)};
  return make_export(s_, const_cast<char*>(st.keys), DLDevice{kDLCPU, 0}, dl_type(DType::kUInt8),
                     std::move(shape));
}

}  // namespace forkguard::data
