// greedy_planner.h -- a Capuchin-style greedy planner: rank the offloadable
// tensors by idle time (stall-free time between the end of their last forward
// use and the start of their first backward use) per copy time (out + back),
// offload in that order every tensor that frees memory at an op still over the
// budget until the modelled memory fits at every op, drop offloads that turn
// out unnecessary (lowest rank first), then prefetch as late as still hides
// the copy (pulled later where the budget requires).
#pragma once

#include <cstdint>
#include <vector>

#include "core/planner.h"

namespace memsched {

// The tensors greedy offloads (OffloadAnalysis order) for `budget_bytes`; the caller checks that the
// budget is at least least_budget_bytes(analysis). dp tries this set among its own (Note [DP planner model]).
std::vector<bool> greedy_offload_set(const Trace& trace, const DeviceModel& device, const OffloadAnalysis& analysis,
                                     int64_t budget_bytes);

class GreedyPlanner final : public Planner {
 public:
  std::string name() const override { return "greedy"; }
  std::string description() const override {
    return "Capuchin-style: rank by idle time per copy time, offload until the budget holds, latest-hiding prefetch";
  }
  Plan make_plan(const Trace& trace, const DeviceModel& device, int64_t budget_bytes) const override;
};

}  // namespace memsched
