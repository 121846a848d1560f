#include "forkguard/data/loader.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include "data/batch_storage.hpp"
#include "data/device.hpp"
#include "data/producer.hpp"
#include "data/slot.hpp"
#include "data/workers.hpp"
#include "detail/registry.hpp"

namespace forkguard::data {
namespace {

forkguard::detail::Registry<WorkerInit>& hooks() {
  static forkguard::detail::Registry<WorkerInit> r("worker init hook",
                                                   "forkguard::data::register_worker_init");
  return r;
}

double seconds(uint64_t ns) {
  return static_cast<double>(ns) * 1e-9;
}

// "3, 8-15, 20": sample indices, runs compressed.
std::string format_indices(const std::vector<size_t>& v) {
  std::string out;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += j > i ? fmt::format("{}-{}", v[i], v[j]) : fmt::format("{}", v[i]);
    i = j + 1;
  }
  return out;
}

}  // namespace

bool register_worker_init(const std::string& name, WorkerInit fn, const char* file, int line) {
  return hooks().add(name, fn, file, line);
}

namespace detail {

WorkerInit find_worker_init(const std::string& name) {
  auto fn = hooks().find(name);
  if (!fn) throw DataError(hooks().unknown(name));
  return *fn;
}

class LoaderImpl {
 public:
  LoaderImpl(std::shared_ptr<const Dataset> dataset, std::shared_ptr<const Transform> transform,
             LoaderOptions options)
      : ds_(std::move(dataset)), tf_(std::move(transform)), o_(std::move(options)) {
    if (!ds_ || !tf_) throw DataError("Loader: the dataset and the transform must not be null");
    if (o_.batch_size == 0) throw DataError("Loader: batch_size must be at least 1");
    if (o_.prefetch == 0) throw DataError("Loader: prefetch must be at least 1");
    if (o_.workers > kMaxWorkers) {
      throw DataError(
          fmt::format("Loader: workers must be at most {}, not {}", kMaxWorkers, o_.workers));
    }
    if (o_.key_bytes == 0) throw DataError("Loader: key_bytes must be at least 1");
    spec_ = tf_->output();
    if (spec_.bytes() == 0) {
      throw DataError(
          fmt::format("Loader: transform \"{}\" declares an empty output", tf_->name()));
    }
    if (!o_.worker_init.empty()) find_worker_init(o_.worker_init);  // fail early on a typo
    layout_ = SlotLayout::make(o_.batch_size, spec_.bytes(), o_.key_bytes);
    pool_ = std::make_shared<SlotPool>(layout_);
    if (o_.device.enabled) {
      device_ = std::make_shared<DeviceStage>(o_.device.ordinal,
                                              std::max<size_t>(1, o_.device.buffers), layout_);
      pool_->set_on_destroy([dev = device_](Slot& s) { dev->unpin(s); });
    }
    if (o_.sampler) {
      sampler_ = o_.sampler;
    } else if (o_.distributed) {
      sampler_ = std::make_shared<DistributedSampler>(
          ds_->size(), DistributedOptions{.shuffle = o_.shuffle, .seed = o_.seed});
    } else if (o_.shuffle) {
      sampler_ = std::make_shared<RandomSampler>(ds_->size(), o_.seed);
    } else {
      sampler_ = std::make_shared<SequentialSampler>(ds_->size());
    }
    size_ = make_batches(sampler_->indices(0), o_.batch_size, o_.drop_last).size();
    if (!o_.log)
      o_.log = [](const std::string& m) { std::fprintf(stderr, "forkguard: %s\n", m.c_str()); };
    producer_config_ = ProducerConfig{o_.seed, o_.bad_sample, o_.max_substitutes, layout_,
                                      o_.worker_kind == WorkerKind::kProcess && o_.workers > 0};
  }

  ~LoaderImpl() {
    try {
      abandon(true);
      wait_copies();
    } catch (...) {
      // a destructor reports nothing; every resource below is released by RAII regardless
    }
  }

