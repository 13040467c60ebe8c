// prefetch_placement.h -- where offload and prefetch points go once a planner
// has chosen which tensors leave the device, and how prefetches are pulled
// back (toward the first backward use) until the modelled memory fits.
//
// Entry points: stall_free_start_us(), set_offload_asap(),
// place_prefetch_latest_hiding(), place_prefetch_ops_ahead(),
// place_prefetch_layer_ahead(), fit_prefetches_to_budget().
#pragma once

#include <cstdint>
#include <vector>

#include "core/device_model.h"
#include "core/plan.h"
#include "core/trace.h"

namespace memsched {

// Start time of each op (and, at index ops.size(), the step end) when no op
// ever stalls: prefix sums of op_time_us().
std::vector<double> stall_free_start_us(const Trace& trace, const DeviceModel& device);

// Marks candidate k offloaded (for each k with offload[k]) with its D2H copy
// right after its producer (earliest_offload_op) and prefetch on demand
// (first_backward_use); the others kept.
std::vector<TensorDecision> offload_set_decisions(const OffloadAnalysis& analysis, const std::vector<bool>& offload);

// Capuchin's rule: walking the offloaded tensors in H2D FIFO order from the
// last-needed back, each copy must end by its first use's stall-free start
// and before the next copy starts; prefetch at the latest op whose stall-free
// start is no later than that copy's latest start.
void place_prefetch_latest_hiding(const Trace& trace, const DeviceModel& device, const OffloadAnalysis& analysis,
                                  std::vector<TensorDecision>& decisions);

// Prefetch `ops_ahead` ops before the first backward use (not before the first backward op).
void place_prefetch_ops_ahead(const OffloadAnalysis& analysis, std::vector<TensorDecision>& decisions,
                              int64_t ops_ahead);

// Prefetch at the first op of the backward layer before the one that uses the
// tensor first (a layer = a maximal run of backward ops with one module_path);
// one op ahead where the use has no module_path.
void place_prefetch_layer_ahead(const Trace& trace, const OffloadAnalysis& analysis,
                                std::vector<TensorDecision>& decisions);

// Moves prefetch points later (never earlier than placed) until
// modelled_memory() <= budget at every op: tensors in order of first backward
// use take the earliest op at or after their placed prefetch from which the
// budget has room up to the use. Returns false (decisions untouched) when
// even on-demand prefetch does not fit.
bool fit_prefetches_to_budget(const OffloadAnalysis& analysis, std::vector<TensorDecision>& decisions,
                              int64_t budget_bytes);

}  // namespace memsched
