#include "data/worker_protocol.hpp"

#include <fmt/format.h>

#include "detail/decimal.hpp"
#include "forkguard/data/error.hpp"

namespace forkguard::data::detail {
namespace {

using forkguard::detail::parse_decimal;

template <class T>
T field(const std::vector<std::string>& f, size_t i, const char* what) {
  const auto v = parse_decimal<T>(f[i]);
  if (!v) {
    throw DataError(
        fmt::format("malformed process worker \"{}\" message: field {} is \"{}\"", what, i, f[i]));
  }
  return *v;
}

int slot_field(const std::vector<std::string>& f, size_t i, const char* what) {
  const int slot = field<int>(f, i, what);
  if (slot < 0) {
    throw DataError(fmt::format("malformed process worker \"{}\" message: slot {}", what, slot));
  }
  return slot;
}

bool flag_field(const std::vector<std::string>& f, size_t i, const char* what) {
  if (f[i] != "0" && f[i] != "1") {
    throw DataError(
        fmt::format("malformed process worker \"{}\" message: field {} is \"{}\"", what, i, f[i]));
  }
  return f[i] == "1";
}

}  // namespace

std::vector<std::string> encode_slot(const SlotMessage& m) {
  return {"slot", std::to_string(m.slot), std::to_string(m.bytes)};
}

std::vector<std::string> encode_task(const TaskMessage& m) {
  return {"task",
          std::to_string(m.epoch),
          std::to_string(m.batch),
          std::to_string(m.slot),
          std::to_string(m.count),
          m.shared ? "1" : "0",
          m.fresh ? "1" : "0"};
}

std::vector<std::string> encode_done(uint64_t batch, int slot, const TaskResult& r,
                                     uint64_t idle_ns) {
  std::vector<std::string> f = {"done",
                                std::to_string(batch),
                                std::to_string(slot),
                                std::to_string(static_cast<int>(r.kind)),
                                r.message,
                                std::to_string(r.index),
                                r.key,
                                std::to_string(r.read_ns),
                                std::to_string(r.transform_ns),
                                std::to_string(idle_ns),
                                std::to_string(r.skipped.size()),
                                std::to_string(r.position)};
  for (const auto& s : r.skipped) {
    f.insert(f.end(), {std::to_string(s.position), std::to_string(s.index), s.key, s.reason,
                       std::to_string(s.substitute)});
  }
  return f;
}

std::optional<SlotMessage> decode_slot(const std::vector<std::string>& f) {
  if (f.empty() || f[0] != "slot") return std::nullopt;
  if (f.size() != 3) {
    throw DataError(fmt::format("malformed process worker \"slot\" message: {} fields", f.size()));
  }
  SlotMessage m;
  m.slot = slot_field(f, 1, "slot");
  m.bytes = field<uint64_t>(f, 2, "slot");
  if (m.bytes == 0) throw DataError("malformed process worker \"slot\" message: 0 bytes");
  return m;
}

std::optional<TaskMessage> decode_task(const std::vector<std::string>& f) {
  if (f.empty() || f[0] != "task") return std::nullopt;
  if (f.size() != 7) {
    throw DataError(fmt::format("malformed process worker \"task\" message: {} fields", f.size()));
  }
  TaskMessage m;
  m.epoch = field<uint64_t>(f, 1, "task");
  m.batch = field<uint64_t>(f, 2, "task");
  m.slot = slot_field(f, 3, "task");
  m.count = field<uint64_t>(f, 4, "task");
  m.shared = flag_field(f, 5, "task");
  m.fresh = flag_field(f, 6, "task");
  return m;
}

std::optional<WorkerEvent> decode_done(int worker, const std::vector<std::string>& f) {
  if (f.empty() || f[0] != "done") return std::nullopt;
  if (f.size() < 12) {
    throw DataError(fmt::format("malformed process worker \"done\" message: {} fields", f.size()));
  }
  WorkerEvent e;
  e.kind = WorkerEvent::Kind::kDone;
  e.worker = worker;
  e.batch = field<uint64_t>(f, 1, "done");
  e.slot = slot_field(f, 2, "done");
  const int kind = field<int>(f, 3, "done");
  if (kind < 0 || kind > static_cast<int>(TaskResult::Kind::kCancelled)) {
    throw DataError(fmt::format("malformed process worker \"done\" message: result kind {}", kind));
  }
  e.result.kind = static_cast<TaskResult::Kind>(kind);
  e.result.message = f[4];
  e.result.index = field<uint64_t>(f, 5, "done");
  e.result.key = f[6];
  e.result.read_ns = field<uint64_t>(f, 7, "done");
  e.result.transform_ns = field<uint64_t>(f, 8, "done");
  e.idle_ns = field<uint64_t>(f, 9, "done");
  e.result.position = field<uint64_t>(f, 11, "done");
  const auto skipped = field<uint64_t>(f, 10, "done");
  if (skipped > (f.size() - 12) / 5 || f.size() != 12 + 5 * skipped) {
    throw DataError(
        fmt::format("malformed process worker \"done\" message: {} skipped samples in {} fields",
                    skipped, f.size()));
  }
  for (size_t i = 12; i < f.size(); i += 5) {
    e.result.skipped.push_back({.position = field<uint64_t>(f, i, "done"),
                                .index = field<uint64_t>(f, i + 1, "done"),
                                .key = f[i + 2],
                                .reason = f[i + 3],
                                .substitute = field<uint64_t>(f, i + 4, "done")});
  }
  return e;
}

}  // namespace forkguard::data::detail
