// Reference-model test for core/alloc/block_pool: a million random
// alloc / free / record_stream / event-complete / empty_cache operations with
// random sizes and streams, each followed by check_invariants() and a
// comparison with a simple reference that knows only what the user did:
//   * no new block overlaps a live or pending-free block (stream-ordered reuse),
//   * block sizes are the rounded request (small pool) or at most 1 MiB more,
//   * every COUNT/SUM statistic (current, peak, allocated, freed) equals the
//     reference's, reserved bytes and segments equal the backend's own count,
//   * an out-of-memory happens only when the backend truly had no room.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "core/alloc/block_pool.h"
#include "core/alloc/virtual_memory.h"

namespace memsched {
namespace {

constexpr size_t kMiB = 1024 * 1024;
constexpr int kStreams = 4;

struct RefBlock {
  size_t size = 0;          // block size reported by the pool (checked against the request)
  size_t requested = 0;     // bytes asked for
  StreamHandle stream = 0;  // allocating stream
  bool small = false;       // pool
  bool pending = false;     // freed, waiting on events
  std::map<StreamHandle, uint64_t> wait_for;  // stream -> sequence number of its event
  std::set<StreamHandle> uses;                // recorded streams while allocated
};

struct RefStat {  // mirror of Stat
  int64_t current = 0, peak = 0, allocated = 0, freed = 0;
  void add(int64_t v) { current += v; allocated += v; peak = std::max(peak, current); }
  void sub(int64_t v) { current -= v; freed += v; }
};

class Reference {
 public:
  std::map<uintptr_t, RefBlock> blocks;         // live and pending, by address
  std::map<StreamHandle, uint64_t> recorded, completed;  // per-stream event counters
  RefStat allocation[3], allocated_bytes[3], requested_bytes[3], active[3], active_bytes[3];

  static int pool(bool small) { return small ? kSmallPool : kLargePool; }
  void add(RefStat* s, bool small, int64_t v) { s[0].add(v); s[pool(small)].add(v); }
  void sub(RefStat* s, bool small, int64_t v) { s[0].sub(v); s[pool(small)].sub(v); }

