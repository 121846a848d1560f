// The messages between the loader and its process workers, as message fields
// (detail/seqpacket.hpp), encoded and decoded without a socket (tests/fuzz/worker_message_fuzz.cpp
// feeds the decoders arbitrary fields):
//
//   slot SLOT BYTES                                 loader -> worker, with the slot's memfd
//   task EPOCH BATCH SLOT COUNT SHARED FRESH        loader -> worker (the indices are in the slot)
//   done BATCH SLOT KIND MESSAGE INDEX KEY READ_NS TRANSFORM_NS IDLE_NS NSKIPPED POSITION
//        then per skipped sample: POSITION INDEX KEY REASON SUBSTITUTE
//                                                   worker -> loader, after each task
//
// Keys and reasons are file names and messages naming them: any bytes, so they travel as fields
// and never as JSON (whose dump() throws on bytes that are not UTF-8, and whose parse() threw
// nlohmann's exceptions on a malformed list, found by the fuzz target).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/producer.hpp"
#include "data/workers.hpp"

namespace forkguard::data::detail {

struct SlotMessage {
  int slot = 0;
  uint64_t bytes = 0;  // the memfd's size, mapped whole
};

struct TaskMessage {
  uint64_t epoch = 0;
  uint64_t batch = 0;
  int slot = 0;
  uint64_t count = 0;  // indices in the slot
  bool shared = false;
  bool fresh = false;  // the slot's first task: write its images through its fd
};

std::vector<std::string> encode_slot(const SlotMessage& m);
std::vector<std::string> encode_task(const TaskMessage& m);
std::vector<std::string> encode_done(uint64_t batch, int slot, const TaskResult& r,
                                     uint64_t idle_ns);

// nullopt: a message of another kind. Throw DataError naming the field when a message of that kind
// is malformed (a field count, a number that is not one, a slot below 0, an unknown result kind).
std::optional<SlotMessage> decode_slot(const std::vector<std::string>& f);
std::optional<TaskMessage> decode_task(const std::vector<std::string>& f);
std::optional<WorkerEvent> decode_done(int worker, const std::vector<std::string>& f);

}  // namespace forkguard::data::detail