  std::optional<Batch> next() {
    if (!in_epoch_) begin_epoch();
    const auto wait_start = Clock::now();
    while (true) {
      if (delivered_ == batches_.size()) {
        end_epoch();
        return std::nullopt;
      }
      reclaim_copies();
      issue();
      if (auto b = deliverable()) {
        stats_.consumer_wait_seconds +=
            std::chrono::duration<double>(Clock::now() - wait_start).count();
        return deliver(*b);
      }
      if (!workers_) {
        produce_inline(next_deliver_);
        continue;
      }
      std::optional<Clock::time_point> deadline;
      if (o_.timeout.count() > 0) deadline = wait_start + o_.timeout;
      auto until = deadline;
      if (!copying_.empty()) {
        auto soon = Clock::now() + std::chrono::milliseconds(1);
        if (!until || soon < *until) until = soon;
      }
      auto ev = workers_->wait(until);
      if (ev) {
        handle(std::move(*ev));
      } else if (deadline && Clock::now() >= *deadline) {
        timed_out();
      }
    }
  }

  void set_epoch(uint64_t epoch) {
    if (in_epoch_) abandon(false);
    epoch_ = epoch;
  }

  uint64_t epoch() const { return epoch_; }
  bool in_epoch() const { return in_epoch_; }
  size_t size() const { return size_; }
  size_t dataset_size() const { return ds_->size(); }
  const OutputSpec& output_spec() const { return spec_; }
  LoaderStats stats() const {
    LoaderStats s = stats_;
    s.slots = pool_->count();
    s.slot_bytes = layout_.total;
    return s;
  }
  std::vector<pid_t> worker_pids() const {
    return workers_ ? workers_->pids() : std::vector<pid_t>{};
  }

 private:
  struct Pending {
    enum class State { kIssued, kDone, kFailed, kCopying };
    State state = State::kIssued;
    int worker = 0;              // the slot's worker (and the batch's, unless it was split)
    std::vector<int> waiting;    // the workers still filling a part of it
    size_t failed_position = 0;  // the failing sample's position, once a part failed
    int failed_worker = -1;      // the worker that filled it
    int slot = -1;
    int buffer = -1;
    TaskResult result;
    std::string death;            // the worker died holding it
    std::vector<int64_t> labels;  // device batches: host copies taken before the slot recycles
    std::vector<char> keys;
  };
  struct Copy {
    int slot;
    int buffer;
    int worker;
  };

  int workers() const { return static_cast<int>(o_.workers); }

  void begin_epoch() {
    batches_ = make_batches(sampler_->indices(epoch_), o_.batch_size, o_.drop_last);
    size_ = batches_.size();
    next_issue_ = next_deliver_ = delivered_ = 0;
    pending_.clear();
    in_flight_.assign(static_cast<size_t>(std::max(1, workers())), 0);
    for (const auto& c : copying_) ++in_flight_[static_cast<size_t>(c.worker)];
    // A worker that died after its last batch of the previous epoch was delivered: nothing was
    // lost, but its pool cannot serve this epoch. Start a fresh one (counted as restarts).
    if (std::any_of(dead_.begin(), dead_.end(), [](const std::string& d) { return !d.empty(); })) {
      stop_workers(true);
    }
    dead_.assign(in_flight_.size(), std::string());
    if (workers() > 0 && !workers_) {
      start_workers();
      // The first tasks travel while the workers build their pipelines; a worker that cannot
      // start fails the whole start, as before, and its tasks are abandoned.
      issue();
      try {
        workers_->await_started();
      } catch (...) {
        abandon(true);
        throw;
      }
    }
    in_epoch_ = true;
  }

  void end_epoch() {
    in_epoch_ = false;
    ++epoch_;
    if (!o_.persistent_workers) stop_workers();
  }

  void start_workers() {
    WorkerSetup setup{
        ds_.get(),
        tf_.get(),
        producer_config_,
        workers(),
        epoch_,
        o_.worker_init,
        pool_,
        o_.start_timeout,
        std::make_shared<
            std::pair<std::shared_ptr<const Dataset>, std::shared_ptr<const Transform>>>(ds_, tf_)};
    workers_ = o_.worker_kind == WorkerKind::kThread
                   ? start_thread_workers(setup)
                   : start_process_workers(setup, o_.process_start);
    stats_.worker_starts += o_.workers;
    if (started_once_) stats_.worker_restarts += o_.workers;
    started_once_ = true;
  }

