// test_simulator.cpp -- the discrete-event simulator on tiny hand-built traces
// (every expected number is worked out in the comments) and its invariants.
#include <gtest/gtest.h>

#include "core/check.h"
#include "core/plan.h"
#include "core/simulator.h"

namespace memsched {
namespace {

// Copies: D2H 1 us + bytes / (10 B/us); H2D 2 us + bytes / (20 B/us).
DeviceModel tiny_device() {
  DeviceModel d;
  d.name = "tiny";
  d.d2h_bw_gbps = 10e-3;  // 10 B/us
  d.h2d_bw_gbps = 20e-3;  // 20 B/us
  d.d2h_latency_us = 1.0;
  d.h2d_latency_us = 2.0;
  return d;
}

Op make_op(int64_t id, Phase phase, double us) {
  Op op;
  op.id = id;
  op.name = "op" + std::to_string(id);
  op.phase = phase;
  op.duration_us = us;
  return op;
}

TensorRecord make_tensor(int64_t id, int64_t bytes, TensorKind kind, int64_t producer, std::vector<int64_t> uses,
                         int64_t freed) {
  TensorRecord t;
  t.id = id;
  t.bytes = bytes;
  t.dtype = "float32";
  t.kind = kind;
  t.producer_op = producer;
  t.uses = std::move(uses);
  t.freed_after_op = freed;
  return t;
}

// Four ops of 10 us: op0 fwd makes A (100 B, read again by op3 bwd);
// op1 fwd makes C (60 B temporary read by op2 bwd); op2 bwd; op3 bwd.
// A is the only offloadable tensor: last forward use 0, first backward use 3.
Trace trace_b() {
  Trace t;
  t.ops = {make_op(0, Phase::kForward, 10), make_op(1, Phase::kForward, 10), make_op(2, Phase::kBackward, 10),
           make_op(3, Phase::kBackward, 10)};
  t.tensors = {make_tensor(0, 100, TensorKind::kActivation, 0, {3}, 3),
               make_tensor(1, 60, TensorKind::kTemporary, 1, {2}, 2)};
  return t;
}

Plan offload_a(int64_t budget, int64_t prefetch_at, bool sync = false) {
  Plan p;
  p.planner = "hand";
  p.budget_bytes = budget;
  p.decisions = {{0, true, 0, prefetch_at}};
  p.copies_on_compute_stream = sync;
  return p;
}

TEST(Simulator, KeepAllRunsOpsBackToBackAtTheTracePeak) {
  const Trace t = trace_b();
  Plan p;
  p.budget_bytes = 1000;
  p.decisions = {{0, false, -1, -1}};
  const SimResult r = simulate(t, p, tiny_device());
  r.check_invariants(t, p);
  EXPECT_DOUBLE_EQ(r.step_time_us, 40.0);  // 4 ops x 10 us, nothing waits
  EXPECT_DOUBLE_EQ(r.stall_us, 0.0);
  EXPECT_EQ(r.peak_bytes, 160);            // A + C during op1 and op2
  EXPECT_EQ(r.peak_bytes, t.peak_bytes());
  EXPECT_DOUBLE_EQ(r.peak_time_us, 10.0);  // op1 starts and allocates C
  EXPECT_EQ(r.peak_op, 1);
  EXPECT_EQ(r.bytes_to_host, 0);
  EXPECT_EQ(r.bytes_to_device, 0);
  EXPECT_FALSE(r.over_budget);
}

TEST(Simulator, OnDemandPrefetchStallsTheFirstBackwardUse) {
  // op0 [0,10]; A's D2H [10,21] (1 + 100/10); op1 [10,20] (room in 1000 B);
  // op2 [20,30], frees C at 30; op3 reached at 30 requests A: H2D [30,37]
  // (2 + 100/20); op3 [37,47]. Stall 7 us before op3; step 47 us.
  // Peak: A + C = 160 B at t = 10 (A's copy not finished yet).
  const Trace t = trace_b();
  const Plan p = offload_a(1000, 3);
  const SimResult r = simulate(t, p, tiny_device());
  r.check_invariants(t, p);
  EXPECT_DOUBLE_EQ(r.step_time_us, 47.0);
  EXPECT_DOUBLE_EQ(r.stall_us, 7.0);
  EXPECT_DOUBLE_EQ(r.stall_us_per_op[3], 7.0);
  EXPECT_EQ(r.peak_bytes, 160);
  EXPECT_DOUBLE_EQ(r.peak_time_us, 10.0);
  EXPECT_EQ(r.bytes_to_host, 100);
  EXPECT_EQ(r.bytes_to_device, 100);
}

TEST(Simulator, OpsAndPrefetchesWaitForBudgetRoom) {
  // Budget 120 B. op0 [0,10] holds A (100). A's D2H [10,21]. op1 needs 60 B:
  // 160 > 120, A's copy is pending, so op1 waits until A is released at 21:
  // op1 [21,31] (stall 11). op2 reached at 31 requests A, but 60 + 100 > 120:
  // the H2D waits while op2 runs [31,41]; op2 frees C at 41; H2D [41,48];
  // op3 waits for A: [48,58] (stall 7). Step 58, stall 18, peak 100 (never
  // two of A, C at once).
  const Trace t = trace_b();
  const Plan p = offload_a(120, 2);
  const SimResult r = simulate(t, p, tiny_device());
  r.check_invariants(t, p);
  EXPECT_DOUBLE_EQ(r.op_start_us[1], 21.0);
  EXPECT_DOUBLE_EQ(r.stall_us_per_op[1], 11.0);
  EXPECT_DOUBLE_EQ(r.op_start_us[3], 48.0);
  EXPECT_DOUBLE_EQ(r.stall_us_per_op[3], 7.0);
  EXPECT_DOUBLE_EQ(r.stall_us, 18.0);
  EXPECT_DOUBLE_EQ(r.step_time_us, 58.0);
  EXPECT_EQ(r.peak_bytes, 100);
  EXPECT_DOUBLE_EQ(r.peak_time_us, 0.0);
  EXPECT_FALSE(r.over_budget);
}

TEST(Simulator, PrefetchAheadHidesTheCopy) {
  // Budget 1000. op0 [0,10]; D2H [10,21]; op1 [10,20]; op2 reached at 20
  // requests A, whose D2H ends at 21: H2D [21,28] while op2 runs [20,30];
  // op3 [30,40] finds A back. No stall: step 40. Peak 160 at t = 10.
  const Trace t = trace_b();
  const Plan p = offload_a(1000, 2);
  const SimResult r = simulate(t, p, tiny_device());
  r.check_invariants(t, p);
  EXPECT_DOUBLE_EQ(r.step_time_us, 40.0);
  EXPECT_DOUBLE_EQ(r.stall_us, 0.0);
  EXPECT_EQ(r.peak_bytes, 160);
  ASSERT_EQ(r.events.size(), 6u);  // 4 ops + 2 copies
}

TEST(Simulator, SyncCopiesRunOnTheComputeStream) {
  // op0 [0,10]; D2H on compute [10,21], A released at 21; op1 [21,31]
  // (stall 11); op2 [31,41]; H2D on compute [41,48]; op3 [48,58] (stall 7).
  // Peak 100: A and C never coexist.
  const Trace t = trace_b();
  const Plan p = offload_a(1000, 3, /*sync=*/true);
  const SimResult r = simulate(t, p, tiny_device());
  r.check_invariants(t, p);
  EXPECT_DOUBLE_EQ(r.step_time_us, 58.0);
  EXPECT_DOUBLE_EQ(r.stall_us_per_op[1], 11.0);
  EXPECT_DOUBLE_EQ(r.stall_us_per_op[3], 7.0);
  EXPECT_EQ(r.peak_bytes, 100);
  for (const auto& e : r.events) EXPECT_EQ(e.stream, Stream::kCompute);
}

TEST(Simulator, RooflineWhenNotUsingMeasuredDurations) {
  // 2e12 FLOP at 1e15 FLOP/s = 2000 us; 3e9 B at 1000 GB/s = 3000 us -> 3000 us.
  DeviceModel d = tiny_device();
  d.peak_flops = 1e15;
  d.hbm_bw_gbps = 1000;
  d.use_measured_durations = false;
  Op op = make_op(0, Phase::kForward, 7.0);
  op.flops = 2e12;
  op.bytes_read = 2'000'000'000;
  op.bytes_written = 1'000'000'000;
  EXPECT_DOUBLE_EQ(op_time_us(d, op), 3000.0);
  d.use_measured_durations = true;
  EXPECT_DOUBLE_EQ(op_time_us(d, op), 7.0);
  EXPECT_DOUBLE_EQ(d2h_time_us(d, 100), 11.0);
  EXPECT_DOUBLE_EQ(h2d_time_us(d, 100), 7.0);
}

TEST(Simulator, OverBudgetIsReportedNotHidden) {
  // Budget 120 with A's last forward use... A must be resident during op0
  // (100 B) and op1 must allocate 60 B while nothing can be freed if A is
  // offloaded only after op1: the simulator goes over and says so.
  const Trace t = trace_b();
  Plan p = offload_a(120, 2);
  p.decisions[0].offload_after_op = 1;
  const SimResult r = simulate(t, p, tiny_device());
  r.check_invariants(t, p);
  EXPECT_TRUE(r.over_budget);
  EXPECT_EQ(r.peak_bytes, 160);
}

TEST(Simulator, RejectsMalformedPlans) {
  const Trace t = trace_b();
  Plan p = offload_a(1000, 1);  // prefetch in forward
  EXPECT_THROW(simulate(t, p, tiny_device()), Error);
  p = offload_a(1000, 2);
  p.decisions[0].tensor_id = 1;  // C is not offloadable
  EXPECT_THROW(simulate(t, p, tiny_device()), Error);
  p = offload_a(1000, 2);
  p.decisions.clear();
  EXPECT_THROW(simulate(t, p, tiny_device()), Error);
}

}  // namespace
}  // namespace memsched
