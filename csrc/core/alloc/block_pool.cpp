// block_pool.cpp -- see block_pool.h and its Notes.
#include "core/alloc/block_pool.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <sstream>

namespace memsched {

struct BlockPool::Block {
  uintptr_t address = 0;         // start of the block
  size_t size = 0;               // bytes
  size_t requested = 0;          // bytes asked for by the user (0 when free)
  StreamHandle stream = 0;       // owning stream (the segment's)
  bool is_small = false;         // small or large pool
  bool allocated = false;        // handed out and not yet freed by the user
  bool pending = false;          // freed by the user, waiting on events
  int pending_events = 0;        // events still to complete before reuse
  Block* prev = nullptr;         // lower neighbour in the segment
  Block* next = nullptr;         // upper neighbour in the segment
  std::vector<StreamHandle> stream_uses;  // other streams that used it (record_stream)

  bool is_split() const { return prev != nullptr || next != nullptr; }
  bool is_free() const { return !allocated && !pending; }
};

bool BlockPool::BlockLess::operator()(const Block* a, const Block* b) const {
  if (a->stream != b->stream) return a->stream < b->stream;
  if (a->size != b->size) return a->size < b->size;
  return a->address < b->address;
}

const char* to_string(BlockState state) {
  switch (state) {
    case BlockState::kActiveAllocated: return "active_allocated";
    case BlockState::kActivePendingFree: return "active_pending_free";
    case BlockState::kInactive: return "inactive";
  }
  return "?";
}

const char* to_string(TraceAction action) {
  switch (action) {
    case TraceAction::kAlloc: return "alloc";
    case TraceAction::kFreeRequested: return "free_requested";
    case TraceAction::kFreeCompleted: return "free_completed";
    case TraceAction::kSegmentAlloc: return "segment_alloc";
    case TraceAction::kSegmentFree: return "segment_free";
    case TraceAction::kOom: return "oom";
  }
  return "?";
}

namespace {
std::string format_bytes_short(int64_t bytes) {
  std::ostringstream os;
  const double b = static_cast<double>(bytes);
  os.precision(2);
  os << std::fixed;
  if (b >= double(1ll << 30)) os << b / double(1ll << 30) << " GiB";
  else if (b >= double(1 << 20)) os << b / double(1 << 20) << " MiB";
  else if (b >= 1024.0) os << b / 1024.0 << " KiB";
  else os << bytes << " B";
  os << " (" << bytes << " bytes)";
  return os.str();
}

std::string detail_oom_message(size_t requested, size_t rounded, size_t segment_bytes,
                               int64_t reserved, int64_t allocated, size_t largest_free,
                               const char* backend) {
  std::ostringstream os;
  os << "memsched: out of memory: tried to allocate "
     << format_bytes_short(static_cast<int64_t>(requested)) << " (rounded to " << rounded
     << " bytes); the '" << backend << "' backend refused a new segment of "
     << format_bytes_short(static_cast<int64_t>(segment_bytes))
     << " even after the cache was released. reserved: " << format_bytes_short(reserved)
     << ", allocated: " << format_bytes_short(allocated)
     << ", largest free block: " << format_bytes_short(static_cast<int64_t>(largest_free))
     << ". Free tensors you no longer need, lower the batch size, or offload activations.";
  return os.str();
}

constexpr size_t kMaxRequestBytes = std::numeric_limits<size_t>::max() / 4;

inline int pool_of(bool is_small) { return is_small ? kSmallPool : kLargePool; }
inline void stat_add(StatArray& a, bool is_small, int64_t amount) {
  a[kAggregatePool].increase(amount);
  a[pool_of(is_small)].increase(amount);
}
inline void stat_sub(StatArray& a, bool is_small, int64_t amount) {
  a[kAggregatePool].decrease(amount);
  a[pool_of(is_small)].decrease(amount);
}
}  // namespace

BlockPool::BlockPool(std::shared_ptr<RawMemory> raw, std::shared_ptr<StreamEvents> events,
                     PoolOptions options)
    : raw_(std::move(raw)), events_(std::move(events)), options_(options) {
  MEMSCHED_CHECK(raw_ != nullptr, "BlockPool: a RawMemory backend is required");
  MEMSCHED_CHECK(options_.min_block_bytes > 0 &&
                     (options_.min_block_bytes & (options_.min_block_bytes - 1)) == 0,
                 "BlockPool: options.min_block_bytes must be a power of two, got ",
                 options_.min_block_bytes);
  MEMSCHED_CHECK(options_.small_segment_bytes >= options_.small_size_bytes &&
                     options_.large_segment_bytes >= options_.min_large_alloc_bytes,
                 "BlockPool: segment sizes must hold the largest request of their pool");
}

// Note [Recycled Block objects]
//   A cached size that coalesces on free and splits again on the next malloc
//   would new/delete a Block per pair; a small stack of spare Blocks keeps the
//   cached fast path free of heap calls.
BlockPool::Block* BlockPool::new_block() {
  if (spare_blocks_.empty()) return new Block();
  Block* b = spare_blocks_.back();
  spare_blocks_.pop_back();
  return b;
}

void BlockPool::recycle_block(Block* block) {
  if (spare_blocks_.size() >= kMaxSpareBlocks) {
    delete block;
    return;
  }
  std::vector<StreamHandle> uses = std::move(block->stream_uses);
  uses.clear();
  *block = Block();
  block->stream_uses = std::move(uses);  // keep the vector's capacity
  spare_blocks_.push_back(block);
}

BlockPool::~BlockPool() {
  // A destructor must not throw (std::terminate): a backend that fails to release an event or a
  // segment here (a CUDA error at process exit) leaks it instead.
  for (Block* b : spare_blocks_) delete b;
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [stream, queue] : pending_) {
    for (PendingEvent& p : queue) {
      try {
        events_->release(p.event);
      } catch (const std::exception&) {
      }
    }
  }
  for (auto& [address, head] : segments_) {
    size_t total = 0;
    for (Block* b = head; b != nullptr;) {
      total += b->size;
      Block* next = b->next;
      delete b;
      b = next;
    }
    try {
      raw_->free(reinterpret_cast<void*>(address), total);
    } catch (const std::exception&) {
    }
  }
}