  void stop_workers(bool now = false) {
    if (!workers_) return;
    workers_->stop(now);
    workers_.reset();
  }

  std::function<void(Slot&)> on_create() {
    if (!device_) return {};
    return [dev = device_](Slot& s) { dev->pin(s); };
  }

  // Whether the slot's first task is starting now. Its images are then written through its fd, not
  // its mapping (Producer::run): except by threads into a pinned slot, whose pages pinning has
  // already allocated and mapped in this process.
  bool take_fresh(Slot& slot) const {
    const bool fresh = !slot.written &&
                       !(slot.pinned && (o_.worker_kind == WorkerKind::kThread || o_.workers == 0));
    slot.written = true;
    return fresh;
  }

  void issue() {
    if (!workers_) return;
    while (next_issue_ < batches_.size()) {
      const size_t b = next_issue_;
      const int w = static_cast<int>(b % o_.workers);
      auto& flight = in_flight_[static_cast<size_t>(w)];
      if (!dead_[static_cast<size_t>(w)].empty()) {
        Pending p;
        p.state = Pending::State::kFailed;
        p.worker = w;
        p.death = dead_[static_cast<size_t>(w)];
        pending_[b] = std::move(p);
        ++next_issue_;
        continue;
      }
      if (flight >= o_.prefetch) break;
      Slot& slot = pool_->acquire(w, on_create());
      Pending p;
      p.worker = w;
      p.slot = slot.id;
      ++flight;
      // The epoch's first batch is shared by every live worker: nothing else is ready to run in
      // parallel with it, and its latency is the time to the first batch. Each worker claims
      // one position at a time from the slot's counter, so they finish together however the
      // samples' costs fall. The bytes are the same (each sample is a pure function of seed,
      // epoch and index).
      const auto& all = batches_[b];
      std::vector<int> parts;
      if (b == 0 && o_.split_first_batch) {
        for (int k = 0; k < workers(); ++k) {
          if (dead_[static_cast<size_t>(k)].empty()) parts.push_back(k);
        }
      }
      if (parts.size() < 2 || all.size() < 2 * parts.size()) parts = {w};
      p.waiting = parts;
      pending_[b] = std::move(p);
      const bool shared = parts.size() > 1;
      if (shared) {
        std::atomic_ref<uint32_t>(
            *reinterpret_cast<uint32_t*>(slot.memory.data() + layout_.claim_offset))
            .store(0, std::memory_order_relaxed);  // published by the submit (a lock, a syscall)
      }
      const bool fresh = take_fresh(slot);
      for (int part : parts) workers_->submit(part, Task{epoch_, b, slot.id, all, shared, fresh});
      ++next_issue_;
    }
  }

  void produce_inline(size_t b) {
    Slot& slot = pool_->acquire(0, on_create());
    Producer producer(*ds_, *tf_, producer_config_);
    Pending p;
    p.slot = slot.id;
    p.result = producer.run(epoch_, batches_[b], slot.memory.data(),
                            {.fresh_fd = take_fresh(slot) ? slot.memory.fd() : -1});
    p.state =
        p.result.kind == TaskResult::Kind::kOk ? Pending::State::kDone : Pending::State::kFailed;
    stats_.read_seconds += seconds(p.result.read_ns);
    stats_.transform_seconds += seconds(p.result.transform_ns);
    ++in_flight_[0];
    pending_[b] = std::move(p);
    if (next_issue_ <= b) next_issue_ = b + 1;
  }

  // The batch to deliver now, if one is ready.
  std::optional<size_t> deliverable() const {
    if (o_.delivery == Delivery::kInOrder) {
      auto it = pending_.find(next_deliver_);
      if (it == pending_.end() || it->second.state == Pending::State::kIssued) return std::nullopt;
      return next_deliver_;
    }
    for (const auto& [b, p] : pending_) {
      if (p.state != Pending::State::kIssued) return b;
    }
    return std::nullopt;
  }

