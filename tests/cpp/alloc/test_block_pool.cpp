// Tests for core/alloc/block_pool: rounding, pools, best fit, splitting,
// coalescing, stream ownership, stream-ordered reuse, the out-of-memory path,
// empty_cache, statistics and snapshots -- every expected number by hand.
#include <gtest/gtest.h>

#include <limits>
#include <memory>
#include <string>

#include "core/alloc/block_pool.h"
#include "core/alloc/virtual_memory.h"

namespace memsched {
namespace {

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * 1024;

struct Fixture {
  std::shared_ptr<VirtualRawMemory> raw = std::make_shared<VirtualRawMemory>();
  std::shared_ptr<ManualStreamEvents> events = std::make_shared<ManualStreamEvents>();
  std::unique_ptr<BlockPool> pool;
  explicit Fixture(PoolOptions options = PoolOptions()) {
    pool = std::make_unique<BlockPool>(raw, events, options);
  }
  uintptr_t at(void* p) const { return reinterpret_cast<uintptr_t>(p); }
};

TEST(BlockPool, RoundsTo512AndCarvesSmallSegments) {
  Fixture f;
  void* a = f.pool->malloc(1);
  void* b = f.pool->malloc(513);
  EXPECT_EQ(f.pool->block_size(a), 512u);
  EXPECT_EQ(f.pool->block_size(b), 1024u);
  EXPECT_EQ(f.at(b), f.at(a) + 512);  // carved from the same 2 MiB segment
  AllocatorStats s = f.pool->stats();
  EXPECT_EQ(s.segment[kAggregatePool].current, 1);
  EXPECT_EQ(s.reserved_bytes[kSmallPool].current, int64_t(2 * kMiB));
  EXPECT_EQ(s.reserved_bytes[kLargePool].current, 0);
  EXPECT_EQ(s.allocated_bytes[kAggregatePool].current, 1536);
  EXPECT_EQ(s.requested_bytes[kAggregatePool].current, 514);
  EXPECT_EQ(s.allocation[kAggregatePool].current, 2);
  // The rest of the segment is one free split block.
  EXPECT_EQ(s.inactive_split[kAggregatePool].current, 1);
  EXPECT_EQ(s.inactive_split_bytes[kAggregatePool].current, int64_t(2 * kMiB - 1536));
  EXPECT_EQ(f.raw->outstanding_bytes(), 2 * kMiB);
  EXPECT_EQ(f.pool->malloc(0), nullptr);
  f.pool->check_invariants();
  f.pool->free(a);
  f.pool->free(b);
  f.pool->check_invariants();
}

TEST(BlockPool, CoalescesFreeNeighboursBackIntoOneBlock) {
  Fixture f;
  void* a = f.pool->malloc(1000);   // 1024 at +0
  void* b = f.pool->malloc(2000);   // 2048 at +1024
  void* c = f.pool->malloc(512);    // 512 at +3072
  f.pool->free(b);                  // free: [b 2048] between a and c, [rest]
  AllocatorStats s = f.pool->stats();
  EXPECT_EQ(s.inactive_split[kAggregatePool].current, 2);
  EXPECT_EQ(s.inactive_split_bytes[kAggregatePool].current, int64_t(2048 + 2 * kMiB - 3584));
  f.pool->free(a);                  // a merges with b
  s = f.pool->stats();
  EXPECT_EQ(s.inactive_split[kAggregatePool].current, 2);
  EXPECT_EQ(s.inactive_split_bytes[kAggregatePool].current, int64_t(2 * kMiB - 512));
  auto snap = f.pool->snapshot();
  ASSERT_EQ(snap.size(), 1u);
  ASSERT_EQ(snap[0].blocks.size(), 3u);
  EXPECT_EQ(snap[0].blocks[0].size, 3072u);
  EXPECT_EQ(snap[0].blocks[0].state, BlockState::kInactive);
  EXPECT_EQ(snap[0].blocks[1].size, 512u);
  EXPECT_EQ(snap[0].blocks[1].state, BlockState::kActiveAllocated);
  EXPECT_EQ(snap[0].blocks[1].requested_size, 512u);
  f.pool->free(c);                  // everything merges: one whole free segment
  snap = f.pool->snapshot();
  ASSERT_EQ(snap[0].blocks.size(), 1u);
  EXPECT_EQ(snap[0].blocks[0].size, 2 * kMiB);
  s = f.pool->stats();
  EXPECT_EQ(s.inactive_split[kAggregatePool].current, 0);
  EXPECT_EQ(s.active_bytes[kAggregatePool].current, 0);
  EXPECT_EQ(s.reserved_bytes[kAggregatePool].current, int64_t(2 * kMiB));
  f.pool->check_invariants();
}

TEST(BlockPool, BestFitPicksTheSmallestHoleThatFits) {
  Fixture f;
  void* big = f.pool->malloc(4096);
  void* s1 = f.pool->malloc(512);
  void* fit = f.pool->malloc(2048);
  void* s2 = f.pool->malloc(512);
  f.pool->free(big);
  f.pool->free(fit);
  // Holes: 4096 at +0, 2048 at +4608, and the big rest of the segment.
  EXPECT_EQ(f.pool->malloc(1600), fit);  // 2048 hole, used whole
  void* split = f.pool->malloc(1024);     // the 4096 hole is the best fit; split
  EXPECT_EQ(split, big);
  EXPECT_EQ(f.pool->malloc(3072), reinterpret_cast<void*>(f.at(big) + 1024));
  f.pool->check_invariants();
  (void)s1;
  (void)s2;
}

TEST(BlockPool, LargePoolSharesTwentyMiBSegmentsAndKeepsSmallRests) {
  Fixture f;
  void* a = f.pool->malloc(3 * kMiB);           // large: 20 MiB segment, split
  void* b = f.pool->malloc(16 * kMiB + 100);    // best fit: the 17 MiB rest of a's segment
  AllocatorStats s = f.pool->stats();
  EXPECT_EQ(s.segment[kLargePool].current, 1);
  EXPECT_EQ(s.reserved_bytes[kLargePool].current, int64_t(20 * kMiB));
  // b: rounded 16 MiB + 512; the 17 MiB block's rest (512 KiB - 512) is below
  // 1 MiB, so b gets the whole 17 MiB block.
  EXPECT_EQ(f.pool->block_size(b), 17 * kMiB);
  EXPECT_EQ(s.allocated_bytes[kLargePool].current, int64_t(20 * kMiB));
  EXPECT_EQ(s.requested_bytes[kLargePool].current, int64_t(19 * kMiB + 100));
  void* c = f.pool->malloc(12 * kMiB);          // >= 10 MiB: own segment rounded to 2 MiB
  EXPECT_EQ(f.pool->block_size(c), 12 * kMiB);
  EXPECT_EQ(f.pool->stats().reserved_bytes[kLargePool].current, int64_t(32 * kMiB));
  f.pool->free(a);
  f.pool->free(b);
  f.pool->free(c);
  f.pool->check_invariants();
}

TEST(BlockPool, BlocksBelongToTheirStream) {
  Fixture f;
  void* p = f.pool->malloc(512, /*stream=*/1);
  f.pool->free(p);
  void* q = f.pool->malloc(512, /*stream=*/2);
  EXPECT_NE(q, p);
  EXPECT_EQ(f.pool->stats().segment[kAggregatePool].current, 2);
  EXPECT_EQ(f.pool->malloc(512, 1), p);  // stream 1 reuses its own block
  f.pool->check_invariants();
}

TEST(BlockPool, RecordStreamDelaysReuseUntilTheEventCompletes) {
  Fixture f;
  void* p = f.pool->malloc(4096, 1);
  f.pool->record_stream(p, 2);
  f.pool->record_stream(p, 3);
  f.pool->record_stream(p, 1);  // own stream: no event needed
  f.pool->free(p);
  EXPECT_EQ(f.events->live_events(), 2u);
  AllocatorStats s = f.pool->stats();
  EXPECT_EQ(s.allocation[kAggregatePool].current, 0);
  EXPECT_EQ(s.allocated_bytes[kAggregatePool].current, 0);
  EXPECT_EQ(s.active[kAggregatePool].current, 1);          // pending free is still active
  EXPECT_EQ(s.active_bytes[kAggregatePool].current, 4096);
  EXPECT_EQ(f.pool->snapshot()[0].blocks[0].state, BlockState::kActivePendingFree);
  void* q = f.pool->malloc(4096, 1);
  EXPECT_NE(q, p);  // stream 2 and 3 may still read p
  f.events->complete_next(2);
  void* r = f.pool->malloc(4096, 1);
  EXPECT_NE(r, p);  // stream 3 still pending
  f.pool->check_invariants();
  f.events->complete_next(3);
  f.pool->free(q);
  f.pool->free(r);
  EXPECT_EQ(f.pool->malloc(4096, 1), p);  // retired at the start of this malloc
  EXPECT_EQ(f.events->live_events(), 0u);
  EXPECT_EQ(f.pool->pending_free_blocks(), 0u);
  f.pool->check_invariants();
}

TEST(BlockPool, RecordStreamWithoutEventsIsAClearError) {
  BlockPool pool(std::make_shared<VirtualRawMemory>(), nullptr);
  void* p = pool.malloc(512);
  try {
    pool.record_stream(p, 7);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no StreamEvents"), std::string::npos) << e.what();
  }
}

TEST(BlockPool, OutOfMemoryReleasesTheCacheRetriesThenReportsFigures) {
  Fixture f;
  f.raw->set_capacity(30 * kMiB);
  void* a = f.pool->malloc(15 * kMiB);  // own segment of 16 MiB
  EXPECT_EQ(f.pool->block_size(a), 16 * kMiB);
  f.pool->free(a);                      // cached
  void* b = f.pool->malloc(20 * kMiB);  // 16 + 20 > 30: release the cache, retry
  ASSERT_NE(b, nullptr);
  AllocatorStats s = f.pool->stats();
  EXPECT_EQ(s.num_alloc_retries, 1);
  EXPECT_EQ(s.reserved_bytes[kAggregatePool].current, int64_t(20 * kMiB));
  EXPECT_EQ(s.num_device_alloc, 2);
  EXPECT_EQ(s.num_device_free, 1);
  try {
    f.pool->malloc(12 * kMiB);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("tried to allocate 12.00 MiB (12582912 bytes)"), std::string::npos) << what;
    EXPECT_NE(what.find("reserved: 20.00 MiB"), std::string::npos) << what;
    EXPECT_NE(what.find("allocated: 20.00 MiB"), std::string::npos) << what;
    EXPECT_NE(what.find("largest free block: 0 B"), std::string::npos) << what;
    EXPECT_NE(what.find("'virtual' backend"), std::string::npos) << what;
  }
  s = f.pool->stats();
  EXPECT_EQ(s.num_ooms, 1);
  EXPECT_EQ(s.num_alloc_retries, 2);
  EXPECT_EQ(s.allocation[kAggregatePool].current, 1);
  f.pool->check_invariants();
  f.pool->free(b);
  EXPECT_EQ(f.pool->malloc(12 * kMiB), b);  // best fit: the cached 20 MiB block, split
  f.pool->check_invariants();
}

TEST(BlockPool, OutOfMemoryRetryWaitsForPendingFrees) {
  Fixture f;
  f.raw->set_capacity(16 * kMiB);
  void* a = f.pool->malloc(16 * kMiB, 1);
  f.pool->record_stream(a, 2);
  f.pool->free(a);  // pending on stream 2
  void* b = f.pool->malloc(16 * kMiB, 1);  // must wait for stream 2, then reuse a
  EXPECT_EQ(b, a);
  EXPECT_EQ(f.pool->stats().num_sync_all_streams, 1);
  EXPECT_EQ(f.events->unfinished_events(2), 0u);
  f.pool->check_invariants();
}

TEST(BlockPool, EmptyCacheReturnsOnlyWholeFreeSegments) {
  Fixture f;
  void* keep = f.pool->malloc(512);       // small segment stays (split, in use)
  void* drop = f.pool->malloc(12 * kMiB); // large segment, freed
  f.pool->free(drop);
  EXPECT_EQ(f.raw->outstanding_bytes(), 14 * kMiB);
  f.pool->empty_cache();
  EXPECT_EQ(f.raw->outstanding_bytes(), 2 * kMiB);
  AllocatorStats s = f.pool->stats();
  EXPECT_EQ(s.segment[kAggregatePool].current, 1);
  EXPECT_EQ(s.segment[kAggregatePool].freed, 1);
  EXPECT_EQ(s.reserved_bytes[kAggregatePool].peak, int64_t(14 * kMiB));
  f.pool->free(keep);
  f.pool->empty_cache();
  EXPECT_EQ(f.raw->outstanding_bytes(), 0u);
  f.pool->check_invariants();
}

TEST(BlockPool, StatisticsTrackPeaksTotalsAndResets) {
  Fixture f;
  void* a = f.pool->malloc(1024);
  void* b = f.pool->malloc(2048);
  f.pool->free(a);
  void* c = f.pool->malloc(512);
  AllocatorStats s = f.pool->stats();
  EXPECT_EQ(s.allocated_bytes[kAggregatePool].current, 2560);
  EXPECT_EQ(s.allocated_bytes[kAggregatePool].peak, 3072);
  EXPECT_EQ(s.allocated_bytes[kAggregatePool].allocated, 3584);
  EXPECT_EQ(s.allocated_bytes[kAggregatePool].freed, 1024);
  EXPECT_EQ(s.allocation[kSmallPool].allocated, 3);
  f.pool->reset_peak_stats();
  EXPECT_EQ(f.pool->stats().allocated_bytes[kAggregatePool].peak, 2560);
  f.pool->reset_accumulated_stats();
  EXPECT_EQ(f.pool->stats().allocated_bytes[kAggregatePool].allocated, 0);
  f.pool->check_invariants();
  f.pool->free(b);
  f.pool->free(c);
  // flatten_stats names the figures as torch.cuda.memory_stats() does.
  bool found = false;
  for (const auto& [key, value] : flatten_stats(f.pool->stats())) {
    if (key == "allocated_bytes.all.current") {
      found = true;
      EXPECT_EQ(value, 0);
    }
  }
  EXPECT_TRUE(found);
}

TEST(BlockPool, BadFreesAreClearErrors) {
  Fixture f;
  void* p = f.pool->malloc(512);
  int stack_object = 0;
  EXPECT_THROW(f.pool->free(&stack_object), Error);
  f.pool->free(p);
  try {
    f.pool->free(p);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not allocated by this pool"), std::string::npos);
  }
  f.pool->free(nullptr);
  // A request so large that rounding it would overflow is an out-of-memory,
  // not a tiny block.
  EXPECT_THROW(f.pool->malloc(std::numeric_limits<size_t>::max() - 10), OutOfMemoryError);
  EXPECT_EQ(f.pool->stats().num_ooms, 1);
  f.pool->check_invariants();
}

TEST(BlockPool, PlainBestFitWithoutSplittingReservesExactSizes) {
  PoolOptions options;
  options.split_blocks = false;
  Fixture f(options);
  void* a = f.pool->malloc(1000);
  void* b = f.pool->malloc(5000);
  EXPECT_EQ(f.raw->outstanding_bytes(), 1024u + 5120u);
  f.pool->free(b);
  void* c = f.pool->malloc(600);  // best fit among free blocks: the whole 5120 block
  EXPECT_EQ(c, b);
  EXPECT_EQ(f.pool->block_size(c), 5120u);
  EXPECT_EQ(f.raw->outstanding_bytes(), 1024u + 5120u);
  f.pool->free(a);
  f.pool->free(c);
  f.pool->check_invariants();
}

TEST(BlockPool, HistoryRecordsTheActionsTheVisualiserReads) {
  Fixture f;
  f.pool->record_history(true, 100);
  void* p = f.pool->malloc(512);
  f.pool->free(p);
  f.pool->empty_cache();
  auto h = f.pool->history();
  ASSERT_EQ(h.size(), 5u);
  EXPECT_STREQ(to_string(h[0].action), "segment_alloc");
  EXPECT_EQ(h[0].size, 2 * kMiB);
  EXPECT_STREQ(to_string(h[1].action), "alloc");
  EXPECT_EQ(h[1].address, reinterpret_cast<uintptr_t>(p));
  EXPECT_STREQ(to_string(h[2].action), "free_requested");
  EXPECT_STREQ(to_string(h[3].action), "free_completed");
  EXPECT_STREQ(to_string(h[4].action), "segment_free");
  f.pool->record_history(true, 2);
  EXPECT_EQ(f.pool->history().size(), 2u);
}

}  // namespace
}  // namespace memsched
