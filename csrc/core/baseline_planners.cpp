// baseline_planners.cpp -- keep_all, offload_all_sync, offload_all_prefetch, vdnn (see baseline_planners.h).
#include "core/baseline_planners.h"

#include <algorithm>
#include <cctype>

#include "core/check.h"
#include "core/prefetch_placement.h"

namespace memsched {

namespace {

int64_t max_of(const std::vector<int64_t>& v) {
  int64_t m = 0;
  for (int64_t x : v) m = std::max(m, x);
  return m;
}

// Finishes a fixed-policy plan: fit prefetches, or throw the least budget the
// offload set can reach (its modelled peak with on-demand prefetch).
Plan finish(const Planner& planner, const OffloadAnalysis& analysis, std::vector<TensorDecision> d,
            int64_t budget_bytes, const std::string& why) {
  if (!fit_prefetches_to_budget(analysis, d, budget_bytes)) {
    std::vector<TensorDecision> on_demand = d;
    for (size_t k = 0; k < on_demand.size(); ++k)
      if (on_demand[k].offload) on_demand[k].prefetch_at_op = analysis.candidates[k].first_backward_use;
    throw_budget_unreachable(planner.name(), budget_bytes, max_of(modelled_memory(analysis, on_demand)),
                             least_budget_bytes(analysis), why);
  }
  Plan p = keep_all_plan(analysis, budget_bytes);
  p.planner = planner.name();
  p.decisions = std::move(d);
  for (size_t k = 0; k < p.decisions.size(); ++k)
    if (p.decisions[k].offload) p.objective += static_cast<double>(analysis.candidates[k].bytes);
  return p;
}

std::vector<TensorDecision> offload_all(const OffloadAnalysis& analysis) {
  return offload_set_decisions(analysis, std::vector<bool>(analysis.candidates.size(), true));
}

bool is_conv_or_linear(const std::string& op_name) {
  std::string s = op_name;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return s.find("conv") != std::string::npos || s.find("linear") != std::string::npos ||
         s.find("mm") != std::string::npos || s.find("matmul") != std::string::npos;
}

}  // namespace

Plan KeepAllPlanner::make_plan(const Trace& trace, const DeviceModel&, int64_t budget_bytes) const {
  const OffloadAnalysis analysis = analyze_offload(trace);
  return finish(*this, analysis, keep_all_plan(analysis, budget_bytes).decisions, budget_bytes,
                "keep_all keeps every tensor on the device, so it needs the trace's peak");
}

Plan OffloadAllSyncPlanner::make_plan(const Trace& trace, const DeviceModel&, int64_t budget_bytes) const {
  const OffloadAnalysis analysis = analyze_offload(trace);
  std::vector<TensorDecision> d = offload_all(analysis);  // on demand: save_on_cpu unpacks at first use
  Plan p = finish(*this, analysis, d, budget_bytes, "it already offloads every activation");
  p.decisions = std::move(d);  // keep the on-demand points (the fitter never moves them earlier anyway)
  p.copies_on_compute_stream = true;
  return p;
}

Plan OffloadAllPrefetchPlanner::make_plan(const Trace& trace, const DeviceModel&, int64_t budget_bytes) const {
  const OffloadAnalysis analysis = analyze_offload(trace);
  std::vector<TensorDecision> d = offload_all(analysis);
  place_prefetch_ops_ahead(analysis, d, 1);
  return finish(*this, analysis, std::move(d), budget_bytes, "it already offloads every activation");
}

Plan VdnnPlanner::make_plan(const Trace& trace, const DeviceModel&, int64_t budget_bytes) const {
  const OffloadAnalysis analysis = analyze_offload(trace);
  std::vector<bool> chosen(analysis.candidates.size(), false);
  for (size_t k = 0; k < chosen.size(); ++k) {
    const auto& t = trace.tensors[analysis.candidates[k].tensor_id];
    for (int64_t u : t.uses) {
      if (u >= analysis.candidates[k].backward_start) break;
      if (is_conv_or_linear(trace.ops[u].name)) chosen[k] = true;
    }
  }
  std::vector<TensorDecision> d = offload_set_decisions(analysis, chosen);
  place_prefetch_layer_ahead(trace, analysis, d);
  return finish(*this, analysis, std::move(d), budget_bytes,
                "vdnn offloads only the inputs of conv/linear/matmul ops");
}

}  // namespace memsched
