// Tests for core/alloc/placement_planner and core/alloc/trace_replay: exact
// layouts by hand, the brute-force optimum on small random traces, the 1.05x
// goal on a synthetic transformer-like step, and replay figures.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "core/alloc/placement_planner.h"
#include "core/alloc/trace_replay.h"
#include "core/check.h"

namespace memsched {
namespace {

Trace make_trace(int n_ops) {
  Trace t;
  for (int i = 0; i < n_ops; ++i) {
    Op op;
    op.id = i;
    op.name = "op" + std::to_string(i);
    op.phase = i < n_ops / 2 ? Phase::kForward : Phase::kBackward;
    t.ops.push_back(op);
  }
  return t;
}

void add_tensor(Trace& t, int64_t bytes, int64_t producer, int64_t freed,
                TensorKind kind = TensorKind::kActivation) {
  TensorRecord r;
  r.id = static_cast<int64_t>(t.tensors.size());
  r.bytes = bytes;
  r.kind = kind;
  r.producer_op = producer;
  r.freed_after_op = freed;
  if (freed != kAfterStep) r.uses = {freed};
  t.tensors.push_back(r);
}

TEST(PlacementPlanner, PacksDisjointLifetimesIntoTheSameBytes) {
  Trace t = make_trace(4);
  add_tensor(t, 1024, 0, 1);  // A
  add_tensor(t, 1024, 2, 3);  // B
  add_tensor(t, 2048, 1, 2);  // C
  Placement p = plan_placement(t);
  EXPECT_EQ(p.lower_bound_bytes, 3072);
  EXPECT_EQ(p.arena_bytes, 3072);
  EXPECT_EQ(p.offsets[2], 0);      // C, the largest, first
  EXPECT_EQ(p.offsets[0], 2048);   // A beside C
  EXPECT_EQ(p.offsets[1], 2048);   // B reuses A's bytes
  p.check_invariants(t, 512);
}

TEST(PlacementPlanner, AlignsSizesAndSkipsEmptyTensors) {
  Trace t = make_trace(2);
  add_tensor(t, 100, 0, 1);
  add_tensor(t, 0, 0, 1);
  add_tensor(t, 600, 1, 1);
  Placement p = plan_placement(t);
  EXPECT_EQ(p.lower_bound_bytes, 700);
  EXPECT_EQ(p.arena_bytes, 512 + 1024);
  EXPECT_EQ(p.offsets[1], -1);
  EXPECT_EQ(p.sizes[2], 1024);
  p.check_invariants(t, 512);
  PlacementOptions fine;
  fine.alignment_bytes = 4;
  EXPECT_EQ(plan_placement(t, fine).arena_bytes, 700);
  fine.alignment_bytes = 0;
  EXPECT_THROW(plan_placement(t, fine), Error);
}

// The optimum of a small instance: the best over all orders of placing each
// tensor at its lowest feasible offset (any optimal layout is reached this way
// by placing tensors in the order of their optimal offsets).
int64_t brute_force_arena(const Trace& t) {
  std::vector<int> order(t.tensors.size());
  std::iota(order.begin(), order.end(), 0);
  int64_t best = INT64_MAX;
  do {
    std::vector<std::pair<int64_t, int>> placed;  // offset, tensor
    int64_t arena = 0;
    for (int id : order) {
      const TensorRecord& a = t.tensors[id];
      int64_t offset = 0;
      bool moved = true;
      while (moved) {
        moved = false;
        for (auto& [off, other] : placed) {
          const TensorRecord& b = t.tensors[other];
          const bool time = t.live_start(a) <= t.live_end(b) && t.live_start(b) <= t.live_end(a);
          if (time && offset < off + b.bytes && off < offset + a.bytes) {
            offset = off + b.bytes;
            moved = true;
          }
        }
      }
      placed.emplace_back(offset, id);
      arena = std::max(arena, offset + a.bytes);
    }
    best = std::min(best, arena);
  } while (std::next_permutation(order.begin(), order.end()));
  return best;
}

TEST(PlacementPlanner, SmallRandomTracesAgainstBruteForce) {
  std::mt19937 rng(7);
  int optimal_hits = 0;
  const int kCases = 150;
  for (int c = 0; c < kCases; ++c) {
    const int n_ops = 6;
    Trace t = make_trace(n_ops);
    const int n = std::uniform_int_distribution<int>(2, 6)(rng);
    for (int i = 0; i < n; ++i) {
      const int64_t start = std::uniform_int_distribution<int>(0, n_ops - 1)(rng);
      const int64_t end = std::uniform_int_distribution<int>(static_cast<int>(start), n_ops - 1)(rng);
      add_tensor(t, 512 * std::uniform_int_distribution<int>(1, 8)(rng), start, end);
    }
    PlacementOptions opt;
    opt.alignment_bytes = 512;
    const Placement p = plan_placement(t, opt);
    p.check_invariants(t, 512);
    const int64_t optimum = brute_force_arena(t);
    ASSERT_GE(optimum, p.lower_bound_bytes);
    ASSERT_GE(p.arena_bytes, optimum);
    optimal_hits += p.arena_bytes == optimum ? 1 : 0;
  }
  // Greedy is a heuristic, but on instances this small it should almost
  // always find the optimum.
  EXPECT_GE(optimal_hits, kCases * 9 / 10) << optimal_hits << " of " << kCases;
}

// A transformer-like step: L layers, each with a few saved activations of
// different sizes and short-lived temporaries; parameters and gradients.
Trace synthetic_transformer(int layers, int64_t hidden_bytes) {
  const int fwd_per_layer = 4;
  const int n_ops = 2 * layers * fwd_per_layer + 1;
  Trace t = make_trace(n_ops);
  for (int l = 0; l < layers; ++l) add_tensor(t, 12 * hidden_bytes / 8, kBeforeStep, kAfterStep, TensorKind::kParameter);
  for (int l = 0; l < layers; ++l) {
    for (int k = 0; k < fwd_per_layer; ++k) {
      const int64_t fwd = l * fwd_per_layer + k;
      const int64_t bwd = n_ops - 2 - fwd;
      const int64_t bytes = (k == 2 ? 4 : 1) * hidden_bytes + 4096 * k;
      add_tensor(t, bytes, fwd, bwd);                 // saved activation
      add_tensor(t, bytes / 2 + 1000, fwd, fwd);      // temporary
      add_tensor(t, bytes, bwd, bwd, TensorKind::kTemporary);  // its gradient in backward
    }
    add_tensor(t, 12 * hidden_bytes / 8, n_ops - 2 - l * fwd_per_layer, kAfterStep, TensorKind::kGradient);
  }
  return t;
}

TEST(PlacementPlanner, TransformerLikeStepWithinFivePercentOfPeakLive) {
  Trace t = synthetic_transformer(12, 8 << 20);
  t.validate();
  const Placement p = plan_placement(t);
  p.check_invariants(t, 512);
  EXPECT_GE(p.arena_bytes, p.lower_bound_bytes);
  EXPECT_LE(p.ratio(), 1.05) << "arena " << p.arena_bytes << " bound " << p.lower_bound_bytes;
}

TEST(TraceReplay, PeakLiveEqualsTheTracePeakAndReservedCoversIt) {
  Trace t = synthetic_transformer(6, 4 << 20);
  const ReplayResult split = replay_trace(t, PoolOptions(), 2);
  EXPECT_EQ(split.peak_live_bytes, t.peak_bytes());
  EXPECT_GE(split.peak_allocated_bytes, split.peak_live_bytes);
  EXPECT_GE(split.peak_reserved_bytes, split.peak_allocated_bytes);
  EXPECT_EQ(split.stats.allocation[kAggregatePool].current, 0);
  PoolOptions plain;
  plain.split_blocks = false;
  const ReplayResult nosplit = replay_trace(t, plain, 2);
  EXPECT_EQ(nosplit.peak_live_bytes, t.peak_bytes());
  EXPECT_GE(nosplit.peak_reserved_bytes, nosplit.peak_live_bytes);
  EXPECT_EQ(split.allocations, nosplit.allocations);
}

TEST(TraceReplay, HandComputedReplay) {
  Trace t = make_trace(3);
  add_tensor(t, 3 << 20, kBeforeStep, kAfterStep, TensorKind::kParameter);  // 3 MiB, large pool
  add_tensor(t, 1000, 0, 1);    // small
  add_tensor(t, 1000, 1, 2);
  const ReplayResult r = replay_trace(t, PoolOptions(), 1);
  EXPECT_EQ(r.peak_live_bytes, (3 << 20) + 2000);
  EXPECT_EQ(r.peak_allocated_bytes, (3 << 20) + 2048);
  EXPECT_EQ(r.peak_reserved_bytes, (20 << 20) + (2 << 20));  // one 20 MiB + one 2 MiB segment
  EXPECT_EQ(r.allocations, 3);
}

}  // namespace
}  // namespace memsched
