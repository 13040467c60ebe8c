// test_dp_planner.cpp -- the dp planner's dynamic program equals brute force on
// its model (Note [DP planner model]) for many random traces and budgets, and
// its plans stay within the budget in the simulator.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <iterator>
#include <random>

#include "core/check.h"
#include "core/dp_planner.h"
#include "core/greedy_planner.h"
#include "core/plan.h"
#include "core/simulator.h"
#include "core/synthetic_trace.h"

namespace memsched {
namespace {

struct BruteForce {
  bool feasible = false;
  int64_t cost = 0;  // least total cost of the offloaded tensors
  int64_t tie = 0;   // then least sum of positions in pi
};

// Enumerates every subset of the candidates (Gray code order) and evaluates
// the model from its definition, op by op: candidate at position k of pi
// (first_backward_use descending, then last_forward_use, then id) frees
// g * floor(bytes / g) during ops i with f'_k < i < first_backward_use_k,
// f'_k = max last_forward_use over positions <= k; every op must satisfy
// live_bytes[i] - freed[i] <= budget. Cost: sum of cost[candidate] (the
// candidate's cost, OffloadAnalysis order). Written independently of the
// DP's prefix aggregation. With `eligible` non-empty only those candidates
// enter pi (Note [Nested subfamily]); the others stay on the device.
// With `force` the ineligible ones are always offloaded instead, off the
// device during last_forward_use < i < first_backward_use, at their cost.
BruteForce brute_force(const OffloadAnalysis& a, int64_t budget, int64_t g, const std::vector<int64_t>& cost,
                       const std::vector<bool>& eligible = {}, bool force = false) {
  const auto& c = a.candidates;
  std::vector<int64_t> pi;
  int64_t forced_cost = 0;
  std::vector<int64_t> live = a.live_bytes;
  for (int64_t k = 0; k < static_cast<int64_t>(c.size()); ++k) {
    if (eligible.empty() || eligible[k]) {
      pi.push_back(k);
    } else if (force) {
      forced_cost += cost[k];
      for (int64_t i = c[k].last_forward_use + 1; i < c[k].first_backward_use; ++i) live[i] -= c[k].bytes;
    }
  }
  const auto n = static_cast<int64_t>(pi.size());
  std::sort(pi.begin(), pi.end(), [&](int64_t x, int64_t y) {
    if (c[x].first_backward_use != c[y].first_backward_use) return c[x].first_backward_use > c[y].first_backward_use;
    if (c[x].last_forward_use != c[y].last_forward_use) return c[x].last_forward_use < c[y].last_forward_use;
    return c[x].tensor_id < c[y].tensor_id;
  });
  std::vector<int64_t> f_nested(n);
  int64_t run = -1;
  for (int64_t k = 0; k < n; ++k) f_nested[k] = run = std::max(run, c[pi[k]].last_forward_use);
  const auto n_ops = static_cast<int64_t>(a.live_bytes.size());
  std::vector<int64_t> freed(n_ops, 0);
  int64_t violated = 0;
  for (int64_t i = 0; i < n_ops; ++i) violated += live[i] > budget;
  BruteForce best;
  int64_t total = forced_cost, tie = 0;
  auto consider = [&] {
    if (violated != 0) return;
    if (!best.feasible || total < best.cost || (total == best.cost && tie < best.tie)) best = {true, total, tie};
  };
  consider();
  std::vector<bool> in(n, false);
  for (uint64_t step = 1; step < (uint64_t{1} << n); ++step) {
    const int k = __builtin_ctzll(step);  // Gray code: flip position k of pi
    in[k] = !in[k];
    const auto& t = c[pi[k]];
    const int64_t delta = (in[k] ? 1 : -1) * (t.bytes / g) * g;
    total += (in[k] ? 1 : -1) * cost[pi[k]];
    tie += (in[k] ? 1 : -1) * k;
    for (int64_t i = f_nested[k] + 1; i < t.first_backward_use; ++i) {
      const bool was = live[i] - freed[i] > budget;
      freed[i] += delta;
      const bool now = live[i] - freed[i] > budget;
      violated += static_cast<int64_t>(now) - static_cast<int64_t>(was);
    }
    consider();
  }
  return best;
}

DeviceModel test_device() {
  DeviceModel d;
  d.d2h_bw_gbps = 2.0;
  d.h2d_bw_gbps = 2.0;
  d.d2h_latency_us = 5;
  d.h2d_latency_us = 5;
  return d;
}

TEST(DpPlanner, EqualsBruteForceOnItsModel) {
  int cases = 0, infeasible = 0, coarse = 0;
  for (uint64_t seed = 1; seed <= 120; ++seed) {
    std::mt19937_64 rng(seed * 7919);
    SyntheticTraceOptions o;
    o.seed = seed;
    o.ops_per_layer = 1 + static_cast<int64_t>(rng() % 2);
    o.num_layers = 1 + static_cast<int64_t>(rng() % (15 / o.ops_per_layer));  // <= 16 offloadable
    o.skip_probability = (rng() % 2) ? 0.5 : 0.0;
    const bool big = seed % 2 == 0;  // big sizes push the granularity above 1 byte
    o.min_bytes = big ? 3'000'000 : 1;
    o.max_bytes = big ? 90'000'000 : 200;
    const Trace t = make_synthetic_trace(o);
    const OffloadAnalysis a = analyze_offload(t);
    ASSERT_LE(a.candidates.size(), 16u);
    const int64_t least = least_budget_bytes(a), peak = t.peak_bytes();
    // Both candidate families the planner solves (Note [Nested subfamily]).
    const std::vector<bool> nested = nested_subfamily(a);
    const std::vector<std::vector<bool>> families = {{}, nested, nested};  // the third forces the rest
    for (double frac : {-0.05, 0.0, 0.2, 0.5, 0.8, 1.0}) {
      const int64_t budget = least + static_cast<int64_t>(frac * static_cast<double>(peak - least));
      SCOPED_TRACE("seed " + std::to_string(seed) + " budget " + std::to_string(budget));
      // optimum[family][cost kind]: brute force's least cost, -1 if infeasible.
      std::vector<std::vector<int64_t>> optimum(families.size(), std::vector<int64_t>(std::size(kDpCosts), -1));
      for (size_t fam = 0; fam < families.size(); ++fam) {
        SCOPED_TRACE(fam == 0 ? "all candidates" : fam == 1 ? "nested subfamily" : "nested, rest forced");
        const bool force = fam == 2;
        for (DpCost kind : kDpCosts) {
          SCOPED_TRACE(to_string(kind));
          const std::vector<int64_t> cost = dp_costs(t, test_device(), a, kind);
          const DpModel m = build_dp_model(a, budget, cost, families[fam], force);
          const BruteForce bf = brute_force(a, budget, m.granularity_bytes, cost, families[fam], force);
          ++cases;
          coarse += m.granularity_bytes > 1;
          ASSERT_EQ(m.feasible, bf.feasible);
          ASSERT_EQ(m.feasible, budget >= m.least_budget_bytes);
          if (!bf.feasible) {
            ++infeasible;
            continue;
          }
          const DpSolution s = solve_dp(m, a.candidates.size());
          ASSERT_TRUE(s.feasible);
          EXPECT_EQ(s.cost, bf.cost);
          EXPECT_EQ(s.tie_break, bf.tie);
          optimum[fam][static_cast<int>(kind)] = bf.cost;
          // The returned set really has that cost, offloads only eligible
          // candidates and fits the true modelled memory.
          std::vector<TensorDecision> d;
          int64_t total = 0, bytes = 0;
          for (size_t k = 0; k < a.candidates.size(); ++k) {
            const auto& c = a.candidates[k];
            if (!families[fam].empty() && !families[fam][k]) EXPECT_EQ(s.offload[k], force);
            d.push_back(s.offload[k] ? TensorDecision{c.tensor_id, true, c.earliest_offload_op, c.first_backward_use}
                                     : TensorDecision{c.tensor_id, false, -1, -1});
            total += s.offload[k] ? cost[k] : 0;
            bytes += s.offload[k] ? c.bytes : 0;
          }
          EXPECT_EQ(total, bf.cost);
          EXPECT_EQ(bytes, s.offloaded_bytes);
          for (int64_t mem : modelled_memory(a, d)) EXPECT_LE(mem, budget);
        }
      }
      if (budget < least_budget_bytes(a)) {
        EXPECT_THROW(DpPlanner().make_plan(t, test_device(), budget), Error);
        continue;
      }
      // The planner returns one of the DP optima or greedy's set (Note [DP planner model], THE
      // PLANNER), within the budget in simulation.
      const Plan p = DpPlanner().make_plan(t, test_device(), budget);
      if (p.objective_name == "offloaded_bytes+greedy_set") {
        const std::vector<bool> greedy = greedy_offload_set(t, test_device(), a, budget);
        for (size_t k = 0; k < a.candidates.size(); ++k) EXPECT_EQ(p.decisions[k].offload, greedy[k]);
        const SimResult r = simulate(t, p, test_device());
        EXPECT_LE(r.peak_bytes, budget);
        EXPECT_FALSE(r.over_budget);
        continue;
      }
      ASSERT_FALSE(optimum[0][0] < 0 && optimum[1][0] < 0 && optimum[2][0] < 0) << p.objective_name;
      int kind = -1;
      for (DpCost k : kDpCosts)
        if (p.objective_name.rfind(to_string(k), 0) == 0) kind = static_cast<int>(k);
      ASSERT_GE(kind, 0) << p.objective_name;
      const size_t fam = p.objective_name.find("+nested_forced") != std::string::npos ? 2
                         : p.objective_name.find("+nested") != std::string::npos ? 1 : 0;
      EXPECT_EQ(p.objective, static_cast<double>(optimum[fam][kind])) << p.objective_name;
      const SimResult r = simulate(t, p, test_device());
      r.check_invariants(t, p);
      EXPECT_LE(r.peak_bytes, budget);
      EXPECT_FALSE(r.over_budget);
    }
  }
  // The sweep covered both exact and coarse granularity and both outcomes.
  EXPECT_GT(coarse, 250);
  EXPECT_GT(infeasible, 50);
  EXPECT_GT(cases - infeasible, 4500);
}

TEST(DpPlanner, NestedSubfamilyIsTheHeaviestNestedSet) {
  // Brute force over subsets: the heaviest set whose last_forward_use is
  // non-decreasing along pi.
  int proper_subsets = 0;  // cases where some candidate had to be left out
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    SyntheticTraceOptions o;
    o.seed = seed;
    o.num_layers = 2 + static_cast<int64_t>(seed % 6);
    o.skip_probability = 0.6;
    o.min_bytes = 1;
    o.max_bytes = 1000;
    const OffloadAnalysis a = analyze_offload(make_synthetic_trace(o));
    const auto& c = a.candidates;
    const auto n = static_cast<int64_t>(c.size());
    ASSERT_LE(n, 16);
    std::vector<int64_t> pi(n);
    std::iota(pi.begin(), pi.end(), 0);
    std::sort(pi.begin(), pi.end(), [&](int64_t x, int64_t y) {
      if (c[x].first_backward_use != c[y].first_backward_use) return c[x].first_backward_use > c[y].first_backward_use;
      if (c[x].last_forward_use != c[y].last_forward_use) return c[x].last_forward_use < c[y].last_forward_use;
      return c[x].tensor_id < c[y].tensor_id;
    });
    int64_t best = 0;
    for (uint64_t mask = 0; mask < (uint64_t{1} << n); ++mask) {
      int64_t run = -1, bytes = 0;
      bool nested = true;
      for (int64_t k = 0; k < n && nested; ++k) {
        if (!(mask >> k & 1)) continue;
        nested = c[pi[k]].last_forward_use >= run;
        run = c[pi[k]].last_forward_use;
        bytes += c[pi[k]].bytes;
      }
      if (nested) best = std::max(best, bytes);
    }
    const std::vector<bool> chosen = nested_subfamily(a);
    int64_t run = -1, bytes = 0;
    for (int64_t k = 0; k < n; ++k) {
      if (!chosen[pi[k]]) continue;
      EXPECT_GE(c[pi[k]].last_forward_use, run) << "seed " << seed;
      run = c[pi[k]].last_forward_use;
      bytes += c[pi[k]].bytes;
    }
    EXPECT_EQ(bytes, best) << "seed " << seed;
    proper_subsets += std::find(chosen.begin(), chosen.end(), false) != chosen.end();
  }
  EXPECT_GT(proper_subsets, 10);
}

TEST(DpPlanner, ChainNetworkModelIsExact) {
  // Without skip connections forward order mirrors backward order, so the
  // nested model's least budget is the least budget any plan can reach.
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    SyntheticTraceOptions o;
    o.seed = seed;
    o.num_layers = 6;
    o.skip_probability = 0.0;
    o.min_bytes = 1;
    o.max_bytes = 1000;
    const OffloadAnalysis a = analyze_offload(make_synthetic_trace(o));
    EXPECT_EQ(build_dp_model(a, 0).least_budget_bytes, least_budget_bytes(a));
  }
}

