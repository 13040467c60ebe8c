// trace_replay.cpp -- see trace_replay.h, Note [Replaying a step].
#include "core/alloc/trace_replay.h"

#include <memory>
#include <vector>

#include "core/alloc/virtual_memory.h"
#include "core/check.h"

namespace memsched {

ReplayResult replay_trace(const Trace& trace, BlockPool& pool, int steps) {
  MEMSCHED_CHECK(steps >= 1, "replay_trace: steps must be >= 1, got ", steps);
  trace.validate();
  const auto n_ops = static_cast<int64_t>(trace.ops.size());
  ReplayResult result;
  std::vector<void*> ptr(trace.tensors.size(), nullptr);
  std::vector<std::vector<int64_t>> born(n_ops), dies(n_ops);
  std::vector<int64_t> persistent, outlive;
  for (const TensorRecord& t : trace.tensors) {
    if (t.bytes <= 0 || n_ops == 0) continue;
    if (t.producer_op == kBeforeStep && t.freed_after_op == kAfterStep) {
      persistent.push_back(t.id);
      continue;
    }
    born[trace.live_start(t)].push_back(t.id);
    if (t.freed_after_op == kAfterStep) outlive.push_back(t.id);
    else dies[t.freed_after_op].push_back(t.id);
  }
  auto alloc = [&](int64_t id) {
    ptr[id] = pool.malloc(static_cast<size_t>(trace.tensors[id].bytes), 0);
    ++result.allocations;
  };
  auto release = [&](int64_t id) {
    pool.free(ptr[id]);
    ptr[id] = nullptr;
  };
  for (int64_t id : persistent) alloc(id);
  for (int step = 0; step < steps; ++step) {
    for (int64_t op = 0; op < n_ops; ++op) {
      for (int64_t id : born[op]) alloc(id);
      for (int64_t id : dies[op]) release(id);
    }
    for (int64_t id : outlive) release(id);
  }
  for (int64_t id : persistent) release(id);
  result.stats = pool.stats();
  result.peak_live_bytes = result.stats.requested_bytes[kAggregatePool].peak;
  result.peak_reserved_bytes = result.stats.reserved_bytes[kAggregatePool].peak;
  result.peak_allocated_bytes = result.stats.allocated_bytes[kAggregatePool].peak;
  return result;
}

ReplayResult replay_trace(const Trace& trace, const PoolOptions& options, int steps) {
  BlockPool pool(std::make_shared<VirtualRawMemory>(), std::make_shared<ManualStreamEvents>(true),
                 options);
  return replay_trace(trace, pool, steps);
}

}  // namespace memsched
