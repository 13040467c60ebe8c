// fake_gpu.h -- a test double for the block pool's two interfaces
// (core/alloc/raw_memory.h) that models what a GPU does with them, so that
// tests can check the property users care about: no block is handed out
// while a stream may still touch it.
//
//   streams   each a FIFO of work items: a kernel touching a byte range, or
//             an event marker. run_next(stream) executes one item; nothing
//             runs unless the test says so (a stream is as slow as you like).
//   events    record() enqueues a marker; query() is true once the stream
//             has run past it; synchronize() runs the stream up to it.
//   memory    first fit over a fixed address range, reusing freed addresses
//             (unlike VirtualRawMemory), so an early reuse is a real overlap.
//             free() synchronises the device first, as cudaFree does.
//
// The driver marks a kernel `foreign` when it runs on a stream other than the
// one that allocated the block (a record_stream use). free() of a segment
// that a foreign kernel may still touch is a violation even though cudaFree
// would wait: the pool must have waited for its events itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/alloc/raw_memory.h"
#include "core/check.h"

namespace memsched::testing {

class FakeGpu : public RawMemory, public StreamEvents {
 public:
  struct Touch {
    StreamHandle stream = 0;  // stream the kernel is queued on
    uintptr_t address = 0;    // first byte it touches
    size_t bytes = 0;         // bytes it touches
    bool foreign = false;     // queued on a stream other than the block's owner
  };

  explicit FakeGpu(size_t capacity_bytes) : capacity_bytes_(capacity_bytes) {
    free_ranges_.emplace(kBase, capacity_bytes);
  }

  // ---- RawMemory
  void* allocate(size_t bytes) override {
    for (auto it = free_ranges_.begin(); it != free_ranges_.end(); ++it) {
      if (it->second < bytes) continue;
      const uintptr_t address = it->first;
      const size_t rest = it->second - bytes;
      free_ranges_.erase(it);
      if (rest > 0) free_ranges_.emplace(address + bytes, rest);
      segments_.emplace(address, bytes);
      outstanding_bytes_ += bytes;
      return reinterpret_cast<void*>(address);
    }
    ++refused_;
    return nullptr;
  }
  void free(void* ptr, size_t bytes) override {
    const auto address = reinterpret_cast<uintptr_t>(ptr);
    auto seg = segments_.find(address);
    MEMSCHED_CHECK(seg != segments_.end() && seg->second == bytes, "FakeGpu::free: ", address,
                   " is not a segment of ", bytes, " bytes");
    if (auto t = unfinished_touch(address, bytes, /*foreign_only=*/true)) {
      violations_.push_back("segment " + std::to_string(address) + " returned to the device while stream " +
                            std::to_string(t->stream) + " may still touch it");
    }
    synchronize_device();  // cudaFree waits for the whole device
    segments_.erase(seg);
    outstanding_bytes_ -= bytes;
    auto next = free_ranges_.emplace(address, bytes).first;
    if (next != free_ranges_.begin()) {  // coalesce with the lower free range
      auto prev = std::prev(next);
      if (prev->first + prev->second == address) {
        prev->second += next->second;
        free_ranges_.erase(next);
        next = prev;
      }
    }
    auto after = std::next(next);
    if (after != free_ranges_.end() && next->first + next->second == after->first) {
      next->second += after->second;
      free_ranges_.erase(after);
    }
  }
  const char* name() const override { return "fake_gpu"; }

  // ---- StreamEvents
  EventHandle record(StreamHandle stream) override {
    MEMSCHED_CHECK(!failing_stream_ || *failing_stream_ != stream, "FakeGpu: recording an event on stream ",
                   stream, " failed (as a CUDA error would)");
    const EventHandle id = next_event_++;
    events_.emplace(id, EventState{stream, false});
    queues_[stream].push_back(Item{/*event=*/id, Touch{}});
    return id;
  }
  bool query(EventHandle event) override { return state(event).done; }
  void synchronize(EventHandle event) override {
    EventState& e = state(event);
    while (!e.done) run_next(e.stream);
  }
  void release(EventHandle event) override {
    MEMSCHED_CHECK(events_.erase(event) == 1, "FakeGpu::release: unknown event ", event);
  }

  // ---- the test's side
  // Make record() on `stream` throw (nullopt: never).
  void fail_records_on(std::optional<StreamHandle> stream) { failing_stream_ = stream; }
  // Queue a kernel on `stream` that touches [address, address + bytes).
  void launch(StreamHandle stream, uintptr_t address, size_t bytes, bool foreign) {
    queues_[stream].push_back(Item{0, Touch{stream, address, bytes, foreign}});
  }
  // Execute the oldest item queued on `stream`; false if it is idle.
  bool run_next(StreamHandle stream) {
    auto& q = queues_[stream];
    if (q.empty()) return false;
    const Item item = q.front();
    q.pop_front();
    if (item.event != 0) {
      auto it = events_.find(item.event);
      if (it != events_.end()) it->second.done = true;  // a released event may still be queued
    }
    return true;
  }
  void synchronize_device() {
    for (auto& [stream, q] : queues_) {
      while (run_next(stream)) {
      }
    }
  }
  // A queued kernel touching [address, address + bytes) on a stream other than
  // `except` (all streams when except is nullopt; foreign kernels only if asked).
  std::optional<Touch> unfinished_touch(uintptr_t address, size_t bytes, bool foreign_only,
                                        std::optional<StreamHandle> except = std::nullopt) const {
    for (const auto& [stream, q] : queues_) {
      if (except && stream == *except) continue;
      for (const Item& item : q) {
        const Touch& t = item.touch;
        if (item.event != 0 || (foreign_only && !t.foreign)) continue;
        if (t.address < address + bytes && address < t.address + t.bytes) return t;
      }
    }
    return std::nullopt;
  }
  size_t queued(StreamHandle stream) const {
    auto it = queues_.find(stream);
    return it == queues_.end() ? 0 : it->second.size();
  }
  size_t live_events() const { return events_.size(); }
  size_t outstanding_bytes() const { return outstanding_bytes_; }
  size_t refused() const { return refused_; }
  const std::vector<std::string>& violations() const { return violations_; }

  static constexpr uintptr_t kBase = uintptr_t{1} << 40;  // fake addresses start at 1 TiB

 private:
  struct Item {
    EventHandle event = 0;  // nonzero: an event marker
    Touch touch;            // otherwise: a kernel
  };
  struct EventState {
    StreamHandle stream;
    bool done;
  };
  EventState& state(EventHandle event) {
    auto it = events_.find(event);
    MEMSCHED_CHECK(it != events_.end(), "FakeGpu: unknown or released event ", event);
    return it->second;
  }

  size_t capacity_bytes_;
  std::map<uintptr_t, size_t> free_ranges_;   // address -> bytes, coalesced
  std::map<uintptr_t, size_t> segments_;      // address -> bytes handed out
  size_t outstanding_bytes_ = 0;
  size_t refused_ = 0;
  std::map<StreamHandle, std::deque<Item>> queues_;
  std::unordered_map<EventHandle, EventState> events_;
  EventHandle next_event_ = 1;
  std::vector<std::string> violations_;
  std::optional<StreamHandle> failing_stream_;  // record() on it throws
};

}  // namespace memsched::testing
