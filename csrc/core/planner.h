// planner.h -- the one interface every offload planner implements, and the
// registry that finds planners by name.
//
// Entry points: Planner, planner_names(), create_planner(), make_plan().
//
// Registered planners (name: idea):
//   keep_all              plain PyTorch: nothing leaves the device.
//   offload_all_sync      torch's save_on_cpu: every activation out and back
//                         on the compute stream (copies block compute).
//   offload_all_prefetch  torchtune's OffloadActivations: every activation out
//                         on a side stream, prefetched one op ahead.
//   vdnn                  vDNN: offload the inputs of conv/linear/matmul ops,
//                         prefetch one layer (module) ahead.
//   greedy                Capuchin-style: rank by idle time per copy time,
//                         offload until the budget holds, prefetch as late as
//                         still hides the copy.
//   dp                    the pseudo-polynomial dynamic program of source S1
//                         (See Note [DP planner model] in dp_planner.h).
//   hybrid                keep, offload or recompute per activation: an exact
//                         DP over the three actions plus every planner above,
//                         the simulator picks (See Note [Hybrid planner]).
// Every planner returns a plan whose modelled memory (plan.h) fits the budget
// at every op, or throws memsched::Error stating the least budget it can reach.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/device_model.h"
#include "core/plan.h"
#include "core/trace.h"

namespace memsched {

class Planner {
 public:
  virtual ~Planner() = default;
  virtual std::string name() const = 0;
  virtual std::string description() const = 0;
  // Throws memsched::Error when `budget_bytes` is below the least budget this
  // planner can reach on `trace`; the message states that least budget.
  virtual Plan make_plan(const Trace& trace, const DeviceModel& device, int64_t budget_bytes) const = 0;
};

std::vector<std::string> planner_names();  // registry order (the table order of the CLI)
std::unique_ptr<Planner> create_planner(const std::string& name);  // throws listing the names on a typo
Plan make_plan(const Trace& trace, const DeviceModel& device, int64_t budget_bytes, const std::string& planner);

// The error planners throw for an unreachable budget: names the planner, the
// budget, the least budget the planner can reach and (when larger than what
// any plan can reach) the global least, with what to do.
[[noreturn]] void throw_budget_unreachable(const std::string& planner, int64_t budget_bytes,
                                           int64_t planner_least_bytes, int64_t global_least_bytes,
                                           const std::string& why);

}  // namespace memsched