void BlockPool::add_trace(TraceAction action, uintptr_t address, size_t size, StreamHandle stream) {
  if (!history_enabled_) return;
  const auto now = std::chrono::steady_clock::now().time_since_epoch();
  history_.push_back(TraceEntry{action, address, size, stream,
                                std::chrono::duration_cast<std::chrono::microseconds>(now).count()});
  while (history_.size() > history_max_entries_) history_.pop_front();
}

void BlockPool::insert_free(Block* block) {
  free_set(block->is_small).insert(block);
  if (block->is_split()) {
    stat_add(stats_.inactive_split, block->is_small, 1);
    stat_add(stats_.inactive_split_bytes, block->is_small, static_cast<int64_t>(block->size));
  }
}

void BlockPool::erase_free(Block* block) {
  free_set(block->is_small).erase(block);
  if (block->is_split()) {
    stat_sub(stats_.inactive_split, block->is_small, 1);
    stat_sub(stats_.inactive_split_bytes, block->is_small, static_cast<int64_t>(block->size));
  }
}

BlockPool::Block* BlockPool::find_free_block(bool is_small, StreamHandle stream, size_t rounded) {
  FreeSet& set = free_set(is_small);
  Block key;
  key.stream = stream;
  key.size = rounded;
  key.address = 0;
  auto it = set.lower_bound(&key);
  if (it == set.end() || (*it)->stream != stream) return nullptr;
  return *it;
}

BlockPool::Block* BlockPool::allocate_segment(bool is_small, size_t segment_bytes,
                                              StreamHandle stream) {
  void* ptr = raw_->allocate(segment_bytes);
  if (ptr == nullptr) return nullptr;
  ++stats_.num_device_alloc;
  Block* block = new_block();
  block->address = reinterpret_cast<uintptr_t>(ptr);
  block->size = segment_bytes;
  block->stream = stream;
  block->is_small = is_small;
  segments_.emplace(block->address, block);
  stat_add(stats_.segment, is_small, 1);
  stat_add(stats_.reserved_bytes, is_small, static_cast<int64_t>(segment_bytes));
  add_trace(TraceAction::kSegmentAlloc, block->address, segment_bytes, stream);
  insert_free(block);
  return block;
}