  bool overlaps(uintptr_t p, size_t n) const {
    auto it = blocks.upper_bound(p);
    if (it != blocks.end() && it->first < p + n) return true;
    if (it != blocks.begin()) {
      --it;
      if (it->first + it->second.size > p) return true;
    }
    return false;
  }
  // Pending frees whose events completed become free (the pool does this at
  // the start of malloc); with `all`, every event is waited for.
  void retire(bool all) {
    if (all) {
      for (auto& [s, n] : recorded) completed[s] = n;
    }
    for (auto it = blocks.begin(); it != blocks.end();) {
      RefBlock& b = it->second;
      bool done = b.pending;
      for (auto& [s, seq] : b.wait_for) done = done && completed[s] > seq;
      if (done) {
        sub(active, b.small, 1);
        sub(active_bytes, b.small, static_cast<int64_t>(b.size));
        it = blocks.erase(it);
      } else {
        ++it;
      }
    }
  }
};

void expect_stat(const char* name, const StatArray& got, const RefStat* want) {
  for (int p = 0; p < 3; ++p) {
    ASSERT_EQ(got[p].current, want[p].current) << name << "[" << p << "].current";
    ASSERT_EQ(got[p].peak, want[p].peak) << name << "[" << p << "].peak";
    ASSERT_EQ(got[p].allocated, want[p].allocated) << name << "[" << p << "].allocated";
    ASSERT_EQ(got[p].freed, want[p].freed) << name << "[" << p << "].freed";
  }
}

size_t random_size(std::mt19937_64& rng) {
  const double u = std::uniform_real_distribution<double>(0, 1)(rng);
  auto log_uniform = [&](double lo, double hi) {
    return static_cast<size_t>(std::exp(std::uniform_real_distribution<double>(std::log(lo), std::log(hi))(rng)));
  };
  if (u < 0.70) return log_uniform(1, 256 * 1024);
  if (u < 0.95) return log_uniform(256 * 1024, 8 * kMiB);
  return log_uniform(8 * kMiB, 40 * kMiB);
}

TEST(BlockPoolReference, MillionRandomOperationsMatchTheReference) {
  auto raw = std::make_shared<VirtualRawMemory>(400 * kMiB);
  auto events = std::make_shared<ManualStreamEvents>();
  BlockPool pool(raw, events);
  Reference ref;
  std::mt19937_64 rng(20261122);
  std::vector<uintptr_t> live;  // allocated (not pending) addresses, for random picks
  const PoolOptions& opt = pool.options();
  int64_t ooms = 0, retries_seen = 0, pending_reuse_blocked = 0;
  const int kOps = 1000000;
  for (int op = 0; op < kOps; ++op) {
    const int kind = std::uniform_int_distribution<int>(0, 99)(rng);
    const StreamHandle stream = std::uniform_int_distribution<int>(0, kStreams - 1)(rng);
    if (kind < 40 && live.size() < 96) {  // ---- malloc
      const size_t bytes = random_size(rng);
      const int64_t retries_before = pool.stats().num_alloc_retries;
      const size_t rounded = opt.round_size(bytes);
      void* p = nullptr;
      bool oom = false;
      try {
        p = pool.malloc(bytes, stream);
      } catch (const OutOfMemoryError&) {
        oom = true;
      }
      const bool retried = pool.stats().num_alloc_retries != retries_before;
      ref.retire(/*all=*/retried);
      if (retried) ++retries_seen;
      if (oom) {
        ++ooms;
        ASSERT_TRUE(retried);
        ASSERT_GT(raw->outstanding_bytes() + opt.segment_size(rounded), raw->capacity_bytes());
      } else {
        const auto address = reinterpret_cast<uintptr_t>(p);
        const size_t size = pool.block_size(p);
        ASSERT_EQ(address % opt.min_block_bytes, 0u);
        if (opt.is_small(rounded)) ASSERT_EQ(size, rounded);
        else ASSERT_TRUE(size >= rounded && size - rounded <= opt.small_size_bytes) << size << " " << rounded;
        if (ref.overlaps(address, size)) {
          FAIL() << "op " << op << ": block " << address << "+" << size
                 << " overlaps a live or pending-free block";
        }
        RefBlock b;
        b.size = size;
        b.requested = bytes;
        b.stream = stream;
        b.small = opt.is_small(rounded);
        ref.blocks.emplace(address, b);
        ref.add(ref.allocation, b.small, 1);
        ref.add(ref.allocated_bytes, b.small, static_cast<int64_t>(size));
        ref.add(ref.requested_bytes, b.small, static_cast<int64_t>(bytes));
        ref.add(ref.active, b.small, 1);
        ref.add(ref.active_bytes, b.small, static_cast<int64_t>(size));
        live.push_back(address);
      }
    } else if (kind < 75 && !live.empty()) {  // ---- free
      const size_t i = std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng);
      const uintptr_t address = live[i];
      live[i] = live.back();
      live.pop_back();
      pool.free(reinterpret_cast<void*>(address));
      RefBlock& b = ref.blocks.at(address);
      ref.sub(ref.allocation, b.small, 1);
      ref.sub(ref.allocated_bytes, b.small, static_cast<int64_t>(b.size));
      ref.sub(ref.requested_bytes, b.small, static_cast<int64_t>(b.requested));
      if (b.uses.empty()) {
        ref.sub(ref.active, b.small, 1);
        ref.sub(ref.active_bytes, b.small, static_cast<int64_t>(b.size));
        ref.blocks.erase(address);
      } else {
        b.pending = true;
        ++pending_reuse_blocked;
        for (StreamHandle s : b.uses) b.wait_for[s] = ref.recorded[s]++;
      }
    } else if (kind < 88 && !live.empty()) {  // ---- record_stream
      const uintptr_t address = live[std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng)];
      pool.record_stream(reinterpret_cast<void*>(address), stream);
      RefBlock& b = ref.blocks.at(address);
      if (stream != b.stream) b.uses.insert(stream);
    } else if (kind < 99) {  // ---- a stream reaches its next event
      if (events->complete_next(stream)) {
        ASSERT_LT(ref.completed[stream], ref.recorded[stream]);
        ++ref.completed[stream];
      } else {
        ASSERT_EQ(ref.completed[stream], ref.recorded[stream]);
      }
    } else if (std::uniform_int_distribution<int>(0, 9)(rng) == 0) {  // ---- empty_cache (0.1%)
      pool.empty_cache();
      ref.retire(/*all=*/true);
    }
    // ---- after every operation
    pool.check_invariants();
    const AllocatorStats s = pool.stats();
    expect_stat("allocation", s.allocation, ref.allocation);
    expect_stat("allocated_bytes", s.allocated_bytes, ref.allocated_bytes);
    expect_stat("requested_bytes", s.requested_bytes, ref.requested_bytes);
    expect_stat("active", s.active, ref.active);
    expect_stat("active_bytes", s.active_bytes, ref.active_bytes);
    ASSERT_EQ(s.reserved_bytes[kAggregatePool].current, static_cast<int64_t>(raw->outstanding_bytes()));
    ASSERT_EQ(s.reserved_bytes[kAggregatePool].peak, static_cast<int64_t>(raw->peak_outstanding_bytes()));
    ASSERT_EQ(s.segment[kAggregatePool].current, static_cast<int64_t>(raw->outstanding_segments()));
    ASSERT_EQ(s.num_ooms, ooms);
    if (::testing::Test::HasFatalFailure()) return;
  }
  // The random walk must have exercised every path it claims to test.
  EXPECT_GT(ooms, 0);
  EXPECT_GT(retries_seen, ooms);
  EXPECT_GT(pending_reuse_blocked, 10000);
  EXPECT_GT(pool.stats().inactive_split[kAggregatePool].peak, 0);
  for (uintptr_t address : live) pool.free(reinterpret_cast<void*>(address));
  events->complete_everything();
  pool.empty_cache();
  pool.check_invariants();
  EXPECT_EQ(raw->outstanding_bytes(), 0u);
  EXPECT_EQ(events->live_events(), 0u);
}

}  // namespace
}  // namespace memsched