  void handle(WorkerEvent ev) {
    if (ev.kind == WorkerEvent::Kind::kDone) {
      auto it = pending_.find(ev.batch);
      if (it == pending_.end() || it->second.state != Pending::State::kIssued) {
        return;  // a batch of an abandoned epoch
      }
      auto& p = it->second;
      stats_.read_seconds += seconds(ev.result.read_ns);
      stats_.transform_seconds += seconds(ev.result.transform_ns);
      stats_.slot_wait_seconds += seconds(ev.idle_ns);
      if (auto w = std::find(p.waiting.begin(), p.waiting.end(), ev.worker); w != p.waiting.end()) {
        p.waiting.erase(w);
      }
      merge(p, std::move(ev));
      if (!p.waiting.empty()) return;
      std::sort(
          p.result.skipped.begin(), p.result.skipped.end(),
          [](const SkippedSample& a, const SkippedSample& b) { return a.position < b.position; });
      p.state =
          p.result.kind == TaskResult::Kind::kOk ? Pending::State::kDone : Pending::State::kFailed;
      return;
    }
    // A worker died: every batch it held fails, and so does every batch it would have been given.
    const pid_t pid = workers_->pid(ev.worker);
    std::vector<size_t> held_batches, held;
    auto holds = [&](const Pending& p) {
      return p.state == Pending::State::kIssued &&
             std::find(p.waiting.begin(), p.waiting.end(), ev.worker) != p.waiting.end();
    };
    for (auto& [b, p] : pending_) {
      if (holds(p)) {
        held_batches.push_back(b);
        held.insert(held.end(), batches_[b].begin(), batches_[b].end());
      }
    }
    std::string who = o_.worker_kind == WorkerKind::kThread
                          ? fmt::format("worker {} (a thread)", ev.worker)
                          : fmt::format("worker {} (PID {})", ev.worker, pid);
    std::string death =
        held.empty() ? fmt::format("{} {}", who, ev.how)
                     : fmt::format("{} {} while holding batch{} {} of epoch {} (samples {})", who,
                                   ev.how, held_batches.size() > 1 ? "es" : "",
                                   format_indices(held_batches), epoch_, format_indices(held));
    dead_[static_cast<size_t>(ev.worker)] = death;
    for (auto& [b, p] : pending_) {
      if (holds(p)) {
        p.state = Pending::State::kFailed;
        p.death = death;
      }
    }
  }

  // One finished part of a batch into its result: the skipped samples of every part; the earliest
  // failing sample (a worker that found CUDA state before any bad sample).
  static void merge(Pending& p, WorkerEvent ev) {
    auto& r = p.result;
    r.skipped.insert(r.skipped.end(), std::make_move_iterator(ev.result.skipped.begin()),
                     std::make_move_iterator(ev.result.skipped.end()));
    const auto kind = ev.result.kind;
    if (kind == TaskResult::Kind::kOk) return;
    // kOk < kData < kInternal < kCuda: a stopped worker outweighs a bad sample. (kCancelled
    // comes only after stop(now), whose events nobody reads.)
    const bool worse = static_cast<int>(kind) > static_cast<int>(r.kind) ||
                       (kind == r.kind && ev.result.position < p.failed_position);
    if (!worse) return;
    auto skipped = std::move(r.skipped);
    r = std::move(ev.result);
    r.skipped = std::move(skipped);
    p.failed_position = ev.result.position;
    p.failed_worker = ev.worker;
  }

  [[noreturn]] void timed_out() {
    size_t b = next_deliver_;
    if (o_.delivery == Delivery::kAsReady && !pending_.empty()) b = pending_.begin()->first;
    std::string who = "the consumer's thread";
    if (auto it = pending_.find(b); it != pending_.end() && workers_) {
      // The workers still filling it (more than one for a split first batch).
      auto waiting = it->second.waiting;
      if (waiting.empty()) waiting.push_back(it->second.worker);
      who.clear();
      for (int w : waiting) {
        who += (who.empty() ? "" : " and ") +
               (o_.worker_kind == WorkerKind::kThread
                    ? fmt::format("worker {} (a thread)", w)
                    : fmt::format("worker {} (PID {})", w, workers_->pid(w)));
      }
    }
    std::string msg = fmt::format("batch {} of epoch {} was not ready within {} ms; waiting on {}",
                                  b, epoch_, o_.timeout.count(), who);
    abandon_epoch();
    throw TimeoutError(msg);
  }

