// Multi-device evaluation (Note [Partition model]): makespan, memory, transfers on hand-checked traces.
#include <gtest/gtest.h>

#include "core/check.h"
#include "core/partition/partition_eval.h"
#include "partition/partition_fixtures.h"

namespace memsched {
namespace {

using test_partition::devices;
using test_partition::op;
using test_traces::add_tensor;

// Diamond: op0 produces a (1000 B) read by op1 and op2; op3 reads b (op1) and c (op2).
Trace diamond() {
  Trace t;
  t.ops = {op(0, 10), op(1, 20), op(2, 30), op(3, 5)};
  add_tensor(t, 1000, TensorKind::kActivation, 0, {1, 2}, 2);  // a
  add_tensor(t, 2000, TensorKind::kActivation, 1, {3}, 3);     // b
  add_tensor(t, 3000, TensorKind::kActivation, 2, {3}, 3);     // c
  add_tensor(t, 500, TensorKind::kParameter, -1, {1, 3}, -1);  // w, home: op1 (first use)
  return t;
}

TEST(PartitionEval, OneDeviceIsTheTraceItself) {
  const Trace t = diamond();
  PartitionProblem p(t, devices(1, 1 << 20));
  const auto ev = evaluate_partition(p, {0, 0, 0, 0});
  EXPECT_DOUBLE_EQ(ev.makespan_us, 65.0);
  EXPECT_EQ(ev.peak_bytes[0], t.peak_bytes());
  EXPECT_EQ(ev.bytes_moved, 0);
  EXPECT_TRUE(ev.fits);
}

TEST(PartitionEval, TwoDevicesOverlapBranchesAndPayTransfers) {
  const Trace t = diamond();
  // 1 GB/s = 1000 B/us: a (1000 B) takes 1 us, c (3000 B) 3 us, w (500 B) 0.5 us, plus 2 us latency.
  PartitionProblem p(t, devices(2, 1 << 20, 1.0, 2.0));
  const std::vector<int> a = {0, 0, 1, 0};
  const auto ev = evaluate_partition(p, a);
  // op2 on device 1 starts at 10 + 1 + 2 = 13, ends 43; c arrives at 43 + 3 + 2 = 48; op1 ends 30.
  EXPECT_DOUBLE_EQ(ev.makespan_us, 53.0);
  EXPECT_EQ(ev.bytes_moved, 1000 + 3000);  // a to device 1, c to device 0
  EXPECT_EQ(ev.num_transfers, 2);
  // Device 1 holds a copy of a during [0, 2] and c during [2, 3]: peak 3000 at op 2... plus a: 4000 at op 2.
  EXPECT_EQ(ev.peak_bytes[1], 4000);
  EXPECT_EQ(ev.peak_op[1], 2);
  const auto transfers = partition_transfers(p, a);
  ASSERT_EQ(transfers.size(), 2u);
  EXPECT_EQ(transfers[0].tensor, 0);
  EXPECT_EQ(transfers[0].to_device, 1);
  EXPECT_DOUBLE_EQ(transfers[1].arrive_us, 48.0);
}

TEST(PartitionEval, CapsAreCheckedPerDevice) {
  const Trace t = diamond();
  PartitionDevices d = devices(2, 1 << 20);
  d.caps_bytes = {1 << 20, 3999};
  PartitionProblem p(t, d);
  const auto ev = evaluate_partition(p, {0, 0, 1, 0});
  EXPECT_FALSE(ev.fits);
  EXPECT_EQ(ev.excess_bytes, 1);
}

TEST(PartitionEval, BadAssignmentsAndDevicesNameTheField) {
  const Trace t = diamond();
  PartitionProblem p(t, devices(2, 100));
  EXPECT_THROW(evaluate_partition(p, {0, 0, 2, 0}), Error);
  EXPECT_THROW(evaluate_partition(p, {0, 0}), Error);
  PartitionDevices bad = devices(2, 100);
  bad.caps_bytes = {100};
  try {
    PartitionProblem q(t, bad);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("caps"), std::string::npos);
  }
  bad = devices(2, 100);
  bad.link_bw_gbps = {0, 1, 0, 0};
  EXPECT_THROW(PartitionProblem(t, bad), Error);
}

TEST(PartitionProblem, LayerKeysCutAtTheFirstIndex) {
  EXPECT_EQ(layer_key("blocks.3.attn.qkv"), "blocks.3");
  EXPECT_EQ(layer_key("layer2.1.conv1"), "layer2.1");
  EXPECT_EQ(layer_key("head"), "head");
  EXPECT_EQ(layer_key("ln.weight"), "ln");
  EXPECT_EQ(layer_key(""), "");
}

}  // namespace
}  // namespace memsched
