// block_pool.h -- memsched's caching allocator: a pool of blocks carved out of
// backend segments, with best-fit reuse, splitting, coalescing and
// stream-ordered reuse. No CUDA here: memory comes from a RawMemory, stream
// completion from a StreamEvents (raw_memory.h).
//
// Entry points: BlockPool::malloc / free / record_stream / empty_cache /
// stats / snapshot / check_invariants.
//
// Note [Stream-ordered reuse]
//   Rationale: on a GPU, free() runs on the host while kernels that read the
//   block may still be queued. A block is owned by the stream it was
//   allocated on; work on that stream is ordered after the free, so the block
//   can be reused at once -- but only by requests on the same stream. If the
//   user also used it on other streams (record_stream), reusing it before
//   those streams are done would corrupt their reads.
//   Approach: free() of a block with recorded streams records one event per
//   such stream and parks the block as "pending free" (still active, no longer
//   allocated). Pending frees are retired at the start of every malloc (and by
//   empty_cache / the out-of-memory retry, which wait for all events): a
//   stream's queue is scanned until its first unfinished event, because events
//   on one stream complete in order.
//   Limitations: a block is never handed to a different stream, even when free
//   (as in PyTorch); cross-stream reuse needs empty_cache().
//
// Note [Allocation fallback chain]
//   malloc(size, stream) =
//       retire finished pending frees
//    || best-fit free block of (pool, stream)       (split if worth it)
//    || new segment from the backend
//    || (++num_alloc_retries; wait for all events; best-fit again)
//    || (release every cached unsplit segment; new segment)
//    || throw OutOfMemoryError (requested, reserved, allocated, largest free).
//
// WARNING: the backend's allocate/free run under the pool's mutex (as in
// PyTorch): a slow cudaMalloc stalls other threads' allocations meanwhile.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/alloc/alloc_stats.h"
#include "core/alloc/pool_options.h"
#include "core/alloc/raw_memory.h"
#include "core/check.h"

namespace memsched {

// Thrown when the backend refuses memory even after the cache was released.
class OutOfMemoryError : public Error {
 public:
  explicit OutOfMemoryError(const std::string& what) : Error(what) {}
};

enum class BlockState { kActiveAllocated, kActivePendingFree, kInactive };
const char* to_string(BlockState state);  // PyTorch's spellings: "active_allocated", ...

struct BlockInfo {
  uintptr_t address = 0;        // start of the block
  size_t size = 0;              // bytes of the block (rounded, maybe with an unsplit rest)
  size_t requested_size = 0;    // bytes the user asked for; 0 when free
  BlockState state = BlockState::kInactive;
};

struct SegmentInfo {
  uintptr_t address = 0;        // start of the segment
  size_t total_size = 0;        // bytes obtained from the backend
  size_t allocated_size = 0;    // bytes of active-allocated blocks
  size_t active_size = 0;       // bytes of active blocks (allocated or pending free)
  size_t requested_size = 0;    // bytes requested by the user in this segment
  StreamHandle stream = 0;      // owning stream
  bool is_small = false;        // small pool (true) or large pool
  std::vector<BlockInfo> blocks;// in address order; sizes sum to total_size
};

enum class TraceAction { kAlloc, kFreeRequested, kFreeCompleted, kSegmentAlloc, kSegmentFree, kOom };
const char* to_string(TraceAction action);  // PyTorch's spellings: "alloc", "segment_free", ...

struct TraceEntry {
  TraceAction action = TraceAction::kAlloc;
  uintptr_t address = 0;        // block or segment address (0 for an oom)
  size_t size = 0;              // bytes
  StreamHandle stream = 0;      // stream of the block/segment
  int64_t time_us = 0;          // steady-clock microseconds
};

class BlockPool {
 public:
  // `events` may be null: record_stream() then throws.
  BlockPool(std::shared_ptr<RawMemory> raw, std::shared_ptr<StreamEvents> events,
            PoolOptions options = PoolOptions());
  ~BlockPool();  // returns every segment to the backend (blocks still in use leak to nobody)
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A block of at least `bytes` usable on `stream`. Zero bytes gives nullptr.
  // Throws OutOfMemoryError (See Note [Allocation fallback chain]).
  void* malloc(size_t bytes, StreamHandle stream = 0);
  // Return a block from malloc; null is a no-op. A block with recorded
  // streams stays reserved until their events complete.
  void free(void* ptr);
  // Mark that `ptr` is in use on `stream` (PyTorch's Tensor.record_stream).
  void record_stream(void* ptr, StreamHandle stream);
  // Wait for all outstanding events, then give every unsplit free segment back.
  void empty_cache();
  // Retire pending frees whose events have completed (malloc does this too).
  void process_events();

