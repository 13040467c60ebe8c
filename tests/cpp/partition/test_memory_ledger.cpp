// MemoryLedger's incremental curves equal evaluate_partition's after long random move sequences.
#include <gtest/gtest.h>

#include <random>

#include "core/partition/memory_ledger.h"
#include "core/partition/partition_eval.h"
#include "partition/partition_fixtures.h"

namespace memsched {
namespace {

TEST(MemoryLedger, MatchesFullEvaluationUnderRandomMoves) {
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    const Trace t = test_partition::small_random_trace(seed, 6);
    PartitionProblem p(t, test_partition::devices(3, 20000));
    std::mt19937_64 rng(seed);
    std::vector<int> a(p.num_ops());
    for (auto& x : a) x = static_cast<int>(rng() % 3);
    MemoryLedger ledger(p, a);
    for (int step = 0; step < 300; ++step) {
      const int64_t op = static_cast<int64_t>(rng() % p.num_ops());
      const int to = static_cast<int>(rng() % 3);
      ledger.move(op, to);
      a[op] = to;
      const auto ev = evaluate_partition(p, a);
      for (int d = 0; d < 3; ++d) {
        ASSERT_EQ(ledger.peak(d), ev.peak_bytes[d]) << "seed " << seed << " step " << step;
        if (ev.peak_op[d] >= 0) ASSERT_EQ(ledger.peak_op(d), ev.peak_op[d]);
      }
      ASSERT_EQ(ledger.bytes_moved(), ev.bytes_moved);
      ASSERT_EQ(ledger.excess(p.devices().caps_bytes), ev.excess_bytes);
    }
  }
}

}  // namespace
}  // namespace memsched
