// Stream-ordered reuse in core/alloc/block_pool (See Note [Stream-ordered
// reuse]) against a fake GPU (fake_gpu.h) whose streams run only when the
// test says so and whose memory addresses are reused:
//   * one deterministic test per rule of record_stream / free / events /
//     process_events / empty_cache / the out-of-memory retry / a failed event;
//   * random alloc / use-on-a-stream / free / stream-progress / empty_cache
//     sequences over 4 streams, checking after every malloc that no stream
//     other than the new owner still has a kernel queued on the block, and
//     that no segment goes back to the device while a side stream may touch it;
//   * the same random walk with a user who forgets record_stream, to show the
//     check does catch an early reuse.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "alloc/fake_gpu.h"
#include "core/alloc/block_pool.h"

namespace memsched {
namespace {

using testing::FakeGpu;

constexpr size_t kMiB = 1024 * 1024;

struct Fixture {
  std::shared_ptr<FakeGpu> gpu;
  std::unique_ptr<BlockPool> pool;
  explicit Fixture(size_t capacity = 1024 * kMiB) : gpu(std::make_shared<FakeGpu>(capacity)) {
    pool = std::make_unique<BlockPool>(gpu, gpu);
  }
  // The user's view of a block: allocate on `stream` and queue a kernel writing it there.
  void* alloc(size_t bytes, StreamHandle stream) {
    void* p = pool->malloc(bytes, stream);
    gpu->launch(stream, at(p), bytes, false);
    return p;
  }
  // Use on another stream, as a correct user does: record_stream, then the kernel.
  void use(void* p, size_t bytes, StreamHandle stream) {
    pool->record_stream(p, stream);
    gpu->launch(stream, at(p), bytes, true);
  }
  static uintptr_t at(void* p) { return reinterpret_cast<uintptr_t>(p); }
};

// Rule 1: a block freed with no other stream's use is reused at once by its
// own stream -- the stream's order puts the old kernels first.
TEST(BlockPoolStreams, OwnStreamReusesAtOnce) {
  Fixture f;
  void* p = f.alloc(4096, 1);
  f.pool->free(p);
  EXPECT_EQ(f.pool->malloc(4096, 1), p);
  EXPECT_EQ(f.gpu->live_events(), 0u);  // no event needed
  f.pool->check_invariants();
}

// Rule 2: a cached block never goes to another stream, even when it is free.
TEST(BlockPoolStreams, CachedBlockNeverChangesStream) {
  Fixture f;
  void* p = f.alloc(4096, 1);
  f.pool->free(p);
  void* q = f.pool->malloc(4096, 2);
  EXPECT_NE(q, p);
  EXPECT_EQ(f.pool->stats().segment[kAggregatePool].current, 2);
}

// Rule 3: a block used on another stream stays out of the pool until an
// event recorded on that stream at free() has completed -- not before.
TEST(BlockPoolStreams, SideStreamUseDelaysReuseUntilItsEvent) {
  Fixture f;
  void* p = f.alloc(4096, 1);
  f.use(p, 4096, 2);
  f.pool->free(p);
  EXPECT_EQ(f.gpu->queued(2), 2u);  // the kernel, then the pool's event
  void* q = f.pool->malloc(4096, 1);
  EXPECT_NE(q, p);
  f.gpu->run_next(2);  // the kernel finished, the event not yet reached
  void* r = f.pool->malloc(4096, 1);
  EXPECT_NE(r, p);
  f.gpu->run_next(2);  // the event
  EXPECT_EQ(f.pool->malloc(4096, 1), p);
  EXPECT_EQ(f.gpu->live_events(), 0u);
  f.pool->check_invariants();
}

// Rule 4: every recorded stream must be done; recording a stream twice (or the
// owner) adds no event.
TEST(BlockPoolStreams, AllRecordedStreamsMustFinishAndDuplicatesCountOnce) {
  Fixture f;
  void* p = f.alloc(4096, 0);
  f.use(p, 4096, 2);
  f.use(p, 4096, 2);
  f.use(p, 4096, 3);
  f.pool->record_stream(p, 0);  // the owner
  f.pool->free(p);
  EXPECT_EQ(f.gpu->live_events(), 2u);
  f.gpu->synchronize_device();
  EXPECT_EQ(f.pool->pending_free_blocks(), 1u);  // nothing retires it but the pool
  f.pool->process_events();
  EXPECT_EQ(f.pool->pending_free_blocks(), 0u);
  EXPECT_EQ(f.pool->malloc(4096, 0), p);
}

// Rule 5: events are per stream; a slow stream does not hold back a block
// that waits only on a fast one (no head-of-line blocking across streams).
TEST(BlockPoolStreams, SlowStreamDoesNotHoldBackOtherStreamsBlocks) {
  Fixture f;
  void* slow = f.alloc(4096, 0);
  void* fast = f.alloc(8192, 0);
  f.use(slow, 4096, 2);
  f.use(fast, 8192, 3);
  f.pool->free(slow);
  f.pool->free(fast);
  while (f.gpu->run_next(3)) {
  }
  f.pool->process_events();
  EXPECT_EQ(f.pool->pending_free_blocks(), 1u);
  EXPECT_EQ(f.pool->malloc(8192, 0), fast);
  f.pool->check_invariants();
}

// Rule 6: a pending block does not coalesce with its free neighbours (a
// larger request must not swallow it); once retired it merges with them.
TEST(BlockPoolStreams, PendingBlockDoesNotCoalesceUntilRetired) {
  Fixture f;
  void* a = f.alloc(4096, 0);
  void* b = f.alloc(4096, 0);
  void* c = f.alloc(4096, 0);
  f.use(b, 4096, 1);
  f.pool->free(a);
  f.pool->free(b);
  f.pool->free(c);
  void* big = f.pool->malloc(3 * 4096, 0);
  EXPECT_GE(Fixture::at(big), Fixture::at(c));  // not [a, a + 12 KiB): b is in the middle
  f.pool->free(big);
  f.gpu->synchronize_device();
  f.pool->process_events();
  f.pool->check_invariants();
  EXPECT_EQ(f.pool->snapshot()[0].blocks.size(), 1u);  // the whole segment is one free block again
  EXPECT_EQ(f.pool->malloc(3 * 4096, 0), a);
}

// Rule 7: empty_cache waits for pending frees, then returns their segments --
// and never a segment that holds an allocated block.
TEST(BlockPoolStreams, EmptyCacheWaitsForEventsAndKeepsLiveSegments) {
  Fixture f;
  void* pending = f.alloc(12 * kMiB, 0);
  void* live = f.alloc(4096, 0);
  f.use(pending, 12 * kMiB, 2);
  f.use(live, 4096, 3);
  f.pool->free(pending);
  f.pool->empty_cache();
  EXPECT_EQ(f.pool->pending_free_blocks(), 0u);
  EXPECT_EQ(f.gpu->queued(2), 0u);                  // it waited on stream 2's event
  EXPECT_EQ(f.gpu->outstanding_bytes(), 2 * kMiB);  // its own 12 MiB segment went back
  EXPECT_TRUE(f.pool->owns(live));
  EXPECT_TRUE(f.gpu->violations().empty()) << f.gpu->violations().front();
  f.pool->check_invariants();
}

// Rule 8: the out-of-memory retry waits for pending frees before it releases
// the cache, and then may reuse the retired block.
TEST(BlockPoolStreams, OutOfMemoryRetryWaitsThenReuses) {
  Fixture f(20 * kMiB);
  void* a = f.alloc(16 * kMiB, 1);
  f.use(a, 16 * kMiB, 2);
  f.pool->free(a);
  void* b = f.pool->malloc(16 * kMiB, 1);
  EXPECT_EQ(b, a);
  EXPECT_EQ(f.pool->stats().num_alloc_retries, 1);
  EXPECT_EQ(f.gpu->queued(2), 0u);
  EXPECT_TRUE(f.gpu->violations().empty());
}

// Rule 9: record_stream names a live allocation; anything else is an error
// that says so (a freed block's uses would otherwise be lost).
TEST(BlockPoolStreams, RecordStreamOnAFreedBlockIsAnError) {
  Fixture f;
  void* p = f.alloc(4096, 0);
  f.pool->free(p);
  EXPECT_THROW(f.pool->record_stream(p, 2), Error);
}

// Rule 10: a free whose event cannot be recorded (a CUDA error) throws and
// leaves the block allocated -- never half pending, never free.
TEST(BlockPoolStreams, FreeThatCannotRecordItsEventsChangesNothing) {
  Fixture f;
  void* p = f.alloc(4096, 0);
  f.use(p, 4096, 2);
  f.use(p, 4096, 3);
  f.gpu->fail_records_on(StreamHandle{3});
  EXPECT_THROW(f.pool->free(p), Error);
  EXPECT_TRUE(f.pool->owns(p));
  EXPECT_EQ(f.gpu->live_events(), 0u);  // the event already recorded on stream 2 was released
  EXPECT_EQ(f.pool->stats().allocation[kAggregatePool].current, 1);
  f.pool->check_invariants();
  f.gpu->fail_records_on(std::nullopt);
  f.pool->free(p);
  EXPECT_EQ(f.pool->pending_free_blocks(), 1u);
  f.pool->check_invariants();
}

struct WalkResult {
  int64_t mallocs = 0;
  int64_t early_reuses = 0;       // malloc returned a block another stream may still touch
  int64_t blocked_by_events = 0;  // frees that had to wait on events
  int64_t retries = 0;
  int64_t empty_caches = 0;
  std::vector<std::string> segment_violations;
};

// A random walk over 4 streams. `honour_record_stream` false plays a user who
// forgets record_stream (its side-stream kernels are still queued).
WalkResult random_walk(int ops, uint64_t seed, bool honour_record_stream) {
  constexpr int kStreams = 4;
  Fixture f(160 * kMiB);
  std::mt19937_64 rng(seed);
  struct Live {
    size_t bytes;
    StreamHandle stream;
  };
  std::map<uintptr_t, Live> live;
  WalkResult out;
  auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  auto random_size = [&]() -> size_t {
    const double u = std::uniform_real_distribution<double>(0, 1)(rng);
    const double lo = u < 0.7 ? 1.0 : (u < 0.95 ? 256.0 * 1024 : 4.0 * kMiB);
    const double hi = u < 0.7 ? 256.0 * 1024 : (u < 0.95 ? 4.0 * kMiB : 24.0 * kMiB);
    return static_cast<size_t>(std::exp(std::uniform_real_distribution<double>(std::log(lo), std::log(hi))(rng)));
  };
  for (int op = 0; op < ops; ++op) {
    const int kind = std::uniform_int_distribution<int>(0, 999)(rng);
    const StreamHandle stream = pick(kStreams);
    if (kind < 300 && live.size() < 48) {
      const size_t bytes = random_size();
      const int64_t retries = f.pool->stats().num_alloc_retries;
      void* p = nullptr;
      try {
        p = f.pool->malloc(bytes, stream);
      } catch (const OutOfMemoryError&) {
      }
      out.retries += f.pool->stats().num_alloc_retries - retries;
      if (p == nullptr) continue;
      ++out.mallocs;
      const uintptr_t address = Fixture::at(p);
      const size_t block = f.pool->block_size(p);
      if (f.gpu->unfinished_touch(address, block, /*foreign_only=*/false, stream)) ++out.early_reuses;
      f.gpu->launch(stream, address, bytes, false);  // the kernel writing the new tensor
      live.emplace(address, Live{bytes, stream});
    } else if (kind < 500 && !live.empty()) {  // use on a random stream
      auto it = std::next(live.begin(), static_cast<long>(pick(live.size())));
      const bool foreign = stream != it->second.stream;
      if (foreign && honour_record_stream) f.pool->record_stream(reinterpret_cast<void*>(it->first), stream);
      f.gpu->launch(stream, it->first, it->second.bytes, foreign);
    } else if (kind < 680 && !live.empty()) {  // free
      auto it = std::next(live.begin(), static_cast<long>(pick(live.size())));
      const size_t pending_before = f.pool->pending_free_blocks();
      f.pool->free(reinterpret_cast<void*>(it->first));
      if (f.pool->pending_free_blocks() > pending_before) ++out.blocked_by_events;
      live.erase(it);
    } else if (kind < 990) {  // a stream makes progress
      const int n = std::uniform_int_distribution<int>(1, 6)(rng);
      for (int i = 0; i < n; ++i) f.gpu->run_next(stream);
    } else if (kind < 997) {
      f.pool->process_events();
    } else {
      f.pool->empty_cache();
      ++out.empty_caches;
      if (f.pool->pending_free_blocks() != 0) out.segment_violations.push_back("empty_cache left pending frees");
    }
    f.pool->check_invariants();
  }
  for (const auto& [address, l] : live) f.pool->free(reinterpret_cast<void*>(address));
  f.pool->empty_cache();
  f.pool->check_invariants();
  for (const std::string& v : f.gpu->violations()) out.segment_violations.push_back(v);
  return out;
}

TEST(BlockPoolStreams, RandomWalkOverFourStreamsNeverReusesABlockEarly) {
  for (uint64_t seed : {1u, 2u, 3u}) {
    const WalkResult r = random_walk(300000, seed, /*honour_record_stream=*/true);
    ::testing::Test::RecordProperty("walk", std::to_string(r.mallocs) + " mallocs, " +
                                                std::to_string(r.blocked_by_events) + " frees waiting on events, " +
                                                std::to_string(r.retries) + " retries, " +
                                                std::to_string(r.empty_caches) + " empty_caches");
    EXPECT_EQ(r.early_reuses, 0) << "seed " << seed;
    EXPECT_TRUE(r.segment_violations.empty()) << "seed " << seed << ": " << r.segment_violations.front();
    // The walk must have exercised what it claims to test.
    EXPECT_GT(r.mallocs, 40000);
    EXPECT_GT(r.blocked_by_events, 10000);
    EXPECT_GT(r.retries, 100);
    EXPECT_GT(r.empty_caches, 500);
  }
}

TEST(BlockPoolStreams, RandomWalkCatchesAUserWhoForgetsRecordStream) {
  const WalkResult r = random_walk(100000, 1, /*honour_record_stream=*/false);
  EXPECT_GT(r.early_reuses, 100);  // the check is not vacuous
}

}  // namespace
}  // namespace memsched
