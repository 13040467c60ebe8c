// greedy_planner.cpp -- Capuchin-style greedy offload selection (see greedy_planner.h).
#include "core/greedy_planner.h"

#include <algorithm>
#include <numeric>

#include "core/check.h"
#include "core/prefetch_placement.h"

namespace memsched {

std::vector<bool> greedy_offload_set(const Trace& trace, const DeviceModel& device, const OffloadAnalysis& analysis,
                                     int64_t budget_bytes) {
  const auto& cands = analysis.candidates;
  const auto n = static_cast<int64_t>(cands.size());
  const std::vector<double> start = stall_free_start_us(trace, device);

  std::vector<double> score(n);
  for (int64_t k = 0; k < n; ++k) {
    const auto& c = cands[k];
    const double idle_us = start[c.first_backward_use] - start[c.last_forward_use + 1];
    const double copy_us = d2h_time_us(device, c.bytes) + h2d_time_us(device, c.bytes);
    score[k] = idle_us / std::max(copy_us, 1e-9);
  }
  std::vector<int64_t> rank(n);
  std::iota(rank.begin(), rank.end(), 0);
  std::stable_sort(rank.begin(), rank.end(), [&](int64_t x, int64_t y) {
    if (score[x] != score[y]) return score[x] > score[y];
    return cands[x].bytes > cands[y].bytes;
  });

  // mem: modelled memory with the chosen tensors off the device during (last_forward_use, first_backward_use).
  std::vector<int64_t> mem = analysis.live_bytes;
  std::vector<bool> chosen(n, false);
  std::vector<int64_t> taken;
  int64_t over = 0;  // ops with mem > budget
  for (int64_t m : mem) over += m > budget_bytes;
  for (int64_t k : rank) {
    if (over == 0) break;
    const auto& c = cands[k];
    bool helps = false;
    for (int64_t i = c.last_forward_use + 1; i < c.first_backward_use && !helps; ++i) helps = mem[i] > budget_bytes;
    if (!helps) continue;
    chosen[k] = true;
    taken.push_back(k);
    for (int64_t i = c.last_forward_use + 1; i < c.first_backward_use; ++i) {
      const bool was_over = mem[i] > budget_bytes;
      mem[i] -= c.bytes;
      if (was_over && mem[i] <= budget_bytes) --over;
    }
  }
  MEMSCHED_CHECK(over == 0, "greedy: budget above the least budget but not met; internal error");
  // Drop offloads that are no longer needed, lowest rank first.
  for (auto it = taken.rbegin(); it != taken.rend(); ++it) {
    const auto& c = cands[*it];
    bool fits = true;
    for (int64_t i = c.last_forward_use + 1; i < c.first_backward_use && fits; ++i)
      fits = mem[i] + c.bytes <= budget_bytes;
    if (!fits) continue;
    chosen[*it] = false;
    for (int64_t i = c.last_forward_use + 1; i < c.first_backward_use; ++i) mem[i] += c.bytes;
  }
  return chosen;
}

Plan GreedyPlanner::make_plan(const Trace& trace, const DeviceModel& device, int64_t budget_bytes) const {
  const OffloadAnalysis analysis = analyze_offload(trace);
  const int64_t least = least_budget_bytes(analysis);
  if (budget_bytes < least) throw_budget_unreachable(name(), budget_bytes, least, least, "");
  const std::vector<bool> chosen = greedy_offload_set(trace, device, analysis, budget_bytes);
  const auto& cands = analysis.candidates;
  const auto n = static_cast<int64_t>(cands.size());
  std::vector<TensorDecision> d = offload_set_decisions(analysis, chosen);
  place_prefetch_latest_hiding(trace, device, analysis, d);
  const bool fits = fit_prefetches_to_budget(analysis, d, budget_bytes);
  MEMSCHED_CHECK(fits, "greedy: selected set does not fit the modelled memory; internal error");
  Plan p = keep_all_plan(analysis, budget_bytes);
  p.planner = name();
  p.decisions = std::move(d);
  for (int64_t k = 0; k < n; ++k)
    if (chosen[k]) p.objective += static_cast<double>(cands[k].bytes);
  return p;
}

}  // namespace memsched
