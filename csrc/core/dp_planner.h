// dp_planner.h -- the `dp` planner: the pseudo-polynomial dynamic program of
// source S1 (knapsack-like, memory capacity is the DP dimension), exact for
// the model below, followed by prefetch placement judged by the simulator.
//
// Entry points: DpModel / build_dp_model(), solve_dp(), DpPlanner.
//
// Note [DP planner model]
//   WHAT IT MINIMISES: the bytes offloaded, sum over offloaded tensors of
//   bytes (each of them moves out once and back once), lexicographically
//   followed by the sum of the offloaded tensors' positions in the order pi
//   below (a tie-break: among plans moving equally many bytes, offload the
//   tensors used last in backward -- the longest windows to hide copies in).
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
//   THE DP: dp_k[c] = least (bytes, tie) cost over subsets of the first k
//   candidates of pi whose capped coverage min(C, sum cov) equals c, states
//   violating U_k removed; C = max_m U_m. O(n * C) time, n * C bits memory.
//   GRANULARITY: g is the smallest power of two with
//   ceil(total candidate bytes / g) <= max(4096, 2^27 / n) (capped at 2^22
//   states), so C <= that bound; g == 1 (exact bytes) on small traces.
//   AFTER THE DP: offloaded tensors are copied out right after their producer;
//   prefetch points are placed by Capuchin's latest-hiding rule with slack
//   factors 1, 2 and 4 on the copy time, each pulled later where the budget
//   requires (prefetch_placement.h); the candidate with the least simulated
//   step time is returned (ties: the first). The plan's objective is the DP
//   objective (bytes offloaded).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/planner.h"

namespace memsched {

struct DpModel {
  int64_t budget_bytes = 0;            // the budget the constraints use
  int64_t granularity_bytes = 1;       // g: the DP's capacity unit (a power of two)
  std::vector<int64_t> order;          // pi: candidate indices (into OffloadAnalysis::candidates)
  std::vector<int64_t> nested_last_forward_use;  // f'_k along pi
  std::vector<int64_t> cover_units;    // cov_k = floor(bytes / g) along pi
  std::vector<int64_t> bytes;          // bytes along pi (the cost)
  std::vector<int64_t> need_units;     // U_m for m = 0..n (prefix length); <= 0: no constraint
  int64_t capacity_units = 0;          // C = max(0, max_m U_m)
  int64_t least_budget_bytes = 0;      // least budget for which the model is feasible
  bool feasible = false;               // offloading every candidate meets every constraint
};

struct DpSolution {
  bool feasible = false;
  int64_t offloaded_bytes = 0;         // primary objective
  int64_t tie_break = 0;               // secondary objective: sum of positions in pi
  std::vector<bool> offload;           // per candidate index (OffloadAnalysis order)
};

// Builds Note [DP planner model] for `budget_bytes`.
DpModel build_dp_model(const OffloadAnalysis& analysis, int64_t budget_bytes);

// The dynamic program; exact (lexicographic min of (offloaded_bytes,
// tie_break)) for the model.
DpSolution solve_dp(const DpModel& model, size_t num_candidates);

class DpPlanner final : public Planner {
 public:
  std::string name() const override { return "dp"; }
  std::string description() const override;
  Plan make_plan(const Trace& trace, const DeviceModel& device, int64_t budget_bytes) const override;
};

}  // namespace memsched