  // True if `ptr` is a live (allocated) block of this pool.
  bool owns(const void* ptr) const;
  // Size of the block holding the allocation at `ptr` (>= the rounded request).
  size_t block_size(const void* ptr) const;
  AllocatorStats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  std::vector<SegmentInfo> snapshot() const;
  size_t largest_free_block() const;
  size_t pending_free_blocks() const;  // blocks waiting on events
  const PoolOptions& options() const { return options_; }
  const char* backend_name() const { return raw_->name(); }

  // History of alloc/free/segment events for the memory visualiser; off by default.
  void record_history(bool enabled, size_t max_entries = 100000);
  std::vector<TraceEntry> history() const;

  // Throws memsched::Error on the first broken invariant:
  //   segments do not overlap; each segment's blocks tile it exactly with
  //   consistent prev/next links; no two free neighbours (coalescing);
  //   free sets == free blocks; allocated + pending + free bytes == reserved;
  //   every statistic's current value equals its recomputation.
  void check_invariants() const;

 private:
  struct Block;
  struct BlockLess {
    bool operator()(const Block* a, const Block* b) const;
  };
  using FreeSet = std::set<Block*, BlockLess>;
  struct PendingEvent {
    EventHandle event;
    Block* block;
  };

  FreeSet& free_set(bool is_small) { return is_small ? small_free_ : large_free_; }
  const FreeSet& free_set(bool is_small) const { return is_small ? small_free_ : large_free_; }
  Block* new_block();               // See Note [Recycled Block objects]
  void recycle_block(Block* block);
  Block* find_free_block(bool is_small, StreamHandle stream, size_t rounded);
  Block* allocate_segment(bool is_small, size_t segment_bytes, StreamHandle stream);
  Block* take_block(Block* block, size_t rounded, size_t requested);
  void insert_free(Block* block);
  void erase_free(Block* block);
  void free_block(Block* block);  // merge with free neighbours, return to the free set
  void retire_events_locked(bool wait);
  void release_cached_segments();
  void release_segment(Block* block);
  void add_trace(TraceAction action, uintptr_t address, size_t size, StreamHandle stream);
  size_t largest_free_block_locked() const;
  [[noreturn]] void throw_oom(size_t requested, size_t rounded, size_t segment_bytes,
                              StreamHandle stream);

  std::shared_ptr<RawMemory> raw_;
  std::shared_ptr<StreamEvents> events_;
  PoolOptions options_;
  mutable std::mutex mutex_;
  FreeSet small_free_;
  FreeSet large_free_;
  std::unordered_map<uintptr_t, Block*> active_;  // address -> allocated or pending block
  std::map<uintptr_t, Block*> segments_;          // segment address -> head block
  std::map<StreamHandle, std::deque<PendingEvent>> pending_;  // per recording stream
  size_t pending_event_count_ = 0;
  AllocatorStats stats_;
  bool history_enabled_ = false;
  size_t history_max_entries_ = 0;
  std::deque<TraceEntry> history_;
  static constexpr size_t kMaxSpareBlocks = 64;
  std::vector<Block*> spare_blocks_;              // recycled Block objects
  std::vector<std::unordered_map<uintptr_t, Block*>::node_type> spare_nodes_;  // recycled map nodes
};

}  // namespace memsched
