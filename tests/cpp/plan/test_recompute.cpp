// test_recompute.cpp -- recompute chains (Note [Recompute model]), their
// validation in plans and the simulator's replays on the compute stream.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "core/check.h"
#include "core/plan.h"
#include "core/recompute.h"
#include "core/simulator.h"
#include "core/trace.h"

#include "trace_fixtures.h"

namespace memsched {
namespace {

// fwd: 0 linear(x, w) -> a; 1 relu(a) -> b; 2 dropout(b) -> c; 3 loss(c)
// bwd: 4 reads b, c; 5 reads a; 6 reads x, w. Every op takes 10 us.
// Tensors: 0 w (parameter), 1 x (model input, saved), 2 a, 3 b, 4 c, 5 loss.
Trace small_trace() {
  Trace t;
  test_traces::add_ops(t, {"aten::linear", "aten::relu", "aten::native_dropout", "aten::mse_loss",
                           "dropout_backward", "relu_backward", "linear_backward"}, 4, 10.0);
  auto add = [&](int64_t bytes, TensorKind kind, int64_t producer, std::vector<int64_t> uses, int64_t freed) {
    test_traces::add_tensor(t, bytes, kind, producer, std::move(uses), freed);
  };
  add(100, TensorKind::kParameter, kBeforeStep, {0, 6}, kAfterStep);
  add(1000, TensorKind::kActivation, kBeforeStep, {0, 6}, 6);
  add(2000, TensorKind::kActivation, 0, {1, 5}, 5);
  add(3000, TensorKind::kActivation, 1, {2, 4}, 4);
  add(4000, TensorKind::kActivation, 2, {3, 4}, 4);
  add(4, TensorKind::kTemporary, 3, {4}, 4);
  t.validate();
  return t;
}

std::vector<TensorDecision> keep_all(const OffloadAnalysis& a) { return keep_all_plan(a, 0).decisions; }

// ATen's LSTM cell, two steps: 0 addmm -> X (input gates of every step, freed in forward);
// 1 addmm -> G1; 2 G1.add_(X); 3 addmm -> G2; 4 G2.add_(X); backward 5 reads G2, 6 reads G1.
// Recomputing G2 needs X (gone by op 5), whose "writers" include op 2 -- which really writes G1, a
// live tensor the replay would corrupt. See Note [Recompute model]: the chain is refused.
TEST(Recompute, AnInPlaceOpReadingALiveTensorIsNotReplayed) {
  Trace t;
  test_traces::add_ops(t, {"aten::addmm", "aten::addmm", "aten::add_", "aten::addmm", "aten::add_", "mm_backward",
                           "mm_backward"}, 5, 10.0);
  test_traces::add_tensor(t, 960, TensorKind::kTemporary, 0, {2, 4}, 4);       // X
  test_traces::add_tensor(t, 240, TensorKind::kActivation, 1, {2, 6}, 6);      // G1
  test_traces::add_tensor(t, 240, TensorKind::kActivation, 3, {4, 5}, 5);      // G2
  t.validate();
  const OffloadAnalysis a = analyze_offload(t);
  const RecomputeChain c = recompute_chain(t, a, a.candidate_index[2]);
  EXPECT_FALSE(c.feasible);
  EXPECT_NE(c.why.find("in-place op 2"), std::string::npos) << c.why;
  EXPECT_NE(c.why.find("tensor 1"), std::string::npos) << c.why;
  // G1 (first used at op 6, when G2 is gone too): its chain recreates G2 as well, so op 4 writes
  // only recreated tensors and the replay is allowed.
  const RecomputeChain g1 = recompute_chain(t, a, a.candidate_index[1]);
  EXPECT_TRUE(g1.feasible) << g1.why;
  EXPECT_EQ(g1.ops, (std::vector<int64_t>{0, 1, 2, 3, 4}));
}

// cuDNN's LSTM: 0 _cudnn_rnn(x, w) -> y (its dropout masks from a state buffer of its own);
// 1 relu(y) -> z; backward 2 reads z, 3 reads y. A replay of op 0 would draw other masks.
TEST(Recompute, AChainThroughACudnnRnnIsRefused) {
  Trace t;
  test_traces::add_ops(t, {"aten::_cudnn_rnn", "aten::relu", "relu_backward", "cudnn_rnn_backward"}, 2, 10.0);
  test_traces::add_tensor(t, 100, TensorKind::kParameter, kBeforeStep, {0, 3}, kAfterStep);  // w
  test_traces::add_tensor(t, 100, TensorKind::kActivation, kBeforeStep, {0, 3}, 3);          // x
  test_traces::add_tensor(t, 400, TensorKind::kActivation, 0, {1, 3}, 3);                    // y
  test_traces::add_tensor(t, 400, TensorKind::kActivation, 1, {2}, 2);                       // z
  t.validate();
  const OffloadAnalysis a = analyze_offload(t);
  const RecomputeChain y = recompute_chain(t, a, a.candidate_index[2]);
  EXPECT_FALSE(y.feasible);
  EXPECT_NE(y.why.find("op 0 (aten::_cudnn_rnn)"), std::string::npos) << y.why;
  // z replays relu from y, which stays: allowed
  EXPECT_TRUE(recompute_chain(t, a, a.candidate_index[3]).feasible);
  EXPECT_TRUE(has_own_rng_state("aten::miopen_rnn") && has_own_rng_state("_cudnn_rnn.default"));
  EXPECT_FALSE(has_own_rng_state("aten::rnn_tanh") || has_own_rng_state("aten::_cudnn_rnn_backward"));
}

// A fused kernel from an extension: 0 empty_like(x) -> y, filled by a kernel no dispatch mode sees;
// 1 relu(y) -> z; backward 2 reads z, 3 reads y. Replaying op 0 would give uninitialised memory (Note
// [Memory filled outside the dispatcher]); with an in-place writer (dropout's bernoulli_) it is aten's.
TEST(Recompute, ATensorFilledOutsideTheDispatcherIsNotReplayed) {
  for (const bool written : {false, true}) {
    Trace t;
    test_traces::add_ops(t, {"aten::empty_like", written ? "aten::bernoulli_.float" : "aten::sin", "aten::relu",
                             "relu_backward", "fused_backward"}, 3, 10.0);
    test_traces::add_tensor(t, 100, TensorKind::kActivation, kBeforeStep, {0, 4}, kAfterStep);  // x
    test_traces::add_tensor(t, 400, TensorKind::kActivation, 0, written ? std::vector<int64_t>{1, 2, 4}
                                                                         : std::vector<int64_t>{2, 4}, 4);  // y
    test_traces::add_tensor(t, 400, TensorKind::kActivation, 2, {3}, 3);  // z
    t.validate();
    const OffloadAnalysis a = analyze_offload(t);
    const RecomputeChain y = recompute_chain(t, a, a.candidate_index[1]);
    EXPECT_EQ(y.feasible, written) << y.why;
    if (!written) EXPECT_NE(y.why.find("op 0 (aten::empty_like) and no aten op writes it"), std::string::npos) << y.why;
    // z replays relu from y: with y gone (recomputed or offloaded), y's replay is in its chain too
    std::vector<TensorDecision> d = keep_all(a);
    d[a.candidate_index[1]].offload = true;
    d[a.candidate_index[1]].offload_after_op = 2;
    d[a.candidate_index[1]].prefetch_at_op = 4;
    const RecomputeChain z = recompute_chain(t, a, a.candidate_index[2], d);
    EXPECT_EQ(z.feasible, written) << z.why;
  }
  EXPECT_TRUE(is_uninitialized_factory_name("aten::new_empty_strided.default"));
  EXPECT_FALSE(is_uninitialized_factory_name("aten::empty_cache"));
}

TEST(Recompute, ChainReplaysFromTheNearestKeptInputs) {
  const Trace t = small_trace();
  const OffloadAnalysis a = analyze_offload(t);
  ASSERT_EQ(a.candidates.size(), 4u);  // x, a, b, c
  const int64_t kx = a.candidate_index[1], ka = a.candidate_index[2], kb = a.candidate_index[3],
                kc = a.candidate_index[4];
  // Everything else kept: one op each; only the dropout's output needs the RNG replayed.
  EXPECT_EQ(recompute_chain(t, a, ka).ops, (std::vector<int64_t>{0}));
  EXPECT_EQ(recompute_chain(t, a, kb).ops, (std::vector<int64_t>{1}));
  const RecomputeChain c = recompute_chain(t, a, kc);
  EXPECT_EQ(c.ops, (std::vector<int64_t>{2}));
  EXPECT_TRUE(c.rng);
  EXPECT_FALSE(recompute_chain(t, a, kb).rng);
  // The model input has no forward producer.
  const RecomputeChain cx = recompute_chain(t, a, kx);
  EXPECT_FALSE(cx.feasible);
  EXPECT_NE(cx.why.find("exists before the step"), std::string::npos) << cx.why;
  // b offloaded: c's replay must recreate b first.
  std::vector<TensorDecision> d = keep_all(a);
  d[kb] = TensorDecision(3, true, 1, 4);
  EXPECT_EQ(recompute_chain(t, a, kc, d).ops, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(recompute_transient_bytes(a, a.candidates[kc], {1, 2}), 3000);  // b, dropped after the replay
  // a, b recomputed and x offloaded: the chain reaches x, which cannot be replayed.
  d[ka].recompute = d[kb].recompute = true;
  d[kb].offload = false;
  d[kx] = TensorDecision(1, true, 0, 6);
  const RecomputeChain gone = recompute_chain(t, a, kc, d);
  EXPECT_FALSE(gone.feasible);
  EXPECT_NE(gone.why.find("tensor 1"), std::string::npos) << gone.why;
}

TEST(Recompute, InPlaceWritersAreReplayedWithTheProducer) {
  // Dropout as ATen records it: the mask is allocated by empty_like, filled by
  // bernoulli_ (RNG) and scaled by div_, then saved by mul for backward.
  Trace t;
  test_traces::add_ops(t, {"aten::empty_like", "aten::bernoulli_", "aten::div_", "aten::mul", "aten::mul_backward"}, 4,
                       1.0);
  auto add = [&](TensorKind kind, int64_t producer, std::vector<int64_t> uses, int64_t freed) {
    test_traces::add_tensor(t, 64, kind, producer, std::move(uses), freed);
  };
  add(TensorKind::kParameter, kBeforeStep, {0, 3}, kAfterStep);  // x (held all step)
  add(TensorKind::kActivation, 0, {1, 2, 3, 4}, 4);               // the mask
  add(TensorKind::kTemporary, 3, {4}, 4);                         // y
  const OffloadAnalysis a = analyze_offload(t);
  ASSERT_EQ(a.candidates.size(), 1u);
  const RecomputeChain c = recompute_chain(t, a, 0);
  ASSERT_TRUE(c.feasible) << c.why;
  EXPECT_EQ(c.ops, (std::vector<int64_t>{0, 1, 2}));  // not just empty_like
  EXPECT_TRUE(c.rng);
  for (const char* name : {"aten::div_", "aten::add_.Tensor", "relu_"}) EXPECT_TRUE(is_inplace_op_name(name)) << name;
  for (const char* name : {"aten::add", "aten::__and__", "aten::_log_softmax", "_", ""})
    EXPECT_FALSE(is_inplace_op_name(name)) << name;
}

TEST(Recompute, SimulatorReplaysOnTheComputeStreamBeforeTheUse) {
  const Trace t = small_trace();
  const OffloadAnalysis a = analyze_offload(t);
  Plan p = keep_all_plan(a, t.peak_bytes());
  const int64_t kb = a.candidate_index[3];
  p.decisions[kb].recompute = true;
  p.decisions[kb].recompute_ops = {1};
  p.decisions[kb].recompute_at_op = 4;
  validate_plan(t, a, p);
  DeviceModel device;
  const SimResult r = simulate(t, p, device);
  r.check_invariants(t, p);
  // Seven 10 us ops plus one 10 us replay of op 1 right before op 4 (b's first backward use).
  EXPECT_DOUBLE_EQ(r.compute_us, 70.0);
  EXPECT_DOUBLE_EQ(r.recompute_us, 10.0);
  EXPECT_DOUBLE_EQ(r.stall_us, 0.0);
  EXPECT_DOUBLE_EQ(r.step_time_us, 80.0);
  EXPECT_DOUBLE_EQ(r.op_start_us[4], 50.0);
  int replays = 0;
  for (const auto& e : r.events) {
    if (e.kind != EventKind::kRecompute) continue;
    ++replays;
    EXPECT_EQ(e.stream, Stream::kCompute);
    EXPECT_EQ(e.id, 3);
    EXPECT_DOUBLE_EQ(e.start_us, 40.0);
    EXPECT_DOUBLE_EQ(e.end_us, 50.0);
  }
  EXPECT_EQ(replays, 1);
  // b is off the device during op 3 (after its last forward use, op 2): the
  // modelled memory and the simulated peak both drop by its 3000 bytes there.
  const std::vector<int64_t> kept = modelled_memory(a, keep_all(a));
  const std::vector<int64_t> mem = modelled_memory(a, p.decisions);
  EXPECT_EQ(kept[3] - mem[3], 3000);
  for (int i : {0, 1, 2, 4, 5, 6}) EXPECT_EQ(kept[i], mem[i]) << "op " << i;
  Plan tight = p;
  tight.budget_bytes = *std::max_element(mem.begin(), mem.end());
  const SimResult rt = simulate(t, tight, device);
  EXPECT_FALSE(rt.over_budget);
  EXPECT_LE(rt.peak_bytes, tight.budget_bytes);
}

TEST(Recompute, OneReplayRecreatesAndKeepsAnotherRecomputedTensor) {
  // a (used again by op 5) and b (first used by op 4) both recomputed: b's
  // replay at op 4 must recreate a on its way (op 1 reads a), so it keeps a
  // instead of replaying op 0 again before op 5.
  const Trace t = small_trace();
  const OffloadAnalysis a = analyze_offload(t);
  const int64_t ka = a.candidate_index[2], kb = a.candidate_index[3];
  Plan p = keep_all_plan(a, t.peak_bytes());
  p.decisions[ka].recompute = p.decisions[kb].recompute = true;
  const RecomputeSchedule s = recompute_schedule(t, a, p.decisions);
  EXPECT_EQ(s.chains[kb].ops, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(s.kept_alive[kb], (std::vector<int64_t>{ka}));
  EXPECT_TRUE(s.chains[ka].feasible);
  EXPECT_TRUE(s.chains[ka].ops.empty());
  EXPECT_EQ(s.at_op[ka], 4);  // recreated before op 4, one op before its own first backward use
  p.decisions[kb].recompute_ops = {0, 1};
  p.decisions[kb].recompute_at_op = 4;
  p.decisions[ka].recompute_at_op = 4;
  validate_plan(t, a, p);
  const SimResult r = simulate(t, p, DeviceModel{});
  r.check_invariants(t, p);
  EXPECT_DOUBLE_EQ(r.recompute_us, 20.0);  // ops 0 and 1 once; not 30 (0, 1, then 0 again)
  EXPECT_DOUBLE_EQ(r.step_time_us, 90.0);
  EXPECT_DOUBLE_EQ(r.op_start_us[5], r.op_end_us[4]);  // a is there for op 5: no second replay
  // a is off the device during ops 2 and 3 (after its last forward use, op 1)
  // and back from op 4: the modelled memory drops by a's 2000 bytes there.
  const std::vector<int64_t> kept = modelled_memory(a, keep_all(a)), mem = modelled_memory(a, p.decisions);
  EXPECT_EQ(kept[2] - mem[2], 2000);  // b is still read by op 2
  EXPECT_EQ(kept[3] - mem[3], 2000 + 3000);
  EXPECT_LE(r.peak_bytes, *std::max_element(mem.begin(), mem.end()));
}

TEST(Recompute, AReplayKeepsTheOtherOutputsOfItsOpsThatThePlanRecomputes) {
  // 0 conv(x, w) -> a; 1 max_pool2d_with_indices(a) -> v, i; 2 linear(v) -> y; 3 loss(y)
  // bwd: 4 reads v (linear's backward); 5 reads a, i (the pool's); 6 reads x, w.
  // Recomputing v and i: the replay of op 1 before op 4 makes i too, so i is kept from there
  // rather than replayed again before op 5 (which made v a second time, beside the first).
  Trace t;
  test_traces::add_ops(t, {"aten::convolution", "aten::max_pool2d_with_indices", "aten::linear", "aten::mse_loss",
                           "linear_backward", "max_pool2d_with_indices_backward", "convolution_backward"},
                       4, 10.0);
  auto add = [&](int64_t bytes, TensorKind kind, int64_t producer, std::vector<int64_t> uses, int64_t freed) {
    test_traces::add_tensor(t, bytes, kind, producer, std::move(uses), freed);
  };
  add(100, TensorKind::kParameter, kBeforeStep, {0, 6}, kAfterStep);  // 0 w
  add(1000, TensorKind::kActivation, kBeforeStep, {0, 6}, 6);         // 1 x
  add(4000, TensorKind::kActivation, 0, {1, 5}, 5);                   // 2 a
  add(1000, TensorKind::kActivation, 1, {2, 4}, 4);                   // 3 v
  add(2000, TensorKind::kActivation, 1, {5}, 5);                      // 4 i
  add(4, TensorKind::kTemporary, 3, {4}, 4);                          // 5 loss
  t.validate();
  const OffloadAnalysis a = analyze_offload(t);
  const int64_t kv = a.candidate_index[3], ki = a.candidate_index[4];
  Plan p = keep_all_plan(a, t.peak_bytes());
  p.decisions[kv].recompute = p.decisions[ki].recompute = true;
  const RecomputeSchedule s = recompute_schedule(t, a, p.decisions);
  EXPECT_EQ(s.chains[kv].ops, (std::vector<int64_t>{1}));
  EXPECT_EQ(s.kept_alive[kv], (std::vector<int64_t>{ki}));
  EXPECT_TRUE(s.chains[ki].feasible);
  EXPECT_TRUE(s.chains[ki].ops.empty());
  EXPECT_EQ(s.at_op[ki], 4);
  p.decisions[kv].recompute_ops = {1};
  p.decisions[kv].recompute_at_op = p.decisions[ki].recompute_at_op = 4;
  validate_plan(t, a, p);
  const SimResult r = simulate(t, p, DeviceModel{});
  r.check_invariants(t, p);
  EXPECT_DOUBLE_EQ(r.recompute_us, 10.0);  // op 1 once, not twice
  const std::vector<int64_t> mem = modelled_memory(a, p.decisions);
  EXPECT_LE(r.peak_bytes, *std::max_element(mem.begin(), mem.end()));
}

TEST(Recompute, ReplayTransientBytesCountAtTheUse) {
  const Trace t = small_trace();
  const OffloadAnalysis a = analyze_offload(t);
  Plan p = keep_all_plan(a, t.peak_bytes() * 2);
  const int64_t kb = a.candidate_index[3], kc = a.candidate_index[4];
  p.decisions[kb] = TensorDecision(3, true, 1, 4);
  p.decisions[kc].recompute = true;
  p.decisions[kc].recompute_ops = {1, 2};
  p.decisions[kc].recompute_at_op = 4;
  validate_plan(t, a, p);
  Plan offload_only = p;
  offload_only.decisions[kc] = TensorDecision(4, true, 2, 4);
  const auto mem = modelled_memory(a, p.decisions), off = modelled_memory(a, offload_only.decisions);
  EXPECT_EQ(mem[4] - off[4], 3000);  // the replayed b besides the fetched one
  const SimResult r = simulate(t, p, DeviceModel{});
  r.check_invariants(t, p);
  EXPECT_DOUBLE_EQ(r.recompute_us, 20.0);
  EXPECT_LE(r.peak_bytes, *std::max_element(mem.begin(), mem.end()));
}

void expect_plan_error(const Trace& t, const Plan& p, const std::string& needle) {
  try {
    validate_plan(t, analyze_offload(t), p);
    FAIL() << "expected an error containing: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Recompute, PlanValidationNamesTheFieldAndTheFix) {
  const Trace t = small_trace();
  const OffloadAnalysis a = analyze_offload(t);
  const int64_t kb = a.candidate_index[3], kx = a.candidate_index[1];
  Plan p = keep_all_plan(a, 1 << 20);
  p.decisions[kb].recompute = true;
  p.decisions[kb].recompute_ops = {0, 1};
  p.decisions[kb].recompute_at_op = 4;
  expect_plan_error(t, p, "field 'recompute_ops' is [0, 1] but under this plan the tensor is recreated by "
                          "replaying ops [1]");
  p.decisions[kb].recompute_ops = {1};
  p.decisions[kb].recompute_at_op = 3;
  expect_plan_error(t, p, "field 'recompute_at_op' is 3 but under this plan the tensor is recreated just before op 4");
  p.decisions[kb].recompute_at_op = 4;
  validate_plan(t, a, p);
  p.decisions[kb].offload = true;
  expect_plan_error(t, p, "sets both 'recompute' and 'offload'");
  p.decisions[kb] = TensorDecision(3, false, -1, -1);
  p.decisions[kb].recompute_ops = {1};
  expect_plan_error(t, p, "field 'recompute_ops' or 'recompute_at_op' is set but 'recompute' is false");
  p.decisions[kb].recompute_ops.clear();
  p.decisions[kx].recompute = true;
  expect_plan_error(t, p, "tensor 1) field 'recompute' is true but the tensor cannot be recomputed");
}

}  // namespace
}  // namespace memsched
