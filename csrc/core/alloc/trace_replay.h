// trace_replay.h -- replay a Trace's allocations and frees on a BlockPool, to
// measure what a caching allocator would reserve for that step.
//
// Entry point: replay_trace(trace, pool, steps) -> ReplayResult.
//
// Note [Replaying a step]
//   Tensors that exist before the step and outlive it (parameters, optimizer
//   state) are allocated once, in id order, before the first step and freed
//   after the last. In every step, op by op: tensors whose lifetime starts at
//   op i are allocated (id order) before it, tensors whose last
//   live op is i are freed after it; tensors that outlive the step
//   (kAfterStep) are freed at its end, as the next step's copy replaces them.
//   All on stream 0. Zero-byte tensors are skipped.
#pragma once

#include <cstdint>

#include "core/alloc/alloc_stats.h"
#include "core/alloc/block_pool.h"
#include "core/trace.h"

namespace memsched {

struct ReplayResult {
  int64_t peak_live_bytes = 0;      // max over time of requested bytes live (== trace peak)
  int64_t peak_reserved_bytes = 0;  // max over time of the pool's reserved bytes
  int64_t peak_allocated_bytes = 0; // max over time of the pool's allocated (rounded) bytes
  int64_t allocations = 0;          // malloc calls made
  AllocatorStats stats;             // the pool's statistics at the end

  double reserved_over_live() const {
    return peak_live_bytes > 0 ? static_cast<double>(peak_reserved_bytes) / peak_live_bytes : 1.0;
  }
};

// `pool` should be fresh (its peaks are read as the replay's peaks).
ReplayResult replay_trace(const Trace& trace, BlockPool& pool, int steps = 2);
// Same, on a fresh pool over VirtualRawMemory (no real memory is touched).
ReplayResult replay_trace(const Trace& trace, const PoolOptions& options, int steps = 2);

}  // namespace memsched