// `block` is in its free set; carve `rounded` bytes off its front and hand them out.
BlockPool::Block* BlockPool::take_block(Block* block, size_t rounded, size_t requested) {
  erase_free(block);
  if (options_.should_split(block->size, rounded)) {
    Block* rest = new_block();
    rest->address = block->address + rounded;
    rest->size = block->size - rounded;
    rest->stream = block->stream;
    rest->is_small = block->is_small;
    rest->prev = block;
    rest->next = block->next;
    if (rest->next != nullptr) rest->next->prev = rest;
    block->next = rest;
    block->size = rounded;
    insert_free(rest);
  }
  block->allocated = true;
  block->requested = requested;
  if (spare_nodes_.empty()) {
    active_.emplace(block->address, block);
  } else {  // reuse a map node: no heap call (See Note [Recycled Block objects])
    auto node = std::move(spare_nodes_.back());
    spare_nodes_.pop_back();
    node.key() = block->address;
    node.mapped() = block;
    active_.insert(std::move(node));
  }
  const bool s = block->is_small;
  stat_add(stats_.allocation, s, 1);
  stat_add(stats_.allocated_bytes, s, static_cast<int64_t>(block->size));
  stat_add(stats_.requested_bytes, s, static_cast<int64_t>(requested));
  stat_add(stats_.active, s, 1);
  stat_add(stats_.active_bytes, s, static_cast<int64_t>(block->size));
  add_trace(TraceAction::kAlloc, block->address, block->size, block->stream);
  return block;
}

void* BlockPool::malloc(size_t bytes, StreamHandle stream) {
  if (bytes == 0) return nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  if (bytes > kMaxRequestBytes) {  // rounding would overflow; no backend has this much
    ++stats_.num_ooms;
    throw OutOfMemoryError(detail_oom_message(bytes, bytes, bytes, stats_.reserved_bytes[kAggregatePool].current,
                                              stats_.allocated_bytes[kAggregatePool].current,
                                              largest_free_block_locked(), raw_->name()));
  }
  if (pending_event_count_ > 0) retire_events_locked(/*wait=*/false);
  const size_t rounded = options_.round_size(bytes);
  const bool is_small = options_.is_small(rounded);
  const size_t segment_bytes = options_.segment_size(rounded);
  // See Note [Allocation fallback chain].
  Block* block = find_free_block(is_small, stream, rounded);
  if (block == nullptr) block = allocate_segment(is_small, segment_bytes, stream);
  if (block == nullptr) {
    ++stats_.num_alloc_retries;
    if (pending_event_count_ > 0) retire_events_locked(/*wait=*/true);
    block = find_free_block(is_small, stream, rounded);
    if (block == nullptr) {
      release_cached_segments();
      block = allocate_segment(is_small, segment_bytes, stream);
    }
  }
  if (block == nullptr) throw_oom(bytes, rounded, segment_bytes, stream);
  return reinterpret_cast<void*>(take_block(block, rounded, bytes)->address);
}

void BlockPool::throw_oom(size_t requested, size_t rounded, size_t segment_bytes,
                          StreamHandle stream) {
  ++stats_.num_ooms;
  add_trace(TraceAction::kOom, 0, requested, stream);
  const int64_t reserved = stats_.reserved_bytes[kAggregatePool].current;
  const int64_t allocated = stats_.allocated_bytes[kAggregatePool].current;
  throw OutOfMemoryError(
      detail_oom_message(requested, rounded, segment_bytes, reserved, allocated,
                         largest_free_block_locked(), raw_->name()));
}