  bool start_copy(size_t b, Pending& p, bool grow) {
    int buffer = device_->acquire(grow);
    if (buffer < 0) return false;
    const Slot& slot = pool_->get(p.slot);
    const size_t n = batches_[b].size();
    auto t0 = Clock::now();
    device_->copy(slot, buffer, n);
    stats_.copy_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    const std::byte* base = slot.memory.data();
    p.labels.resize(n);
    std::memcpy(p.labels.data(), base + layout_.labels_offset, n * sizeof(int64_t));
    p.keys.assign(
        reinterpret_cast<const char*>(base + layout_.keys_offset),
        reinterpret_cast<const char*>(base + layout_.keys_offset) + n * layout_.key_bytes);
    copying_.push_back({p.slot, buffer, p.worker});
    p.buffer = buffer;
    p.state = Pending::State::kCopying;
    return true;
  }

  void reclaim_copies() {
    std::erase_if(copying_, [&](const Copy& c) {
      if (!device_->complete(c.buffer)) return false;
      pool_->release(c.slot);
      --in_flight_[static_cast<size_t>(c.worker)];
      return true;
    });
  }

  void wait_copies() {
    for (const auto& c : copying_) {
      device_->wait(c.buffer);
      pool_->release(c.slot);
    }
    copying_.clear();
  }

  // The batch leaves pending_: counted as delivered, whatever the outcome.
  void retire(size_t b) {
    pending_.erase(b);
    ++delivered_;
    if (o_.delivery == Delivery::kInOrder || !workers_) ++next_deliver_;  // inline: in order
  }

  Batch deliver(size_t b) {
    Pending& p = pending_.at(b);
    if (p.state == Pending::State::kFailed) {
      if (p.death.empty() && p.result.kind == TaskResult::Kind::kData) {
        // A bad sample: this batch is lost (and said so); the epoch goes on.
        if (p.slot >= 0) {
          pool_->release(p.slot);
          --in_flight_[static_cast<size_t>(p.worker)];
        }
        DataError e(fmt::format("batch {} of epoch {}: {}", b, epoch_, p.result.message),
                    p.result.index, p.result.key);
        retire(b);
        throw e;
      }
      // A worker died or stopped itself: the epoch is over.
      const int w = p.failed_worker >= 0 ? p.failed_worker : p.worker;
      const pid_t pid = workers_ ? workers_->pid(w) : 0;
      std::string msg = !p.death.empty()
                            ? p.death
                            : fmt::format("worker {} (PID {}) stopped at batch {} of epoch {}: {}",
                                          w, pid, b, epoch_, p.result.message);
      std::vector<size_t> indices = batches_[b];
      abandon_epoch();
      throw WorkerError(msg, w, pid, std::move(indices));
    }
    auto st = std::make_shared<BatchStorage>();
    st->count = batches_[b].size();
    st->number = b;
    st->epoch = epoch_;
    st->indices = batches_[b];
    st->skipped = std::move(p.result.skipped);
    st->spec = spec_;
    st->layout = layout_;
    for (const auto& s : st->skipped) {
      ++stats_.skipped;
      if (logged_skips_.insert(s.index).second) {
        o_.log(
            fmt::format("skipped sample {} ({}) in batch {} of epoch {}: {}; sample {} takes "
                        "its place",
                        s.index, s.key, b, epoch_, s.reason, s.substitute));
      }
    }
    if (device_) {
      if (p.state != Pending::State::kCopying) start_copy(b, p, true);
      st->device = device_;
      st->buffer = p.buffer;
      st->labels_copy = std::move(p.labels);
      st->keys_copy = std::move(p.keys);
      st->images = reinterpret_cast<void*>(device_->images(p.buffer));
      st->device_labels = device_->labels(p.buffer);
      st->labels = st->labels_copy.data();
      st->keys = st->keys_copy.data();
    } else {
      std::byte* base = pool_->get(p.slot).memory.data();
      st->pool = pool_;
      st->slot = p.slot;
      st->images = base;
      st->labels = reinterpret_cast<const int64_t*>(base + layout_.labels_offset);
      st->keys = reinterpret_cast<const char*>(base + layout_.keys_offset);
      --in_flight_[static_cast<size_t>(p.worker)];
    }
    ++stats_.batches;
    stats_.samples += st->count;
    retire(b);
    if (device_) prefetch_copies();
    return Batch(std::move(st));
  }

