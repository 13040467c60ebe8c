// host_memory.h -- RawMemory over ordinary (pageable) host memory, for tests,
// CPU runs and the unpinned staging pool. Stream completion on the host is
// immediate: use ManualStreamEvents(immediate=true) from core alongside it.
#pragma once

#include <cstddef>
#include <limits>
#include <mutex>

#include "core/alloc/raw_memory.h"

namespace memsched {

class HostRawMemory : public RawMemory {
 public:
  // Segments are aligned to `alignment_bytes` (a power of two >= sizeof(void*));
  // allocate() refuses beyond `capacity_bytes` outstanding.
  explicit HostRawMemory(size_t alignment_bytes = 4096,
                         size_t capacity_bytes = std::numeric_limits<size_t>::max());
  void* allocate(size_t bytes) override;
  void free(void* ptr, size_t bytes) override;
  const char* name() const override { return "host"; }
  size_t outstanding_bytes() const;

 private:
  size_t alignment_bytes_;        // alignment of every segment
  size_t capacity_bytes_;         // refuse above this many outstanding bytes
  mutable std::mutex mutex_;
  size_t outstanding_bytes_ = 0;  // allocated and not yet freed
};

}  // namespace memsched
