// alloc_stats.h -- the caching allocator's statistics, in PyTorch's shape:
// Stat{current, peak, allocated, freed} per figure and per pool (all / small /
// large), so a torch.cuda.memory_stats() user reads memsched's numbers with the
// same keys ("allocated_bytes.all.current", "reserved_bytes.large_pool.peak",
// "num_alloc_retries", ...). Entry points: AllocatorStats, flatten_stats().
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace memsched {

// One figure over time. COUNT figures count blocks/segments; SUM figures add bytes.
struct Stat {
  int64_t current = 0;    // value now
  int64_t peak = 0;       // max of current since the last reset_peak()
  int64_t allocated = 0;  // total ever added
  int64_t freed = 0;      // total ever removed

  void increase(int64_t amount) {
    current += amount;
    allocated += amount;
    peak = std::max(peak, current);
  }
  void decrease(int64_t amount) {
    current -= amount;
    freed += amount;
  }
  void reset_peak() { peak = current; }
  void reset_accumulated() { allocated = 0; freed = 0; }
};

enum PoolIndex : int { kAggregatePool = 0, kSmallPool = 1, kLargePool = 2, kNumPoolIndices = 3 };
using StatArray = std::array<Stat, kNumPoolIndices>;  // [all, small_pool, large_pool]

struct AllocatorStats {
  StatArray allocation;            // COUNT: user allocations not yet freed by the user
  StatArray segment;               // COUNT: segments obtained from the backend
  StatArray active;                // COUNT: blocks allocated or waiting on stream events
  StatArray inactive_split;        // COUNT: free blocks inside split segments
  StatArray allocated_bytes;       // SUM: bytes of blocks handed out and not yet freed
  StatArray reserved_bytes;        // SUM: bytes of all segments
  StatArray active_bytes;          // SUM: bytes of active blocks
  StatArray inactive_split_bytes;  // SUM: bytes of free blocks inside split segments
  StatArray requested_bytes;       // SUM: bytes the user asked for (before rounding)
  int64_t num_alloc_retries = 0;   // mallocs that had to free the cache and retry
  int64_t num_ooms = 0;            // mallocs that failed even after the retry
  int64_t num_sync_all_streams = 0;// times all outstanding events were waited for
  int64_t num_device_alloc = 0;    // RawMemory::allocate calls that succeeded
  int64_t num_device_free = 0;     // RawMemory::free calls

  void reset_peak();
  void reset_accumulated();
};

// (key, value) pairs named as torch.cuda.memory_stats() names them, e.g.
// "allocation.all.current", "active_bytes.small_pool.freed", "num_ooms".
std::vector<std::pair<std::string, int64_t>> flatten_stats(const AllocatorStats& stats);

}  // namespace memsched
