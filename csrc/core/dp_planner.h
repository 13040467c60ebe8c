// dp_planner.h -- the `dp` planner: the pseudo-polynomial dynamic program of
// source S1 (knapsack-like, memory capacity is the DP dimension), exact for
// the model below, followed by prefetch placement judged by the simulator.
//
// Entry points: DpModel / build_dp_model(), solve_dp(), DpPlanner.
//
// Note [DP planner model]
//   WHAT IT MINIMISES: sum over offloaded tensors of an integer cost per
//   tensor, lexicographically followed by the sum of the offloaded tensors'
//   positions in the order pi below (a tie-break: among equal-cost plans,
//   offload the tensors used last in backward -- the longest windows to hide
//   copies in). Six costs (DpCost), each solved exactly:
//     kBytes          bytes_t: the bytes offloaded (source S1's "least data
//                     moved"; each offloaded tensor moves out once, back once)
//     kCopyTime       round(1e6 * copy_us), copy_us = d2h_time_us +
//                     h2d_time_us: copy time in picoseconds, latency included
//                     (fewer, larger copies)
//     kExposedTime    round(1e6 * (copy_us + 4 * max(0, copy_us - idle_us))),
//                     idle_us = stall-free compute time between the tensor's
//                     last forward use and its first backward use: copy time,
//                     heavily penalised where even alone it cannot hide
//     kIdleRatio      round(1e6 * copy_us * copy_us / idle_us): copy time
//                     weighted by copy/idle -- Capuchin's ranking made exact
//     kWindowed       round(1e6 * copy_us * (1 + 4 * copy_us / idle_us))
//     kCopyPerIdle    round(1e6 * copy_us / idle_us): the share of its window
//                     a tensor's copies need (greedy's score, inverted)
//   (idle_us floored at 1e-3; each cost capped at 2^62 / n so sums cannot
//   overflow). All costs are integers, so the DP and brute
//   force agree exactly.
//   CONSTRAINTS (the model): every offloaded tensor's D2H copy follows its
//   producer and it is fetched on demand; the memory constraint is checked at
//   EVERY op i:  live_bytes[i] - sum_{offloaded t off the device during i}
//   g * floor(bytes_t / g) <= budget.
//   "Off the device during i" uses a nested (laminar) version of each
//   tensor's true off-device window (last_forward_use, first_backward_use):
//   order the candidates pi by first_backward_use descending (ties:
//   last_forward_use, then id), and let f'_k = max over the first k+1
//   candidates of last_forward_use. Candidate k counts as off the device
//   during ops i with f'_k < i < first_backward_use_k. Since f' is
//   non-decreasing and first_backward_use non-increasing along pi, the set
//   of candidates off the device during op i is a PREFIX of pi, of length
//   m_i; the constraint at op i becomes  sum_{k < m_i, k offloaded}
//   cov_k >= U_{m_i}  with cov_k = floor(bytes_k / g) and U_m = max over ops
//   i with m_i = m of ceil((live_bytes[i] - budget) / g).
//   WHY IT IS SOUND: f'_k >= last_forward_use and the unit rounding only
//   shrinks what is freed, so every model-feasible set also fits the true
//   modelled memory (plan.h) at every op, and hence the simulator's budget.
//   In a chain-like network (forward order == reverse backward order, no
//   skip connections) f' == last_forward_use: the model is then exact up to
//   the rounding. With skip connections it may keep a tensor on the device
//   for longer than needed (until every tensor needed later in backward has
//   finished its forward use).
//   THE DP: dp_k[c] = least (cost, tie) over subsets of the first k
//   candidates of pi whose capped coverage min(C, sum cov) equals c, states
//   violating U_k removed; C = max_m U_m. O(n * C) time, n * C bits memory.
//   GRANULARITY: g is the smallest power of two with
//   ceil(total candidate bytes / g) <= max(4096, 2^26 / items) (capped at
//   2^22 states), so C <= that bound; g == 1 (exact bytes) on small traces.
//   ITEMS: with n > 2048 candidates, runs of ceil(n / 2048) consecutive
//   candidates of pi become one item, offloaded together (its f' is the
//   run's largest, its first backward use the run's least: still nested and
//   sound). Below that every candidate is its own item and the DP is exact
//   for the model above; beyond, it is exact for the grouped model. Without
//   grouping, g would exceed typical tensor sizes on 100k-tensor traces and
//   floor(bytes / g) would free nothing.
//   THE PLANNER: for each of three candidate families (See Note [Nested
//   subfamily]) solves the DP for each cost; each solution is also pruned
//   against the exact windows (prune_with_exact_windows: offloads the true
//   modelled memory does not need are dropped, last in pi first; <= 2048
//   candidates). Offloaded tensors are copied out right after their
//   producer; prefetch points are placed by Capuchin's latest-hiding rule
//   with slack factors 1, 2 and 4 on the copy time, each pulled later where
//   the budget requires (prefetch_placement.h). Of these candidates (at most
//   6 costs x 2 sets x 3 placements) the simulator picks the one with the
//   least step time (ties: fewer bytes, then the order above). Greedy's
//   offload set (greedy_offload_set) is one more candidate, placed the same
//   way ("offloaded_bytes+greedy_set"): where windows are far from nested --
//   a caller's frame holding an activation (Note [Held by the caller] in
//   trace.h), several micro-batches (Note [Micro-batches] in plan.h) -- the
//   DP's proxies can miss a set greedy finds, and dp then stays never slower
//   than greedy in simulation.
//   Plan::objective is the chosen candidate's DP optimum and objective_name
//   its cost ("offloaded_bytes", "copy_time_ps", ...; "+pruned" when the
//   pruned set won, whose own cost is then at most that optimum).
//   LIMITATIONS: each cost is a separable proxy; what the copy streams'
//   contention does to step time only the simulator sees, so optimality is
//   for the stated model, not for simulated step time. Measured: on 332
//   random synthetic cells (H100 PCIe preset, budgets 35/50/70% of peak) dp
//   was never slower than the best heuristic (with five costs, without
//   kCopyPerIdle, it lost 3 cells to greedy by up to 3.7%); on the profiled
//   models of benchmarks/python/bench_planners.py it is never slower (the
//   benchmark asserts it).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/planner.h"