TEST(DpPlanner, GranularityIsStatedAndBounded) {
  SyntheticTraceOptions o;
  o.num_layers = 500;
  o.min_bytes = 1 << 20;
  o.max_bytes = 64 << 20;
  const Trace t = make_synthetic_trace(o);
  const OffloadAnalysis a = analyze_offload(t);
  const DpModel m = build_dp_model(a, least_budget_bytes(a) * 2);
  int64_t total = 0;
  for (const auto& c : a.candidates) total += c.bytes;
  const int64_t g = m.granularity_bytes;
  EXPECT_EQ(g & (g - 1), 0);  // a power of two
  const int64_t states = (total + g - 1) / g;
  const int64_t n = static_cast<int64_t>(a.candidates.size());
  EXPECT_LE(states, std::max<int64_t>(4096, (int64_t{1} << 26) / n));
  EXPECT_GT((total + g / 2 - 1) / (g / 2), std::max<int64_t>(4096, (int64_t{1} << 26) / n));  // the smallest such
}

}  // namespace
}  // namespace memsched

namespace memsched {
namespace {

TEST(DpPlanner, ReachesEveryBudgetAnyPlanReaches) {
  // With skip connections the plain nested model can need more than the least
  // budget; the "nested, rest forced" family (Note [Nested subfamily]) reaches
  // it exactly at 1-byte granularity.
  int needed_forcing = 0;
  for (uint64_t seed = 1; seed <= 200; ++seed) {
    SyntheticTraceOptions o;
    o.seed = seed;
    o.num_layers = 8;
    o.skip_probability = 0.7;
    o.min_bytes = 1;
    o.max_bytes = 500;
    const Trace t = make_synthetic_trace(o);
    const OffloadAnalysis a = analyze_offload(t);
    const int64_t least = least_budget_bytes(a);
    needed_forcing += build_dp_model(a, least).least_budget_bytes > least;
    const Plan p = DpPlanner().make_plan(t, test_device(), least);
    const SimResult r = simulate(t, p, test_device());
    EXPECT_LE(r.peak_bytes, least) << "seed " << seed;
    EXPECT_THROW(DpPlanner().make_plan(t, test_device(), least - 1), Error) << "seed " << seed;
  }
  EXPECT_GT(needed_forcing, 4);  // the sweep exercised the non-nested case
}

}  // namespace
}  // namespace memsched
