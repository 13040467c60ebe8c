// test_hybrid_planner.cpp -- the hybrid planner's DP equals brute force over
// keep/offload/recompute per tensor on its model (Note [Hybrid planner]), its
// plans fit the budget in the simulator and are never slower there than any
// other planner's, and recompute wins where copies cannot hide.
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <random>

#include "core/check.h"
#include "core/dp_planner.h"
#include "core/hybrid_planner.h"
#include "core/plan.h"
#include "core/planner.h"
#include "core/recompute.h"
#include "core/simulator.h"
#include "core/synthetic_trace.h"

namespace memsched {
namespace {

DeviceModel slow_link() {  // copies of 1-8 MiB take 0.5-4 ms each way; ops take 50-500 us
  DeviceModel d;
  d.d2h_bw_gbps = 2.0;
  d.h2d_bw_gbps = 2.0;
  d.d2h_latency_us = 5;
  d.h2d_latency_us = 5;
  return d;
}

struct BruteForce {
  bool feasible = false;
  int64_t cost = 0;
  int64_t tie = 0;
};

// Every assignment of keep (0) / offload (1) / recompute (2) to the candidates
// in pi, evaluated from the model's definition op by op: a tensor at position
// k of pi that is offloaded or recomputed frees g * floor(bytes / g) during
// ops f'_k < i < first_backward_use_k (f'_k: max last_forward_use over
// positions <= k); every op must satisfy live_bytes[i] - freed[i] <= budget.
// Recompute is allowed only where recompute_cost >= 0. Cost: the sum of the
// chosen actions' costs; tie: the sum of positions of the tensors off the
// device. Independent of the DP (no prefix aggregation, no min of costs).
// With `eligible` non-empty only those enter pi; with `force` the others are
// always off (offloaded or recomputed, whichever is cheaper, over their exact
// windows), otherwise kept.
BruteForce brute_force(const OffloadAnalysis& a, int64_t budget, int64_t g, const std::vector<int64_t>& off_cost,
                       const std::vector<int64_t>& rc_cost, const std::vector<bool>& eligible, bool force) {
  const auto& c = a.candidates;
  std::vector<int64_t> pi;
  std::vector<int64_t> live = a.live_bytes;
  int64_t base_cost = 0;
  for (int64_t k = 0; k < static_cast<int64_t>(c.size()); ++k) {
    if (eligible.empty() || eligible[k]) {
      pi.push_back(k);
    } else if (force) {
      int64_t best = off_cost[k];
      if (rc_cost[k] >= 0) best = std::min(best, rc_cost[k]);
      base_cost += best;
      for (int64_t i = c[k].last_forward_use + 1; i < c[k].first_backward_use; ++i) live[i] -= c[k].bytes;
    }
  }
  std::sort(pi.begin(), pi.end(), [&](int64_t x, int64_t y) {
    if (c[x].first_backward_use != c[y].first_backward_use) return c[x].first_backward_use > c[y].first_backward_use;
    if (c[x].last_forward_use != c[y].last_forward_use) return c[x].last_forward_use < c[y].last_forward_use;
    return c[x].tensor_id < c[y].tensor_id;
  });
  const auto n = static_cast<int64_t>(pi.size());
  std::vector<int64_t> f_nested(n);
  int64_t run = -1;
  for (int64_t k = 0; k < n; ++k) f_nested[k] = run = std::max(run, c[pi[k]].last_forward_use);
  BruteForce best;
  std::vector<int> action(n, 0);
  const auto n_ops = static_cast<int64_t>(live.size());
  while (true) {
    bool allowed = true;
    int64_t cost = base_cost, tie = 0;
    std::vector<int64_t> freed(n_ops, 0);
    for (int64_t k = 0; k < n && allowed; ++k) {
      if (action[k] == 0) continue;
      if (action[k] == 2 && rc_cost[pi[k]] < 0) allowed = false;
      cost += action[k] == 1 ? off_cost[pi[k]] : rc_cost[pi[k]];
      tie += k;
      const auto& t = c[pi[k]];
      for (int64_t i = f_nested[k] + 1; i < t.first_backward_use; ++i) freed[i] += (t.bytes / g) * g;
    }
    for (int64_t i = 0; i < n_ops && allowed; ++i) allowed = live[i] - freed[i] <= budget;
    if (allowed && (!best.feasible || cost < best.cost || (cost == best.cost && tie < best.tie)))
      best = {true, cost, tie};
    int64_t k = 0;  // next assignment (base 3 counter)
    while (k < n && action[k] == 2) action[k++] = 0;
    if (k == n) break;
    ++action[k];
  }
  return best;
}

TEST(HybridPlanner, EqualsBruteForceOnItsModel) {
  int cases = 0, infeasible = 0, with_recompute = 0, with_offload = 0, coarse = 0;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    std::mt19937_64 rng(seed * 104729);
    SyntheticTraceOptions o;
    o.seed = seed;
    o.ops_per_layer = 1 + static_cast<int64_t>(rng() % 2);
    o.num_layers = 1 + static_cast<int64_t>(rng() % (7 / o.ops_per_layer));  // <= 8 candidates: 3^8 assignments
    o.skip_probability = (rng() % 2) ? 0.5 : 0.0;
    const bool big = seed % 2 == 0;
    o.min_bytes = big ? 1'000'000 : 1;
    o.max_bytes = big ? 9'000'000 : 200;
    const Trace t = make_synthetic_trace(o);
    const OffloadAnalysis a = analyze_offload(t);
    ASSERT_LE(a.candidates.size(), 8u);
    // Fast links make offload the cheaper action for small tensors, slow ones recompute.
    DeviceModel device = slow_link();
    if (seed % 3 == 0) device.d2h_bw_gbps = device.h2d_bw_gbps = 200.0;
    const std::vector<int64_t> rc = hybrid_recompute_costs(t, device, a);
    const int64_t least = least_budget_bytes(a), peak = t.peak_bytes();
    const std::vector<bool> nested = nested_subfamily(a);
    const std::vector<std::vector<bool>> families = {{}, nested, nested};
    for (double frac : {-0.05, 0.0, 0.3, 0.7, 1.0}) {
      const int64_t budget = least + static_cast<int64_t>(frac * static_cast<double>(peak - least));
      for (size_t fam = 0; fam < families.size(); ++fam) {
        for (double w : kHybridCopyWeights) {
          SCOPED_TRACE("seed " + std::to_string(seed) + " budget " + std::to_string(budget) + " family " +
                       std::to_string(fam) + " w " + std::to_string(w));
          const std::vector<int64_t> off = hybrid_offload_costs(t, device, a, w);
          const int64_t g = build_dp_model(a, budget, off, families[fam], fam == 2).granularity_bytes;
          coarse += g > 1;
          const BruteForce bf = brute_force(a, budget, g, off, rc, families[fam], fam == 2);
          const HybridSolution s = solve_hybrid(a, budget, off, rc, families[fam], fam == 2);
          ++cases;
          ASSERT_EQ(s.feasible, bf.feasible);
          if (!bf.feasible) {
            ++infeasible;
            continue;
          }
          EXPECT_EQ(s.cost, bf.cost);
          EXPECT_EQ(s.tie_break, bf.tie);
          // The returned actions have that cost and only recompute what can be.
          int64_t total = 0;
          for (size_t k = 0; k < a.candidates.size(); ++k) {
            if (s.action[k] == Action::kRecompute) {
              ASSERT_GE(rc[k], 0);
              total += rc[k];
              ++with_recompute;
            } else if (s.action[k] == Action::kOffload) {
              total += off[k];
              ++with_offload;
            }
          }
          EXPECT_EQ(total, bf.cost);
          // The decisions built from them fit the true modelled memory.
          const std::vector<TensorDecision> d = hybrid_decisions(t, a, s.action, budget);
          Plan p = keep_all_plan(a, budget);
          p.decisions = d;
          validate_plan(t, a, p);
          for (int64_t m : modelled_memory(a, d)) EXPECT_LE(m, budget);
        }
      }
    }
  }
  // The sweep saw both actions, coarse and exact granularity, and infeasible budgets.
  EXPECT_GT(with_recompute, 300);
  EXPECT_GT(with_offload, 100);
  EXPECT_GT(coarse, 100);
  EXPECT_GT(infeasible, 50);
  EXPECT_GT(cases - infeasible, 1000);
}

TEST(HybridPlanner, NeverSlowerThanAnyOtherPlannerAndWithinBudget) {
  int strictly_faster = 0, compared = 0;
  for (uint64_t seed = 1; seed <= 24; ++seed) {
    std::mt19937_64 rng(seed);
    SyntheticTraceOptions o;
    o.seed = seed;
    o.num_layers = 2 + static_cast<int64_t>(rng() % 12);
    o.ops_per_layer = 1 + static_cast<int64_t>(rng() % 3);
    o.skip_probability = (rng() % 3) * 0.25;
    const Trace t = make_synthetic_trace(o);
    const OffloadAnalysis a = analyze_offload(t);
    DeviceModel device = slow_link();
    if (seed % 2 == 0) device.d2h_bw_gbps = device.h2d_bw_gbps = 25.0;
    const int64_t least = least_budget_bytes(a), peak = t.peak_bytes();
    for (double frac : {0.0, 0.3, 0.6, 1.0}) {
      const int64_t budget = least + static_cast<int64_t>(frac * static_cast<double>(peak - least));
      SCOPED_TRACE("seed " + std::to_string(seed) + " budget " + std::to_string(budget));
      const Plan h = make_plan(t, device, budget, "hybrid");
      validate_plan(t, a, h);
      for (int64_t m : modelled_memory(a, h.decisions)) ASSERT_LE(m, budget);
      const SimResult hr = simulate(t, h, device);
      hr.check_invariants(t, h);
      EXPECT_LE(hr.peak_bytes, budget);
      EXPECT_FALSE(hr.over_budget);
      EXPECT_EQ(h.objective, hr.step_time_us);
      EXPECT_NEAR(hr.step_time_us, hr.compute_us + hr.recompute_us + hr.stall_us, 1e-6 * hr.step_time_us);
      double best_other = std::numeric_limits<double>::infinity();
      for (const auto& name : planner_names()) {
        if (name == "hybrid") continue;
        try {
          const double other = simulate(t, make_plan(t, device, budget, name), device).step_time_us;
          EXPECT_LE(hr.step_time_us, other) << name;
          best_other = std::min(best_other, other);
        } catch (const Error&) {
        }
      }
      ++compared;
      strictly_faster += hr.step_time_us < best_other * (1 - 1e-9);
    }
  }
  // Recompute pays off on these traces: hybrid beats every other planner in many cells.
  EXPECT_GT(strictly_faster, compared / 8);
}

TEST(HybridPlanner, RecomputesWhereCopiesCannotHide) {
  // A chain network on a slow link at the least budget: offload-only plans
  // stall for copies; replaying 50-500 us ops is cheaper.
  SyntheticTraceOptions o;
  o.num_layers = 12;
  o.ops_per_layer = 2;
  o.skip_probability = 0.0;
  o.seed = 5;
  const Trace t = make_synthetic_trace(o);
  const OffloadAnalysis a = analyze_offload(t);
  const int64_t least = least_budget_bytes(a);
  const int64_t budget = least + (t.peak_bytes() - least) / 10;
  const Plan h = make_plan(t, slow_link(), budget, "hybrid");
  const SimResult hr = simulate(t, h, slow_link());
  EXPECT_GT(h.num_recomputed(), 0);
  EXPECT_GT(hr.recompute_us, 0.0);
  for (const char* other : {"dp", "greedy", "offload_all_prefetch"}) {
    const SimResult r = simulate(t, make_plan(t, slow_link(), budget, other), slow_link());
    EXPECT_LT(hr.step_time_us, 0.9 * r.step_time_us) << other << " vs " << h.objective_name;
  }
  EXPECT_EQ(h.objective_name.rfind("hybrid:", 0), 0u) << h.objective_name;
}

TEST(HybridPlanner, BudgetBelowTheLeastIsAnErrorStatingIt) {
  SyntheticTraceOptions o;
  o.num_layers = 6;
  const Trace t = make_synthetic_trace(o);
  const int64_t least = least_budget_bytes(analyze_offload(t));
  try {
    make_plan(t, slow_link(), least - 1, "hybrid");
    FAIL() << "hybrid accepted an unreachable budget";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("at least " + std::to_string(least)), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(make_plan(t, slow_link(), least, "hybrid"));
}

}  // namespace
}  // namespace memsched