void BlockPool::free(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = active_.find(reinterpret_cast<uintptr_t>(ptr));
  MEMSCHED_CHECK(it != active_.end() && it->second->allocated, "BlockPool::free: pointer ", ptr,
                 it == active_.end() ? " was not allocated by this pool"
                                     : " was already freed (double free)");
  Block* block = it->second;
  // See Note [Stream-ordered reuse]. The events are recorded before anything
  // changes: if the backend throws (a CUDA error), the block stays allocated.
  std::vector<EventHandle> recorded;
  if (!block->stream_uses.empty()) {
    recorded.reserve(block->stream_uses.size());
    try {
      for (StreamHandle use : block->stream_uses) recorded.push_back(events_->record(use));
    } catch (...) {
      for (EventHandle e : recorded) events_->release(e);
      throw;
    }
  }
  const bool s = block->is_small;
  stat_sub(stats_.allocation, s, 1);
  stat_sub(stats_.allocated_bytes, s, static_cast<int64_t>(block->size));
  stat_sub(stats_.requested_bytes, s, static_cast<int64_t>(block->requested));
  add_trace(TraceAction::kFreeRequested, block->address, block->size, block->stream);
  block->allocated = false;
  block->requested = 0;
  if (recorded.empty()) {
    free_block(block);
    return;
  }
  block->pending = true;
  for (size_t i = 0; i < recorded.size(); ++i) {
    pending_[block->stream_uses[i]].push_back(PendingEvent{recorded[i], block});
    ++block->pending_events;
    ++pending_event_count_;
  }
  block->stream_uses.clear();
}

void BlockPool::free_block(Block* block) {
  auto node = active_.extract(block->address);
  if (spare_nodes_.size() < kMaxSpareBlocks) spare_nodes_.push_back(std::move(node));
  block->allocated = false;
  block->pending = false;
  const bool s = block->is_small;
  stat_sub(stats_.active, s, 1);
  stat_sub(stats_.active_bytes, s, static_cast<int64_t>(block->size));
  add_trace(TraceAction::kFreeCompleted, block->address, block->size, block->stream);
  // Coalesce: the lower block survives, so a segment's head is never deleted.
  if (block->prev != nullptr && block->prev->is_free()) {
    Block* prev = block->prev;
    erase_free(prev);
    prev->size += block->size;
    prev->next = block->next;
    if (prev->next != nullptr) prev->next->prev = prev;
    recycle_block(block);
    block = prev;
  }
  if (block->next != nullptr && block->next->is_free()) {
    Block* next = block->next;
    erase_free(next);
    block->size += next->size;
    block->next = next->next;
    if (block->next != nullptr) block->next->prev = block;
    recycle_block(next);
  }
  insert_free(block);
}

void BlockPool::record_stream(void* ptr, StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = active_.find(reinterpret_cast<uintptr_t>(ptr));
  MEMSCHED_CHECK(it != active_.end() && it->second->allocated, "BlockPool::record_stream: pointer ",
                 ptr, " is not a live allocation of this pool");
  MEMSCHED_CHECK(events_ != nullptr, "BlockPool::record_stream: this pool (backend '", raw_->name(),
                 "') has no StreamEvents; construct it with one to use several streams");
  Block* block = it->second;
  if (stream == block->stream) return;  // ordered after the free by construction
  auto& uses = block->stream_uses;
  if (std::find(uses.begin(), uses.end(), stream) == uses.end()) uses.push_back(stream);
}

void BlockPool::retire_events_locked(bool wait) {
  if (wait && pending_event_count_ > 0) ++stats_.num_sync_all_streams;
  for (auto it = pending_.begin(); it != pending_.end();) {
    auto& queue = it->second;
    while (!queue.empty()) {
      PendingEvent& p = queue.front();
      if (wait) {
        events_->synchronize(p.event);
      } else if (!events_->query(p.event)) {
        break;  // events on one stream complete in order
      }
      events_->release(p.event);
      Block* block = p.block;
      queue.pop_front();
      --pending_event_count_;
      if (--block->pending_events == 0) free_block(block);
    }
    it = queue.empty() ? pending_.erase(it) : std::next(it);
  }
}

void BlockPool::process_events() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (pending_event_count_ > 0) retire_events_locked(false);
}

void BlockPool::release_segment(Block* block) {
  erase_free(block);
  segments_.erase(block->address);
  stat_sub(stats_.segment, block->is_small, 1);
  stat_sub(stats_.reserved_bytes, block->is_small, static_cast<int64_t>(block->size));
  add_trace(TraceAction::kSegmentFree, block->address, block->size, block->stream);
  raw_->free(reinterpret_cast<void*>(block->address), block->size);
  ++stats_.num_device_free;
  recycle_block(block);
}

void BlockPool::release_cached_segments() {
  for (FreeSet* set : {&small_free_, &large_free_}) {
    std::vector<Block*> whole;
    for (Block* b : *set) {
      if (!b->is_split()) whole.push_back(b);
    }
    for (Block* b : whole) release_segment(b);
  }
}

