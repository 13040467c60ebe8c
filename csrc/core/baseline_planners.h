// baseline_planners.h -- the fixed-policy planners memsched compares against:
// keep_all (plain PyTorch), offload_all_sync (torch's save_on_cpu),
// offload_all_prefetch (torchtune's OffloadActivations) and vdnn (vDNN).
// None of them looks at the budget to decide WHAT to offload; each checks that
// its plan fits and otherwise throws the least budget it can reach.
#pragma once

#include "core/planner.h"

namespace memsched {

class KeepAllPlanner final : public Planner {
 public:
  std::string name() const override { return "keep_all"; }
  std::string description() const override { return "plain PyTorch: every tensor stays on the device"; }
  Plan make_plan(const Trace& trace, const DeviceModel& device, int64_t budget_bytes) const override;
};

class OffloadAllSyncPlanner final : public Planner {
 public:
  std::string name() const override { return "offload_all_sync"; }
  std::string description() const override {
    return "save_on_cpu: every activation out after its producer and back on demand, on the compute stream";
  }
  Plan make_plan(const Trace& trace, const DeviceModel& device, int64_t budget_bytes) const override;
};

class OffloadAllPrefetchPlanner final : public Planner {
 public:
  std::string name() const override { return "offload_all_prefetch"; }
  std::string description() const override {
    return "torchtune OffloadActivations: every activation out on a side stream, prefetched one op ahead";
  }
  Plan make_plan(const Trace& trace, const DeviceModel& device, int64_t budget_bytes) const override;
};

class VdnnPlanner final : public Planner {
 public:
  std::string name() const override { return "vdnn"; }
  std::string description() const override {
    return "vDNN: offload inputs of conv/linear/matmul ops, prefetch one layer ahead";
  }
  Plan make_plan(const Trace& trace, const DeviceModel& device, int64_t budget_bytes) const override;
};

}  // namespace memsched
