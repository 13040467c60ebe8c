// virtual_memory.h -- RawMemory and StreamEvents that touch no real memory and
// no device: for tests, trace replay and placement experiments on any machine.
//
//   VirtualRawMemory    hands out unique, never-reused fake addresses (nothing
//                       may be read or written through them), refuses above an
//                       optional capacity, and checks every free against what
//                       it gave out.
//   ManualStreamEvents  events that complete when the test says so
//                       (complete_next / complete_all), in per-stream order, or
//                       at once (immediate mode); synchronize() completes.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <unordered_map>

#include "core/alloc/raw_memory.h"

namespace memsched {

class VirtualRawMemory : public RawMemory {
 public:
  explicit VirtualRawMemory(size_t capacity_bytes = std::numeric_limits<size_t>::max())
      : capacity_bytes_(capacity_bytes) {}
  void* allocate(size_t bytes) override;
  void free(void* ptr, size_t bytes) override;
  const char* name() const override { return "virtual"; }

  void set_capacity(size_t capacity_bytes);
  size_t capacity_bytes() const;
  size_t outstanding_bytes() const;   // allocated and not yet freed
  size_t outstanding_segments() const;
  size_t peak_outstanding_bytes() const;
  size_t refused() const;             // allocate() calls that returned nullptr

 private:
  mutable std::mutex mutex_;
  size_t capacity_bytes_;             // allocate() refuses above this many outstanding bytes
  uintptr_t next_address_ = uintptr_t{1} << 40;  // fake addresses start at 1 TiB
  std::unordered_map<uintptr_t, size_t> live_;   // address -> bytes
  size_t outstanding_bytes_ = 0;
  size_t peak_outstanding_bytes_ = 0;
  size_t refused_ = 0;
};

class ManualStreamEvents : public StreamEvents {
 public:
  explicit ManualStreamEvents(bool immediate = false) : immediate_(immediate) {}
  EventHandle record(StreamHandle stream) override;
  bool query(EventHandle event) override;
  void synchronize(EventHandle event) override;
  void release(EventHandle event) override;

  // Complete the oldest unfinished event on `stream`; false if none is left.
  bool complete_next(StreamHandle stream);
  void complete_all(StreamHandle stream);
  void complete_everything();
  size_t live_events() const;                      // recorded and not yet released
  size_t unfinished_events(StreamHandle stream) const;

 private:
  struct StreamCounters {
    uint64_t recorded = 0;   // events recorded on the stream so far
    uint64_t completed = 0;  // the first `completed` of them have completed
  };
  struct EventRecord {
    StreamHandle stream;     // where it was recorded
    uint64_t sequence;       // its index on that stream
  };
  mutable std::mutex mutex_;
  bool immediate_;
  EventHandle next_event_ = 1;
  std::map<StreamHandle, StreamCounters> streams_;
  std::unordered_map<EventHandle, EventRecord> events_;
};

}  // namespace memsched