void BlockPool::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (pending_event_count_ > 0) retire_events_locked(/*wait=*/true);
  release_cached_segments();
}

bool BlockPool::owns(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = active_.find(reinterpret_cast<uintptr_t>(ptr));
  return it != active_.end() && it->second->allocated;
}

size_t BlockPool::block_size(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = active_.find(reinterpret_cast<uintptr_t>(ptr));
  MEMSCHED_CHECK(it != active_.end(), "BlockPool::block_size: pointer ", ptr,
                 " is not a live allocation of this pool");
  return it->second->size;
}

AllocatorStats BlockPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void BlockPool::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.reset_peak();
}

void BlockPool::reset_accumulated_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.reset_accumulated();
}

size_t BlockPool::largest_free_block_locked() const {
  size_t largest = 0;
  for (const FreeSet* set : {&small_free_, &large_free_}) {
    for (const Block* b : *set) largest = std::max(largest, b->size);
  }
  return largest;
}

size_t BlockPool::largest_free_block() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return largest_free_block_locked();
}

size_t BlockPool::pending_free_blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t n = 0;
  for (const auto& [address, block] : active_) n += block->pending ? 1 : 0;
  return n;
}

std::vector<SegmentInfo> BlockPool::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<SegmentInfo> out;
  out.reserve(segments_.size());
  for (const auto& [address, head] : segments_) {
    SegmentInfo seg;
    seg.address = address;
    seg.stream = head->stream;
    seg.is_small = head->is_small;
    for (const Block* b = head; b != nullptr; b = b->next) {
      BlockInfo info;
      info.address = b->address;
      info.size = b->size;
      info.requested_size = b->requested;
      info.state = b->allocated ? BlockState::kActiveAllocated
                                : (b->pending ? BlockState::kActivePendingFree : BlockState::kInactive);
      seg.total_size += b->size;
      if (b->allocated) seg.allocated_size += b->size;
      if (b->allocated || b->pending) seg.active_size += b->size;
      seg.requested_size += b->requested;
      seg.blocks.push_back(info);
    }
    out.push_back(std::move(seg));
  }
  return out;
}

void BlockPool::record_history(bool enabled, size_t max_entries) {
  std::lock_guard<std::mutex> lock(mutex_);
  history_enabled_ = enabled;
  history_max_entries_ = max_entries;
  if (!enabled) history_.clear();
  while (history_.size() > history_max_entries_) history_.pop_front();
}

std::vector<TraceEntry> BlockPool::history() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {history_.begin(), history_.end()};
}

