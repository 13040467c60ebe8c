// S3 against brute force on tiny graphs; caps always hold; contiguous splits; the least cap.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/partition/contiguous_split.h"
#include "core/partition/s3_partitioner.h"
#include "partition/partition_fixtures.h"

namespace memsched {
namespace {

// The best makespan over every placement that fits (D^n of them); inf if none fits.
double brute_force(const PartitionProblem& p) {
  const int64_t n = p.num_ops();
  const int nd = static_cast<int>(p.num_devices());
  std::vector<int> a(n, 0);
  double best = std::numeric_limits<double>::infinity();
  for (;;) {
    const auto ev = evaluate_partition(p, a);
    if (ev.fits) best = std::min(best, ev.makespan_us);
    int64_t k = 0;
    while (k < n && ++a[k] == nd) a[k++] = 0;
    if (k == n) break;
  }
  return best;
}

TEST(S3Partitioner, NearTheOptimumAndWithinCapsOnSmallGraphs) {
  double ratio_sum = 0;
  int cases = 0;
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    const Trace t = test_partition::small_random_trace(seed, 3);  // 7 ops
    const int64_t single_peak = t.peak_bytes();
    for (double cap_share : {0.7, 1.0}) {
      PartitionProblem p(t, test_partition::devices(3, static_cast<int64_t>(cap_share * single_peak), 2.0, 1.0));
      const double optimum = brute_force(p);
      const S3Result r = partition_s3(p);
      if (!std::isfinite(optimum)) {
        EXPECT_FALSE(r.fits);
        continue;
      }
      ASSERT_TRUE(r.fits) << "seed " << seed;
      EXPECT_TRUE(r.eval.fits);
      for (int d = 0; d < 3; ++d) EXPECT_LE(r.eval.peak_bytes[d], p.devices().caps_bytes[d]);
      EXPECT_GE(r.eval.makespan_us, optimum * (1 - 1e-12));
      ratio_sum += r.eval.makespan_us / optimum;
      ++cases;
    }
  }
  ASSERT_GT(cases, 10);
  EXPECT_LE(ratio_sum / cases, 1.10);
}

TEST(S3Partitioner, NeverWorseThanTheContiguousSplitsThatFit) {
  SyntheticTraceOptions o;
  o.num_layers = 24;
  o.ops_per_layer = 3;
  const Trace t = make_synthetic_trace(o);
  for (auto [nd, share] : {std::pair{2, 0.6}, std::pair{4, 0.35}}) {
    PartitionProblem p(t, test_partition::devices(nd, static_cast<int64_t>(share * t.peak_bytes()), 450.0, 5.0));
    const S3Result r = partition_s3(p);
    ASSERT_TRUE(r.fits);
    for (const auto& a : {even_layer_split(p), flop_balanced_split(p)}) {
      const auto ev = evaluate_partition(p, a);
      if (ev.fits) EXPECT_LE(r.eval.makespan_us, ev.makespan_us * (1 + 1e-12));
    }
  }
}

TEST(ContiguousSplit, RunsAreContiguousAndCoverTheDevices) {
  SyntheticTraceOptions o;
  o.num_layers = 10;
  o.ops_per_layer = 2;
  const Trace t = make_synthetic_trace(o);
  PartitionProblem p(t, test_partition::devices(4, 1 << 30));
  ASSERT_EQ(p.num_layers(), 11);  // layers.0..9 and the loss
  for (const auto& a : {even_layer_split(p), flop_balanced_split(p)}) {
    int last = 0;
    for (int64_t i = 0; i < p.num_ops(); ++i) {
      if (t.ops[i].phase != Phase::kForward) continue;
      EXPECT_GE(a[i], last);  // forward layers go to non-decreasing devices
      last = a[i];
    }
    EXPECT_EQ(last, 3);
    for (int64_t i = 0; i < p.num_ops(); ++i)  // backward ops sit with their forward layer
      if (t.ops[i].phase == Phase::kBackward && !t.ops[i].module_path.empty())
        for (int64_t j = 0; j < p.num_ops(); ++j)
          if (t.ops[j].phase == Phase::kForward && t.ops[j].module_path == t.ops[i].module_path) EXPECT_EQ(a[i], a[j]);
  }
}

TEST(S3Partitioner, LeastUniformCapFitsAndTheNextLowerStepDoesNot) {
  SyntheticTraceOptions o;
  o.num_layers = 12;
  o.ops_per_layer = 2;
  const Trace t = make_synthetic_trace(o);
  PartitionProblem p(t, test_partition::devices(4, 1));
  EXPECT_FALSE(partition_s3(p).fits);
  const int64_t cap = least_uniform_cap(p);
  EXPECT_LE(cap, t.peak_bytes());
  EXPECT_GE(cap, t.peak_bytes() / 4);
  PartitionProblem at(t, test_partition::devices(4, cap));
  EXPECT_TRUE(partition_s3(at).fits);
}

}  // namespace
}  // namespace memsched
