// virtual_memory.cpp -- see virtual_memory.h.
#include "core/alloc/virtual_memory.h"

#include <algorithm>

#include "core/check.h"

namespace memsched {

void* VirtualRawMemory::allocate(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (bytes == 0 || bytes > capacity_bytes_ || outstanding_bytes_ > capacity_bytes_ - bytes) {
    ++refused_;
    return nullptr;
  }
  const uintptr_t address = next_address_;
  // Leave a 4 KiB gap so that neighbouring segments are never contiguous.
  next_address_ += (bytes + 4095) / 4096 * 4096 + 4096;
  live_.emplace(address, bytes);
  outstanding_bytes_ += bytes;
  peak_outstanding_bytes_ = std::max(peak_outstanding_bytes_, outstanding_bytes_);
  return reinterpret_cast<void*>(address);
}

void VirtualRawMemory::free(void* ptr, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(reinterpret_cast<uintptr_t>(ptr));
  MEMSCHED_CHECK(it != live_.end(), "VirtualRawMemory::free: ", ptr, " was not allocated here");
  MEMSCHED_CHECK(it->second == bytes, "VirtualRawMemory::free: ", ptr, " was allocated with ",
                 it->second, " bytes but freed with ", bytes);
  outstanding_bytes_ -= bytes;
  live_.erase(it);
}

void VirtualRawMemory::set_capacity(size_t capacity_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  capacity_bytes_ = capacity_bytes;
}
size_t VirtualRawMemory::capacity_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return capacity_bytes_;
}
size_t VirtualRawMemory::outstanding_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return outstanding_bytes_;
}
size_t VirtualRawMemory::outstanding_segments() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_.size();
}
size_t VirtualRawMemory::peak_outstanding_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_outstanding_bytes_;
}
size_t VirtualRawMemory::refused() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return refused_;
}

EventHandle ManualStreamEvents::record(StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  StreamCounters& c = streams_[stream];
  const EventHandle id = next_event_++;
  events_.emplace(id, EventRecord{stream, c.recorded++});
  if (immediate_) c.completed = c.recorded;
  return id;
}

bool ManualStreamEvents::query(EventHandle event) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = events_.find(event);
  MEMSCHED_CHECK(it != events_.end(), "ManualStreamEvents::query: unknown or released event ", event);
  return it->second.sequence < streams_[it->second.stream].completed;
}

void ManualStreamEvents::synchronize(EventHandle event) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = events_.find(event);
  MEMSCHED_CHECK(it != events_.end(), "ManualStreamEvents::synchronize: unknown event ", event);
  StreamCounters& c = streams_[it->second.stream];
  c.completed = std::max(c.completed, it->second.sequence + 1);
}

void ManualStreamEvents::release(EventHandle event) {
  std::lock_guard<std::mutex> lock(mutex_);
  MEMSCHED_CHECK(events_.erase(event) == 1, "ManualStreamEvents::release: unknown event ", event);
}

bool ManualStreamEvents::complete_next(StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  StreamCounters& c = streams_[stream];
  if (c.completed >= c.recorded) return false;
  ++c.completed;
  return true;
}

void ManualStreamEvents::complete_all(StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  StreamCounters& c = streams_[stream];
  c.completed = c.recorded;
}

void ManualStreamEvents::complete_everything() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [stream, c] : streams_) c.completed = c.recorded;
}

size_t ManualStreamEvents::live_events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_.size();
}

size_t ManualStreamEvents::unfinished_events(StreamHandle stream) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = streams_.find(stream);
  return it == streams_.end() ? 0 : static_cast<size_t>(it->second.recorded - it->second.completed);
}

}  // namespace memsched