void BlockPool::check_invariants() const {
  std::lock_guard<std::mutex> lock(mutex_);
  AllocatorStats expect;  // current values only
  auto add = [](StatArray& a, bool s, int64_t v) {
    a[kAggregatePool].current += v;
    a[s ? kSmallPool : kLargePool].current += v;
  };
  uintptr_t previous_end = 0;
  size_t free_blocks = 0;
  size_t live_blocks = 0;
  int64_t reserved = 0, active_bytes = 0, free_bytes = 0;
  for (const auto& [address, head] : segments_) {
    MEMSCHED_CHECK(head->address == address && head->prev == nullptr,
                   "BlockPool invariant: segment ", address, " does not start with its head block");
    MEMSCHED_CHECK(address >= previous_end, "BlockPool invariant: segment at ", address,
                   " overlaps the previous segment ending at ", previous_end);
    const bool s = head->is_small;
    add(expect.segment, s, 1);
    uintptr_t cursor = address;
    const Block* prev = nullptr;
    for (const Block* b = head; b != nullptr; prev = b, b = b->next) {
      MEMSCHED_CHECK(b->address == cursor && b->prev == prev && b->size > 0,
                     "BlockPool invariant: broken split chain at block ", b->address,
                     " (expected address ", cursor, ")");
      MEMSCHED_CHECK(b->stream == head->stream && b->is_small == s,
                     "BlockPool invariant: block ", b->address, " disagrees with its segment");
      MEMSCHED_CHECK(b->size % options_.min_block_bytes == 0,
                     "BlockPool invariant: block size ", b->size, " is not rounded");
      MEMSCHED_CHECK(!(b->allocated && b->pending), "BlockPool invariant: block both allocated and pending");
      cursor += b->size;
      reserved += static_cast<int64_t>(b->size);
      if (b->is_free()) {
        ++free_blocks;
        free_bytes += static_cast<int64_t>(b->size);
        MEMSCHED_CHECK(prev == nullptr || !prev->is_free(),
                       "BlockPool invariant: free neighbours not coalesced at ", b->address);
        MEMSCHED_CHECK(free_set(s).count(const_cast<Block*>(b)) == 1,
                       "BlockPool invariant: free block ", b->address, " missing from its free set");
        MEMSCHED_CHECK(b->requested == 0 && b->stream_uses.empty(),
                       "BlockPool invariant: free block keeps allocation state");
        if (b->is_split()) {
          add(expect.inactive_split, s, 1);
          add(expect.inactive_split_bytes, s, static_cast<int64_t>(b->size));
        }
      } else {
        ++live_blocks;
        active_bytes += static_cast<int64_t>(b->size);
        auto it = active_.find(b->address);
        MEMSCHED_CHECK(it != active_.end() && it->second == b,
                       "BlockPool invariant: live block ", b->address, " missing from the active map");
        add(expect.active, s, 1);
        add(expect.active_bytes, s, static_cast<int64_t>(b->size));
        if (b->allocated) {
          add(expect.allocation, s, 1);
          add(expect.allocated_bytes, s, static_cast<int64_t>(b->size));
          add(expect.requested_bytes, s, static_cast<int64_t>(b->requested));
        } else {
          MEMSCHED_CHECK(b->pending_events > 0 && b->stream_uses.empty(),
                         "BlockPool invariant: pending block ", b->address, " has no events");
        }
      }
    }
    previous_end = cursor;
    add(expect.reserved_bytes, s, static_cast<int64_t>(cursor - address));
  }
  MEMSCHED_CHECK(free_blocks == small_free_.size() + large_free_.size(),
                 "BlockPool invariant: free sets hold ", small_free_.size() + large_free_.size(),
                 " blocks but the segments have ", free_blocks, " free blocks");
  MEMSCHED_CHECK(live_blocks == active_.size(), "BlockPool invariant: active map has ",
                 active_.size(), " entries but the segments have ", live_blocks, " live blocks");
  MEMSCHED_CHECK(active_bytes + free_bytes == reserved,
                 "BlockPool invariant: active ", active_bytes, " + cached ", free_bytes,
                 " != reserved ", reserved);
  size_t queued = 0;
  std::unordered_map<const Block*, int> events_per_block;
  for (const auto& [stream, queue] : pending_) {
    queued += queue.size();
    for (const PendingEvent& p : queue) ++events_per_block[p.block];
  }
  MEMSCHED_CHECK(queued == pending_event_count_, "BlockPool invariant: pending event count");
  for (const auto& [block, n] : events_per_block) {
    MEMSCHED_CHECK(block->pending && block->pending_events == n,
                   "BlockPool invariant: block ", block->address, " event count mismatch");
  }
  auto same = [](const char* name, const StatArray& got, const StatArray& want) {
    for (int p = 0; p < kNumPoolIndices; ++p) {
      MEMSCHED_CHECK(got[p].current == want[p].current, "BlockPool invariant: statistic ", name,
                     "[", p, "].current is ", got[p].current, " but recounting gives ",
                     want[p].current);
      MEMSCHED_CHECK(got[p].peak >= got[p].current,
                     "BlockPool invariant: statistic ", name, "[", p, "] is inconsistent");
    }
  };
  same("allocation", stats_.allocation, expect.allocation);
  same("segment", stats_.segment, expect.segment);
  same("active", stats_.active, expect.active);
  same("inactive_split", stats_.inactive_split, expect.inactive_split);
  same("allocated_bytes", stats_.allocated_bytes, expect.allocated_bytes);
  same("reserved_bytes", stats_.reserved_bytes, expect.reserved_bytes);
  same("active_bytes", stats_.active_bytes, expect.active_bytes);
  same("inactive_split_bytes", stats_.inactive_split_bytes, expect.inactive_split_bytes);
  same("requested_bytes", stats_.requested_bytes, expect.requested_bytes);
}

}  // namespace memsched
