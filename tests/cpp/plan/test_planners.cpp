// test_planners.cpp -- every registered planner on random traces: plans are
// well formed, stay within the budget in the simulator, and an unreachable
// budget is an error stating the least budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "core/check.h"
#include "core/planner.h"
#include "core/prefetch_placement.h"
#include "core/simulator.h"
#include "core/synthetic_trace.h"
#include "core/trace_json.h"
#include "trace_fixtures.h"

namespace memsched {
namespace {

DeviceModel pcie_like() {
  DeviceModel d;
  d.name = "test";
  d.d2h_bw_gbps = 20.0;
  d.h2d_bw_gbps = 25.0;
  d.d2h_latency_us = 10;
  d.h2d_latency_us = 10;
  return d;
}

Trace random_trace(uint64_t seed) {
  std::mt19937_64 rng(seed);
  SyntheticTraceOptions o;
  o.seed = seed;
  o.num_layers = 2 + static_cast<int64_t>(rng() % 20);
  o.ops_per_layer = 1 + static_cast<int64_t>(rng() % 3);
  o.skip_probability = (rng() % 3) * 0.25;
  return make_synthetic_trace(o);
}

TEST(Planners, RegistryListsEveryPlannerAndRejectsTypos) {
  const std::vector<std::string> expected = {"keep_all", "offload_all_sync", "offload_all_prefetch",
                                             "vdnn", "greedy", "dp", "hybrid"};
  EXPECT_EQ(planner_names(), expected);
  for (const auto& name : expected) EXPECT_EQ(create_planner(name)->name(), name);
  try {
    create_planner("dynamic");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("known planners: keep_all"), std::string::npos) << e.what();
  }
}

TEST(Planners, EveryPlanStaysWithinTheBudgetInSimulation) {
  int made = 0;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    const Trace t = random_trace(seed);
    const OffloadAnalysis a = analyze_offload(t);
    const int64_t least = least_budget_bytes(a), peak = t.peak_bytes();
    for (double frac : {0.0, 0.3, 0.6, 1.0}) {
      const int64_t budget = least + static_cast<int64_t>(frac * static_cast<double>(peak - least));
      for (const auto& name : planner_names()) {
        SCOPED_TRACE(name + " seed " + std::to_string(seed) + " budget " + std::to_string(budget));
        Plan p;
        try {
          p = make_plan(t, pcie_like(), budget, name);
        } catch (const Error& e) {
          // Only the fixed policies may refuse a reachable budget; they say what they need.
          EXPECT_TRUE(name == "keep_all" || name == "vdnn" || name == "dp" || name == "hybrid") << e.what();
          EXPECT_NE(std::string(e.what()).find("needs at least"), std::string::npos) << e.what();
          continue;
        }
        ++made;
        validate_plan(t, a, p);
        EXPECT_EQ(p.planner, name);
        for (int64_t m : modelled_memory(a, p.decisions)) ASSERT_LE(m, budget);
        const SimResult r = simulate(t, p, pcie_like());
        r.check_invariants(t, p);
        EXPECT_LE(r.peak_bytes, budget);
        EXPECT_FALSE(r.over_budget);
        EXPECT_NEAR(r.step_time_us, r.compute_us + r.recompute_us + r.stall_us, 1e-6 * r.step_time_us);
        EXPECT_EQ(r.bytes_to_host, p.offloaded_bytes(t));
        EXPECT_EQ(r.bytes_to_device, p.offloaded_bytes(t));
      }
    }
  }
  EXPECT_GT(made, 500);
}

TEST(Planners, GreedyAndOffloadAllReachTheLeastBudget) {
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    const Trace t = random_trace(seed);
    const int64_t least = least_budget_bytes(analyze_offload(t));
    for (const char* name : {"greedy", "offload_all_sync", "offload_all_prefetch"})
      EXPECT_NO_THROW(make_plan(t, pcie_like(), least, name)) << name;
  }
}

TEST(Planners, BudgetBelowTheLeastIsAnErrorStatingIt) {
  const Trace t = random_trace(3);
  const int64_t least = least_budget_bytes(analyze_offload(t));
  for (const auto& name : planner_names()) {
    try {
      make_plan(t, pcie_like(), least - 1, name);
      FAIL() << name << " accepted an unreachable budget";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(std::to_string(least)), std::string::npos) << name << ": " << msg;
    }
  }
}

TEST(Planners, KeepAllMatchesPlainExecution) {
  const Trace t = random_trace(5);
  const Plan p = make_plan(t, pcie_like(), t.peak_bytes(), "keep_all");
  EXPECT_EQ(p.num_offloaded(), 0);
  const SimResult r = simulate(t, p, pcie_like());
  EXPECT_EQ(r.peak_bytes, t.peak_bytes());
  EXPECT_DOUBLE_EQ(r.stall_us, 0.0);
  EXPECT_DOUBLE_EQ(r.step_time_us, stall_free_start_us(t, pcie_like()).back());
  EXPECT_THROW(make_plan(t, pcie_like(), t.peak_bytes() - 1, "keep_all"), Error);
}

