// host_memory.cpp -- see host_memory.h.
#include "backend/host_memory.h"

#include <cstdlib>

#include "core/check.h"

namespace memsched {

HostRawMemory::HostRawMemory(size_t alignment_bytes, size_t capacity_bytes)
    : alignment_bytes_(alignment_bytes), capacity_bytes_(capacity_bytes) {
  MEMSCHED_CHECK(alignment_bytes_ >= sizeof(void*) && (alignment_bytes_ & (alignment_bytes_ - 1)) == 0,
                 "HostRawMemory: alignment_bytes must be a power of two >= ", sizeof(void*), ", got ",
                 alignment_bytes_);
}

void* HostRawMemory::allocate(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (bytes == 0 || bytes > capacity_bytes_ || outstanding_bytes_ > capacity_bytes_ - bytes) return nullptr;
    outstanding_bytes_ += bytes;
  }
  const size_t rounded = (bytes + alignment_bytes_ - 1) / alignment_bytes_ * alignment_bytes_;
  void* ptr = std::aligned_alloc(alignment_bytes_, rounded);
  if (ptr == nullptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    outstanding_bytes_ -= bytes;
  }
  return ptr;
}

void HostRawMemory::free(void* ptr, size_t bytes) {
  std::free(ptr);
  std::lock_guard<std::mutex> lock(mutex_);
  outstanding_bytes_ -= bytes;
}

size_t HostRawMemory::outstanding_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return outstanding_bytes_;
}

}  // namespace memsched