namespace memsched {

enum class DpCost { kBytes, kCopyTime, kExposedTime, kIdleRatio, kWindowed, kCopyPerIdle };
constexpr DpCost kDpCosts[] = {DpCost::kBytes, DpCost::kCopyTime, DpCost::kExposedTime, DpCost::kIdleRatio,
                               DpCost::kWindowed, DpCost::kCopyPerIdle};
const char* to_string(DpCost cost);  // "offloaded_bytes", "copy_time_ps", "exposed_time_ps", ...

// Per-candidate cost (OffloadAnalysis order) of Note [DP planner model].
std::vector<int64_t> dp_costs(const Trace& trace, const DeviceModel& device, const OffloadAnalysis& analysis,
                              DpCost cost);

struct DpModel {
  int64_t budget_bytes = 0;            // the budget the constraints use
  int64_t granularity_bytes = 1;       // g: the DP's capacity unit (a power of two)
  std::vector<int64_t> order;          // pi: candidate indices (into OffloadAnalysis::candidates)
  std::vector<int64_t> item_begin;     // item j = order[item_begin[j] .. item_begin[j+1]) (size items+1)
  // Per item j (a single candidate unless there are more than 2048):
  std::vector<int64_t> nested_last_forward_use;  // f'_j: max last_forward_use over items 0..j
  std::vector<int64_t> first_backward_use;       // least first_backward_use of its members
  std::vector<int64_t> cover_units;    // cov_j = floor(bytes_j / g)
  std::vector<int64_t> bytes;          // bytes of its members
  std::vector<int64_t> cost;           // cost of its members (>= 0)
  std::vector<int64_t> need_units;     // U_m for m = 0..items (prefix length); 0: no constraint
  int64_t capacity_units = 0;          // C = max(0, max_m U_m)
  int64_t least_budget_bytes = 0;      // least budget for which the model is feasible
  bool feasible = false;               // offloading every candidate meets every constraint
  std::vector<int64_t> forced;         // candidates always offloaded, exact windows (Note [Nested subfamily])
  int64_t forced_cost = 0;             // sum of their costs
  int64_t forced_bytes = 0;            // sum of their bytes
};

struct DpSolution {
  bool feasible = false;
  int64_t cost = 0;                    // primary objective: sum of costs of offloaded candidates
  int64_t tie_break = 0;               // secondary objective: sum of positions in pi
  int64_t offloaded_bytes = 0;         // sum of bytes of offloaded candidates
  std::vector<bool> offload;           // per candidate index (OffloadAnalysis order)
};

// Builds Note [DP planner model] for `budget_bytes` with per-candidate
// `cost` (OffloadAnalysis order; empty: cost = bytes). With `eligible`
// non-empty, only candidates k with eligible[k] enter pi; the others stay on
// the device, or -- with `force_ineligible` -- are always offloaded, off the
// device during their exact windows last_forward_use < i < first_backward_use
// (See Note [Nested subfamily]).
DpModel build_dp_model(const OffloadAnalysis& analysis, int64_t budget_bytes,
                       const std::vector<int64_t>& cost = {}, const std::vector<bool>& eligible = {},
                       bool force_ineligible = false);

// Note [Nested subfamily]
//   Rationale: one candidate whose window is not nested -- used at the end of
//   forward yet first needed at the very end of backward, e.g. the token
//   storage that both the embedding (input) and the loss (targets, a view of
//   the same storage) read -- raises f' for every candidate after it in pi and
//   can stop the model from freeing anything during forward.
//   Approach: the subfamily of candidates whose last_forward_use is
//   non-decreasing along pi with the most bytes (a weighted longest
//   non-decreasing subsequence, O(n log n) with a Fenwick tree of prefix
//   maxima). On it f' == last_forward_use: the nested model is exact there
//   (up to the rounding). The planner solves the DP over three families: all
//   candidates; the subfamily with the rest kept; the subfamily with the rest
//   always offloaded (exact windows). Offloading everything in the third is
//   the least-budget configuration, so dp reaches every budget any plan can
//   reach (up to the rounding). The simulator picks among the results.
//   Limitations: within a family the DP is exact for that family's model; the
//   best over the families is not a global optimum over all subsets.
std::vector<bool> nested_subfamily(const OffloadAnalysis& analysis);

// The dynamic program; exact (lexicographic min of (cost, tie_break)) for the model.
DpSolution solve_dp(const DpModel& model, size_t num_candidates);

// Drops offloaded candidates (last in pi first) that the true modelled memory
// (exact last_forward_use, on-demand prefetch) does not need under the budget.
// Identity beyond 2048 candidates.
std::vector<bool> prune_with_exact_windows(const OffloadAnalysis& analysis, const DpModel& model,
                                           const std::vector<bool>& offload, int64_t budget_bytes);

class DpPlanner final : public Planner {
 public:
  std::string name() const override { return "dp"; }
  std::string description() const override;
  Plan make_plan(const Trace& trace, const DeviceModel& device, int64_t budget_bytes) const override;
};

}  // namespace memsched