  // Double buffering: start the copies of the finished batches that come next, into free device
  // buffers (never new ones: those are for batches the consumer holds).
  void prefetch_copies() {
    for (auto& [b, p] : pending_) {
      if (p.state == Pending::State::kCopying) continue;
      if (p.state != Pending::State::kDone) {
        if (o_.delivery == Delivery::kInOrder) break;
        continue;
      }
      if (!start_copy(b, p, false)) break;
    }
  }

  // A worker died, stopped or timed out: the epoch is over, and the next call to next() starts
  // the following one with fresh workers (set_epoch() replays it).
  void abandon_epoch() {
    abandon(true);
    ++epoch_;
  }

  // Ends the epoch early. stop: the workers are stopped (they may be stuck or dead); otherwise the
  // tasks in flight are waited for, so persistent workers stay.
  void abandon(bool stop) {
    if (workers_ && !stop) {
      while (std::any_of(pending_.begin(), pending_.end(),
                         [](auto& kv) { return kv.second.state == Pending::State::kIssued; })) {
        auto ev = workers_->wait(Clock::now() + std::chrono::seconds(30));
        if (!ev) {
          stop = true;
          break;
        }
        const bool died = ev->kind == WorkerEvent::Kind::kDied;
        handle(std::move(*ev));
        if (died) stop = true;
      }
    }
    if (stop) stop_workers(true);
    for (auto& [b, p] : pending_) {
      if (p.state == Pending::State::kCopying) {
        device_->release(p.buffer);  // its slot is in copying_, reclaimed when the copy is done
      } else if (p.slot >= 0) {
        pool_->release(p.slot);
      }
    }
    pending_.clear();
    in_epoch_ = false;
  }

  std::shared_ptr<const Dataset> ds_;
  std::shared_ptr<const Transform> tf_;
  LoaderOptions o_;
  OutputSpec spec_;
  SlotLayout layout_;
  ProducerConfig producer_config_;
  std::shared_ptr<DeviceStage> device_;
  std::shared_ptr<SlotPool> pool_;
  std::shared_ptr<const Sampler> sampler_;
  std::unique_ptr<Workers> workers_;
  bool started_once_ = false;

  uint64_t epoch_ = 0;
  bool in_epoch_ = false;
  size_t size_ = 0;
  std::vector<std::vector<size_t>> batches_;
  size_t next_issue_ = 0;
  size_t next_deliver_ = 0;
  size_t delivered_ = 0;
  std::map<size_t, Pending> pending_;
  std::vector<size_t> in_flight_;
  std::vector<std::string> dead_;
  std::vector<Copy> copying_;
  std::set<size_t> logged_skips_;
  LoaderStats stats_;
};

}  // namespace detail

Loader::Loader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<const Transform> transform,
               LoaderOptions options)
    : impl_(std::make_unique<detail::LoaderImpl>(std::move(dataset), std::move(transform),
                                                 std::move(options))) {}
Loader::~Loader() = default;
std::optional<Batch> Loader::next() {
  return impl_->next();
}
void Loader::set_epoch(uint64_t epoch) {
  impl_->set_epoch(epoch);
}
uint64_t Loader::epoch() const {
  return impl_->epoch();
}
bool Loader::in_epoch() const {
  return impl_->in_epoch();
}
size_t Loader::size() const {
  return impl_->size();
}
size_t Loader::dataset_size() const {
  return impl_->dataset_size();
}
const OutputSpec& Loader::output_spec() const {
  return impl_->output_spec();
}
LoaderStats Loader::stats() const {
  return impl_->stats();
}
std::vector<pid_t> Loader::worker_pids() const {
  return impl_->worker_pids();
}

}  // namespace forkguard::data
