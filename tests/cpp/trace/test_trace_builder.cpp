// Tests for core/trace_builder: event streams -> Trace, de-duplication by
// storage key, key reuse after a free, kind upgrades, and misuse errors.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "core/check.h"
#include "core/trace.h"
#include "core/trace_builder.h"

namespace memsched {
namespace {

// W (param 400 B) exists; op0 "mm" reads W and x (input, 80 B), writes y (120 B);
// op1 "relu_" in place on y; op2 "view" aliases y; autograd saves y; op3 "sum"
// makes s (4 B) after which x dies; y dies after op3; s outlives the step.
TEST(TraceBuilder, SmallForwardStep) {
  TraceBuilder b("cpu");
  b.tensor_existing(/*key=*/1, 400, "float32", TensorKind::kParameter);
  b.tensor_existing(2, 80, "float32", TensorKind::kTemporary);
  EXPECT_EQ(b.begin_op("aten::mm", "fc", Phase::kForward), 0);
  b.tensor_used(1);
  b.tensor_used(2);
  b.tensor_used(2);  // twice in one op: recorded once
  EXPECT_TRUE(b.tensor_allocated(3, 120, "float32", TensorKind::kTemporary));
  b.end_op(5.0, 960.0, 480, 120);
  b.check_invariants();

  EXPECT_EQ(b.begin_op("aten::relu_", "act", Phase::kForward), 1);
  b.tensor_used(3);
  EXPECT_FALSE(b.tensor_allocated(3, 120, "float32", TensorKind::kTemporary));  // in place: same storage
  b.end_op(1.0, 0, 120, 120);
  EXPECT_EQ(b.begin_op("aten::view", "act", Phase::kForward), 2);
  b.tensor_used(3);
  EXPECT_FALSE(b.tensor_allocated(3, 120, "float32", TensorKind::kTemporary));  // a view
  b.end_op(0, 0, 0, 0);
  b.upgrade_kind(3, TensorKind::kActivation, "act:0:act:[3, 10]:float32");
  b.upgrade_kind(3, TensorKind::kTemporary, "other");  // never lowers, label kept
  EXPECT_EQ(b.begin_op("aten::sum", "", Phase::kBackward), 3);
  b.tensor_used(3);
  EXPECT_TRUE(b.tensor_allocated(4, 4, "float32", TensorKind::kTemporary));
  b.end_op(0.5, 30, 120, 4);
  b.tensor_freed(2);
  b.tensor_freed(3);
  b.check_invariants();
  EXPECT_TRUE(b.is_live(4));
  EXPECT_FALSE(b.is_live(3));

  Trace t = b.finish();
  ASSERT_EQ(t.ops.size(), 4u);
  ASSERT_EQ(t.tensors.size(), 4u);
  EXPECT_EQ(t.device, "cpu");
  EXPECT_EQ(t.ops[0].name, "aten::mm");
  EXPECT_EQ(t.ops[0].module_path, "fc");
  EXPECT_DOUBLE_EQ(t.ops[0].duration_us, 5.0);
  EXPECT_DOUBLE_EQ(t.ops[0].flops, 960.0);
  EXPECT_EQ(t.ops[0].bytes_read, 480);
  EXPECT_EQ(t.ops[3].phase, Phase::kBackward);

  const TensorRecord& w = t.tensors[0];
  EXPECT_EQ(w.kind, TensorKind::kParameter);
  EXPECT_EQ(w.producer_op, kBeforeStep);
  EXPECT_EQ(w.uses, (std::vector<int64_t>{0}));
  EXPECT_EQ(w.freed_after_op, kAfterStep);
  const TensorRecord& x = t.tensors[1];
  EXPECT_EQ(x.uses, (std::vector<int64_t>{0}));
  EXPECT_EQ(x.freed_after_op, 3);
  const TensorRecord& y = t.tensors[2];
  EXPECT_EQ(y.bytes, 120);
  EXPECT_EQ(y.kind, TensorKind::kActivation);
  EXPECT_EQ(y.label, "act:0:act:[3, 10]:float32");
  EXPECT_EQ(y.producer_op, 0);
  EXPECT_EQ(y.uses, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(y.freed_after_op, 3);
  const TensorRecord& s = t.tensors[3];
  EXPECT_EQ(s.producer_op, 3);
  EXPECT_EQ(s.freed_after_op, kAfterStep);

  // Memory curve by hand: W+x+y during ops 0..2, plus s during op 3.
  EXPECT_EQ(t.live_bytes(), (std::vector<int64_t>{600, 600, 600, 604}));
  EXPECT_EQ(t.peak_bytes(), 604);
  EXPECT_EQ(t.activation_bytes(), 120);
  // finish() leaves the builder empty.
  EXPECT_EQ(b.num_ops(), 0);
  EXPECT_EQ(b.num_records(), 0);
}

TEST(TraceBuilder, RecordOpEqualsSeparateCalls) {
  TraceBuilder a, b;
  for (TraceBuilder* t : {&a, &b}) {
    t->tensor_existing(1, 400, "float32", TensorKind::kParameter);
    t->tensor_existing(2, 80, "float32", TensorKind::kTemporary);
  }
  a.begin_op("aten::mm", "fc", Phase::kForward);
  a.tensor_used(1);
  a.tensor_used(2);
  a.tensor_allocated(3, 120, "float32", TensorKind::kTemporary);
  a.end_op(5.0, 960.0, 480, 120);
  a.begin_op("aten::relu_", "act", Phase::kForward);
  a.tensor_used(3);
  a.tensor_allocated(3, 120, "float32", TensorKind::kTemporary);
  a.end_op(1.0, 0, 120, 120);
  EXPECT_EQ(b.record_op("aten::mm", "fc", Phase::kForward, {1, 2}, {{3, 120, "float32"}}, 5.0, 960.0, 480, 120), 0);
  EXPECT_EQ(b.record_op("aten::relu_", "act", Phase::kForward, {3}, {{3, 120, "float32"}}, 1.0, 0, 120, 120), 1);
  b.check_invariants();
  Trace ta = a.finish(), tb = b.finish();
  ASSERT_EQ(ta.tensors.size(), tb.tensors.size());
  for (size_t i = 0; i < ta.tensors.size(); ++i) {
    EXPECT_EQ(ta.tensors[i].uses, tb.tensors[i].uses);
    EXPECT_EQ(ta.tensors[i].producer_op, tb.tensors[i].producer_op);
    EXPECT_EQ(ta.tensors[i].bytes, tb.tensors[i].bytes);
  }
  EXPECT_EQ(ta.live_bytes(), tb.live_bytes());
  EXPECT_DOUBLE_EQ(tb.ops[0].flops, 960.0);
  // A bad key fails the call with the same message and leaves no op open.
  TraceBuilder c;
  EXPECT_THROW(c.record_op("x", "", Phase::kForward, {42}, {}, 0, 0, 0, 0), Error);
  EXPECT_FALSE(c.in_op());
}

TEST(TraceBuilder, KeyReusedAfterFreeIsANewRecord) {
  TraceBuilder b;
  b.begin_op("a", "", Phase::kForward);
  b.tensor_allocated(7, 100, "float32", TensorKind::kTemporary);
  b.end_op(0, 0, 0, 0);
  b.tensor_freed(7);  // freed after op 0
  b.begin_op("b", "", Phase::kForward);
  EXPECT_TRUE(b.tensor_allocated(7, 300, "float16", TensorKind::kTemporary));  // same address, new storage
  b.end_op(0, 0, 0, 0);
  Trace t = b.finish();
  ASSERT_EQ(t.tensors.size(), 2u);
  EXPECT_EQ(t.tensors[0].freed_after_op, 0);
  EXPECT_EQ(t.tensors[1].producer_op, 1);
  EXPECT_EQ(t.tensors[1].bytes, 300);
  EXPECT_EQ(t.tensors[1].dtype, "float16");
  EXPECT_EQ(t.live_bytes(), (std::vector<int64_t>{100, 300}));
}

TEST(TraceBuilder, ResizeGrowsBytesNeverShrinks) {
  TraceBuilder b;
  b.begin_op("empty", "", Phase::kForward);
  b.tensor_allocated(1, 0, "float32", TensorKind::kTemporary);
  b.end_op(0, 0, 0, 0);
  b.begin_op("resize_", "", Phase::kForward);
  EXPECT_FALSE(b.tensor_allocated(1, 64, "float32", TensorKind::kTemporary));
  EXPECT_FALSE(b.tensor_allocated(1, 32, "float32", TensorKind::kTemporary));
  b.end_op(0, 0, 0, 0);
  Trace t = b.finish();
  ASSERT_EQ(t.tensors.size(), 1u);
  EXPECT_EQ(t.tensors[0].bytes, 64);
}

TEST(TraceBuilder, KindUpgradeOrder) {
  TraceBuilder b;
  b.begin_op("op", "", Phase::kForward);
  b.tensor_allocated(1, 8, "float32", TensorKind::kTemporary);
  b.tensor_allocated(2, 8, "float32", TensorKind::kTemporary);
  b.end_op(0, 0, 0, 0);
  b.upgrade_kind(1, TensorKind::kGradient);
  b.upgrade_kind(1, TensorKind::kActivation);  // lower: ignored
  b.upgrade_kind(2, TensorKind::kOptimizerState);
  b.upgrade_kind(2, TensorKind::kGradient);
  Trace t = b.finish();
  EXPECT_EQ(t.tensors[0].kind, TensorKind::kGradient);
  EXPECT_EQ(t.tensors[1].kind, TensorKind::kOptimizerState);
}

TEST(TraceBuilder, FreedBeforeAnyOpIsDropped) {
  TraceBuilder b;
  b.tensor_existing(1, 10, "float32", TensorKind::kTemporary);
  b.tensor_existing(2, 20, "float32", TensorKind::kTemporary);
  b.tensor_freed(1);
  b.begin_op("op", "", Phase::kForward);
  b.tensor_used(2);
  b.end_op(0, 0, 0, 0);
  Trace t = b.finish();
  ASSERT_EQ(t.tensors.size(), 1u);
  EXPECT_EQ(t.tensors[0].id, 0);
  EXPECT_EQ(t.tensors[0].bytes, 20);
  EXPECT_EQ(t.tensors[0].uses, (std::vector<int64_t>{0}));
}

TEST(TraceBuilder, DurationsSetAfterTheStep) {
  TraceBuilder b;
  b.begin_op("op", "", Phase::kForward);
  b.end_op(0, 0, 0, 0);
  b.set_duration_us(0, 12.5);
  EXPECT_THROW(b.set_duration_us(1, 1.0), Error);
  EXPECT_THROW(b.set_duration_us(0, -1.0), Error);
  EXPECT_DOUBLE_EQ(b.finish().ops[0].duration_us, 12.5);
}

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    FAIL() << "expected memsched::Error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(TraceBuilder, HeldStampsTheLastOpBegun) {
  // Note [Held by the caller]: tensor_held raises held_until_op to the last op begun.
  TraceBuilder b("cpu");
  b.begin_op("aten::exp", "", Phase::kForward);
  b.tensor_allocated(1, 64, "float32", TensorKind::kTemporary);
  b.end_op(0, 0, 0, 64);
  b.upgrade_kind(1, TensorKind::kActivation, "act:0::[16]:float32");
  b.tensor_held(1);
  b.begin_op("aten::sin", "", Phase::kForward);
  b.tensor_used(1);
  b.tensor_allocated(2, 64, "float32", TensorKind::kTemporary);
  b.end_op(0, 0, 64, 64);
  b.tensor_held(1);
  b.begin_op("aten::mul", "", Phase::kForward);
  b.tensor_used(2);
  b.end_op(0, 0, 64, 0);
  b.tensor_freed(1);
  b.tensor_freed(2);
  const Trace t = b.finish();
  EXPECT_EQ(t.tensors[0].held_until_op, 1);
  EXPECT_EQ(t.tensors[1].held_until_op, kNotHeld);
}

TEST(TraceBuilder, MisuseGivesClearErrors) {
  TraceBuilder b;
  expect_error([&] { b.end_op(0, 0, 0, 0); }, "no op is open");
  expect_error([&] { b.tensor_allocated(1, 8, "float32", TensorKind::kTemporary); }, "outside an op");
  b.begin_op("a", "", Phase::kForward);
  expect_error([&] { b.begin_op("b", "", Phase::kForward); }, "still open");
  expect_error([&] { b.tensor_used(99); }, "storage 99 is not live");
  expect_error([&] { b.tensor_freed(99); }, "storage 99 is not live");
  expect_error([&] { b.upgrade_kind(99, TensorKind::kActivation); }, "storage 99 is not live");
  expect_error([&] { b.end_op(-1, 0, 0, 0); }, "negative measurement");
  expect_error([&] { b.finish(); }, "still open");
  b.tensor_allocated(1, 8, "float32", TensorKind::kTemporary);
  expect_error([&] { b.tensor_existing(1, 8, "float32", TensorKind::kTemporary); }, "live already");
  expect_error([&] { b.tensor_allocated(2, -8, "float32", TensorKind::kTemporary); }, "negative bytes");
  b.end_op(0, 0, 0, 0);
  b.check_invariants();
}

}  // namespace
}  // namespace memsched
