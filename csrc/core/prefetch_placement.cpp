// prefetch_placement.cpp -- offload/prefetch points and fitting them to the budget (see prefetch_placement.h).
#include "core/prefetch_placement.h"

#include <algorithm>
#include <numeric>

#include "core/check.h"

namespace memsched {

std::vector<double> stall_free_start_us(const Trace& trace, const DeviceModel& device) {
  std::vector<double> t(trace.ops.size() + 1, 0.0);
  for (size_t i = 0; i < trace.ops.size(); ++i) t[i + 1] = t[i] + op_time_us(device, trace.ops[i]);
  return t;
}

std::vector<TensorDecision> offload_set_decisions(const OffloadAnalysis& analysis, const std::vector<bool>& offload) {
  MEMSCHED_CHECK(offload.size() == analysis.candidates.size(), "offload_set_decisions: size mismatch");
  std::vector<TensorDecision> d;
  d.reserve(offload.size());
  for (size_t k = 0; k < offload.size(); ++k) {
    const auto& c = analysis.candidates[k];
    if (offload[k]) d.push_back({c.tensor_id, true, c.earliest_offload_op, c.first_backward_use});
    else d.push_back({c.tensor_id, false, -1, -1});
  }
  return d;
}

namespace {
// Offloaded candidate indices in H2D order: first backward use, then tensor id.
std::vector<int64_t> offloaded_by_first_use(const OffloadAnalysis& analysis, const std::vector<TensorDecision>& d) {
  std::vector<int64_t> order;
  for (size_t k = 0; k < d.size(); ++k)
    if (d[k].offload) order.push_back(static_cast<int64_t>(k));
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return analysis.candidates[x].first_backward_use < analysis.candidates[y].first_backward_use;
  });
  return order;
}
}  // namespace

void place_prefetch_latest_hiding(const Trace& trace, const DeviceModel& device, const OffloadAnalysis& analysis,
                                  std::vector<TensorDecision>& decisions) {
  const std::vector<double> start = stall_free_start_us(trace, device);
  const std::vector<int64_t> order = offloaded_by_first_use(analysis, decisions);
  double next_copy_start = start.back();
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const auto& c = analysis.candidates[*it];
    const int64_t beta = c.backward_start;  // Note [Micro-batches] in plan.h
    const double latest_end = std::min(start[c.first_backward_use], next_copy_start);
    const double latest_start = latest_end - h2d_time_us(device, c.bytes);
    next_copy_start = latest_start;
    // Largest op j in [beta, first_backward_use] with start[j] <= latest_start.
    auto first = start.begin() + beta, last = start.begin() + c.first_backward_use + 1;
    auto ub = std::upper_bound(first, last, latest_start);
    const int64_t j = ub == first ? beta : static_cast<int64_t>(ub - start.begin()) - 1;
    decisions[*it].prefetch_at_op = j;
  }
}

void place_prefetch_ops_ahead(const OffloadAnalysis& analysis, std::vector<TensorDecision>& decisions,
                              int64_t ops_ahead) {
  for (size_t k = 0; k < decisions.size(); ++k) {
    if (!decisions[k].offload) continue;
    decisions[k].prefetch_at_op =
        std::max(analysis.candidates[k].backward_start, analysis.candidates[k].first_backward_use - ops_ahead);
  }
}

void place_prefetch_layer_ahead(const Trace& trace, const OffloadAnalysis& analysis,
                                std::vector<TensorDecision>& decisions) {
  const auto n = static_cast<int64_t>(trace.ops.size());
  const int64_t beta = analysis.first_backward_op;
  // layer_start[i]: first op of the run of ops sharing op i's module_path.
  std::vector<int64_t> layer_start(n, 0);
  for (int64_t i = beta; i < n; ++i)
    layer_start[i] = (i > beta && trace.ops[i].module_path == trace.ops[i - 1].module_path) ? layer_start[i - 1] : i;
  for (size_t k = 0; k < decisions.size(); ++k) {
    if (!decisions[k].offload) continue;
    const int64_t b = analysis.candidates[k].first_backward_use;
    const int64_t own_beta = analysis.candidates[k].backward_start;  // Note [Micro-batches] in plan.h
    int64_t p;
    if (trace.ops[b].module_path.empty()) {
      p = b - 1;
    } else {
      const int64_t own = layer_start[b];
      p = own > own_beta ? layer_start[own - 1] : own_beta;
    }
    decisions[k].prefetch_at_op = std::max(own_beta, p);
  }
}

bool fit_prefetches_to_budget(const OffloadAnalysis& analysis, std::vector<TensorDecision>& decisions,
                              int64_t budget_bytes) {
  std::vector<TensorDecision> fitted = decisions;
  for (auto& d : fitted)
    if (d.offload) d.prefetch_at_op = analysis.candidates[&d - fitted.data()].first_backward_use;
  std::vector<int64_t> mem = modelled_memory(analysis, fitted);
  for (int64_t m : mem)
    if (m > budget_bytes) return false;
  for (int64_t k : offloaded_by_first_use(analysis, decisions)) {
    const auto& c = analysis.candidates[k];
    const int64_t wanted = decisions[k].prefetch_at_op;
    int64_t j = c.first_backward_use;
    while (j - 1 >= wanted && mem[j - 1] + c.bytes <= budget_bytes) --j;
    for (int64_t i = j; i < c.first_backward_use; ++i) mem[i] += c.bytes;
    fitted[k].prefetch_at_op = j;
  }
  decisions = std::move(fitted);
  return true;
}

}  // namespace memsched