// Note [Modelled memory]: whatever the decisions, the simulated peak never
// exceeds the modelled peak when the budget is at least the modelled peak.
TEST(Planners, SimulatedPeakNeverExceedsModelledPeak) {
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    const Trace t = random_trace(seed);
    const OffloadAnalysis a = analyze_offload(t);
    std::mt19937_64 rng(seed);
    Plan p = keep_all_plan(a, 0);
    p.copies_on_compute_stream = seed % 4 == 0;
    for (size_t k = 0; k < a.candidates.size(); ++k) {
      const auto& c = a.candidates[k];
      if (rng() % 2) continue;
      const int64_t off = c.earliest_offload_op + static_cast<int64_t>(rng() % (a.first_backward_op - c.earliest_offload_op));
      const int64_t pre = a.first_backward_op + static_cast<int64_t>(rng() % (c.first_backward_use - a.first_backward_op + 1));
      p.decisions[k] = {c.tensor_id, true, off, pre};
    }
    const auto mem = modelled_memory(a, p.decisions);
    p.budget_bytes = *std::max_element(mem.begin(), mem.end());
    const SimResult r = simulate(t, p, pcie_like());
    r.check_invariants(t, p);
    EXPECT_LE(r.peak_bytes, p.budget_bytes) << "seed " << seed;
    EXPECT_FALSE(r.over_budget) << "seed " << seed;
  }
}

TEST(Planners, AnActivationHeldPastTheStepIsNeverOffloaded) {
  // The caller's batch (exists before the step, outlives it) and a saved forward output that
  // outlives the step: offloading either frees nothing, so neither is a candidate.
  Trace t;
  test_traces::add_ops(t, std::vector<std::string>(4, "op"), 2);
  auto add = [&](int64_t producer, std::vector<int64_t> uses, int64_t freed) {
    test_traces::add_tensor(t, 1024, TensorKind::kActivation, producer, std::move(uses), freed);
  };
  add(kBeforeStep, {0, 3}, kAfterStep);  // the batch
  add(0, {1, 2}, kAfterStep);            // an output the caller keeps
  add(1, {2}, 2);                        // an ordinary activation
  const OffloadAnalysis a = analyze_offload(t);
  ASSERT_EQ(a.candidates.size(), 1u);
  EXPECT_EQ(a.candidates[0].tensor_id, 2);
  EXPECT_EQ(a.candidate_index[0], -1);
  EXPECT_EQ(a.candidate_index[1], -1);
}

TEST(Planners, AnActivationHeldByTheCallerLeavesOnlyWhenReleased) {
  // Note [Held by the caller]: a frame holds tensor 0 through op 3 (its last use is op 1), so an
  // offload releases it after op 3, and the least budget counts it there; tensor 1 is held into the
  // backward pass, so it is no candidate.
  Trace t;
  test_traces::add_ops(t, std::vector<std::string>(8, "op"), 5);
  auto add = [&](int64_t producer, std::vector<int64_t> uses, int64_t freed, int64_t held) {
    test_traces::add_tensor(t, 1024, TensorKind::kActivation, producer, std::move(uses), freed, held);
  };
  add(0, {1, 7}, 7, 3);
  add(2, {3, 6}, 6, 5);
  add(4, {4, 5}, 5, kNotHeld);
  const OffloadAnalysis a = analyze_offload(t);
  ASSERT_EQ(a.candidates.size(), 2u);
  EXPECT_EQ(a.candidates[0].tensor_id, 0);
  EXPECT_EQ(a.candidates[0].last_forward_use, 3);
  EXPECT_EQ(a.candidate_index[1], -1);
  EXPECT_EQ(a.candidates[1].last_forward_use, 4);
  // Offloading everything: tensor 0 on the device during ops 0..3, tensor 1 always, tensor 2 at 4..5.
  std::vector<TensorDecision> d = {{0, true, 1, 7}, {2, true, 4, 5}};
  const std::vector<int64_t> mem = modelled_memory(a, d);
  EXPECT_EQ(mem, (std::vector<int64_t>{1024, 1024, 2048, 2048, 2048, 2048, 1024, 1024}));
  EXPECT_EQ(least_budget_bytes(a), 2048);
  t.tensors[0].held_until_op = 0;  // held no longer than its uses: the last use decides
  EXPECT_EQ(analyze_offload(t).candidates[0].last_forward_use, 1);
}

TEST(Planners, AStorageSavedThroughSeveralVersionCountersIsNoCandidate) {
  // Note [Saves through several counters]: each counter's copy would come back as a storage of its own.
  Trace t;
  test_traces::add_ops(t, std::vector<std::string>(6, "op"), 3);
  test_traces::add_tensor(t, 1024, TensorKind::kActivation, 0, {1, 5}, 5);
  test_traces::add_tensor(t, 1024, TensorKind::kActivation, 1, {2, 4}, 4);
  t.tensors[1].save_counters = 2;
  t.validate();
  const OffloadAnalysis a = analyze_offload(t);
  ASSERT_EQ(a.candidates.size(), 1u);
  EXPECT_EQ(a.candidates[0].tensor_id, 0);
  EXPECT_EQ(a.candidate_index[1], -1);
  const Trace back = trace_from_json(trace_to_json(t));
  EXPECT_EQ(back.tensors[1].save_counters, 2);
  EXPECT_EQ(back.tensors[0].save_counters, 1);
  t.tensors[1].save_counters = 0;
  EXPECT_THROW(t.validate(), Error);
}

}  // namespace
}  // namespace memsched
