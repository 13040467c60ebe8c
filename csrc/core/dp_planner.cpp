// dp_planner.cpp -- the S1 dynamic program (See Note [DP planner model] in dp_planner.h).
#include "core/dp_planner.h"

#include <cmath>
#include <algorithm>
#include <limits>
#include <numeric>

#include "core/check.h"
#include "core/greedy_planner.h"
#include "core/prefetch_placement.h"
#include "core/simulator.h"

namespace memsched {

namespace {

constexpr int64_t kDpCells = int64_t{1} << 26;     // n * C the DP may use
constexpr int64_t kMinStates = 4096;
constexpr int64_t kMaxItems = 2048;                 // candidates are grouped beyond this
constexpr int64_t kMaxStates = int64_t{1} << 22;

int64_t ceil_div(int64_t a, int64_t b) { return a >= 0 ? (a + b - 1) / b : -((-a) / b); }

struct Cost {
  int64_t bytes = std::numeric_limits<int64_t>::max();
  int64_t tie = std::numeric_limits<int64_t>::max();
  bool finite() const { return bytes != std::numeric_limits<int64_t>::max(); }
  bool operator<(const Cost& o) const { return bytes != o.bytes ? bytes < o.bytes : tie < o.tie; }
};

}  // namespace

const char* to_string(DpCost cost) {
  switch (cost) {
    case DpCost::kBytes: return "offloaded_bytes";
    case DpCost::kCopyTime: return "copy_time_ps";
    case DpCost::kExposedTime: return "exposed_time_ps";
    case DpCost::kIdleRatio: return "idle_weighted_ps";
    case DpCost::kWindowed: return "windowed_ps";
    case DpCost::kCopyPerIdle: return "copy_per_idle_ppm";
  }
  return "?";
}

std::vector<int64_t> dp_costs(const Trace& trace, const DeviceModel& device, const OffloadAnalysis& analysis,
                              DpCost cost) {
  std::vector<int64_t> out;
  out.reserve(analysis.candidates.size());
  const std::vector<double> start = stall_free_start_us(trace, device);
  // Costs are capped so that any sum of them fits in an int64.
  const double cap = static_cast<double>((int64_t{1} << 62) / std::max<int64_t>(1, analysis.candidates.size()));
  auto ps = [cap](double us) { return std::llround(std::min(us * 1e6, cap)); };
  for (const auto& c : analysis.candidates) {
    const double copy_us = d2h_time_us(device, c.bytes) + h2d_time_us(device, c.bytes);
    const double idle_us = start[c.first_backward_use] - start[c.last_forward_use + 1];
    switch (cost) {
      case DpCost::kBytes: out.push_back(c.bytes); break;
      case DpCost::kCopyTime: out.push_back(ps(copy_us)); break;
      case DpCost::kIdleRatio: out.push_back(ps(copy_us * copy_us / std::max(idle_us, 1e-3))); break;
      case DpCost::kWindowed: out.push_back(ps(copy_us * (1.0 + 4.0 * copy_us / std::max(idle_us, 1e-3)))); break;
      case DpCost::kCopyPerIdle: out.push_back(ps(copy_us / std::max(idle_us, 1e-3))); break;
      case DpCost::kExposedTime:
        out.push_back(ps(copy_us + 4.0 * std::max(0.0, copy_us - idle_us)));
        break;
    }
  }
  return out;
}

namespace {

// pi: candidate indices by first_backward_use descending, then
// last_forward_use ascending, then tensor id (See Note [DP planner model]).
std::vector<int64_t> nested_order(const OffloadAnalysis& analysis, const std::vector<bool>& eligible) {
  const auto& cands = analysis.candidates;
  std::vector<int64_t> order;
  order.reserve(cands.size());
  for (size_t k = 0; k < cands.size(); ++k)
    if (eligible.empty() || eligible[k]) order.push_back(static_cast<int64_t>(k));
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    const auto& a = cands[x];
    const auto& b = cands[y];
    if (a.first_backward_use != b.first_backward_use) return a.first_backward_use > b.first_backward_use;
    if (a.last_forward_use != b.last_forward_use) return a.last_forward_use < b.last_forward_use;
    return a.tensor_id < b.tensor_id;
  });
  return order;
}

}  // namespace

std::vector<bool> nested_subfamily(const OffloadAnalysis& analysis) {
  const auto& cands = analysis.candidates;
  const std::vector<int64_t> order = nested_order(analysis, {});
  const size_t n = order.size();
  // Compress last_forward_use values to ranks 1..R for the Fenwick tree.
  std::vector<int64_t> values;
  values.reserve(n);
  for (const auto& c : cands) values.push_back(c.last_forward_use);
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
  const size_t ranks = values.size();
  // fenwick[r]: (best total bytes, end position in pi) of a non-decreasing
  // chain ending at a value of rank <= r.
  std::vector<std::pair<int64_t, int64_t>> fenwick(ranks + 1, {0, -1});
  std::vector<int64_t> prev(n, -1);
  std::vector<int64_t> best_at(n, 0);
  for (size_t p = 0; p < n; ++p) {
    const auto& c = cands[order[p]];
    const size_t r = static_cast<size_t>(std::lower_bound(values.begin(), values.end(), c.last_forward_use) -
                                         values.begin()) + 1;
    std::pair<int64_t, int64_t> q{0, -1};
    for (size_t i = r; i > 0; i -= i & (~i + 1)) q = std::max(q, fenwick[i]);
    best_at[p] = q.first + c.bytes;
    prev[p] = q.second;
    const std::pair<int64_t, int64_t> mine{best_at[p], static_cast<int64_t>(p)};
    for (size_t i = r; i <= ranks; i += i & (~i + 1)) fenwick[i] = std::max(fenwick[i], mine);
  }
  std::vector<bool> out(cands.size(), false);
  if (n == 0) return out;
  int64_t p = std::max_element(best_at.begin(), best_at.end()) - best_at.begin();
  for (; p >= 0; p = prev[p]) out[order[p]] = true;
  return out;
}

DpModel build_dp_model(const OffloadAnalysis& analysis, int64_t budget_bytes, const std::vector<int64_t>& cost,
                       const std::vector<bool>& eligible, bool force_ineligible) {
  DpModel m;
  m.budget_bytes = budget_bytes;
  const auto& cands = analysis.candidates;
  MEMSCHED_CHECK(eligible.empty() || eligible.size() == cands.size(), "build_dp_model: ", eligible.size(),
                 " eligibility flags for ", cands.size(), " candidates");
  MEMSCHED_CHECK(cost.empty() || cost.size() == cands.size(), "build_dp_model: ", cost.size(),
                 " costs for ", cands.size(), " candidates");
  m.order = nested_order(analysis, eligible);
  const auto n = static_cast<int64_t>(m.order.size());
  // live[i]: what the constraints see, less what forced candidates free.
  std::vector<int64_t> live = analysis.live_bytes;
  if (force_ineligible && !eligible.empty()) {
    for (size_t k = 0; k < cands.size(); ++k) {
      if (eligible[k]) continue;
      m.forced.push_back(static_cast<int64_t>(k));
      m.forced_cost += cost.empty() ? cands[k].bytes : cost[k];
      m.forced_bytes += cands[k].bytes;
      for (int64_t i = cands[k].last_forward_use + 1; i < cands[k].first_backward_use; ++i) live[i] -= cands[k].bytes;
    }
  }
  // Items: runs of `group` consecutive candidates of pi (See Note [DP planner model], ITEMS).
  const int64_t group = std::max<int64_t>(1, ceil_div(n, kMaxItems));
  const int64_t items = ceil_div(n, group);
  m.item_begin.resize(items + 1);
  for (int64_t j = 0; j <= items; ++j) m.item_begin[j] = std::min(n, j * group);
  int64_t total = 0;
  for (int64_t k : m.order) total += cands[k].bytes;
  const int64_t max_states = std::clamp(kDpCells / std::max<int64_t>(items, 1), kMinStates, kMaxStates);
  m.granularity_bytes = 1;
  while (ceil_div(total, m.granularity_bytes) > max_states) m.granularity_bytes *= 2;
  const int64_t g = m.granularity_bytes;

  m.nested_last_forward_use.assign(items, -1);
  m.first_backward_use.assign(items, 0);
  m.cover_units.assign(items, 0);
  m.bytes.assign(items, 0);
  m.cost.assign(items, 0);
  int64_t run_f = -1;
  for (int64_t j = 0; j < items; ++j) {
    for (int64_t k = m.item_begin[j]; k < m.item_begin[j + 1]; ++k) {
      const auto& c = cands[m.order[k]];
      run_f = std::max(run_f, c.last_forward_use);
      m.bytes[j] += c.bytes;
      const int64_t ck = cost.empty() ? c.bytes : cost[m.order[k]];
      MEMSCHED_CHECK(ck >= 0, "build_dp_model: negative cost for tensor ", c.tensor_id);
      m.cost[j] += ck;
      m.first_backward_use[j] = c.first_backward_use;  // the last member's is the least
    }
    m.nested_last_forward_use[j] = run_f;
    m.cover_units[j] = m.bytes[j] / g;
  }
  // prefix_cover[j] = g * sum_{l<j} cov_l : what offloading all of the first j items frees.
  std::vector<int64_t> prefix_cover(items + 1, 0);
  for (int64_t j = 0; j < items; ++j) prefix_cover[j + 1] = prefix_cover[j] + m.cover_units[j] * g;

  m.need_units.assign(items + 1, 0);
  m.least_budget_bytes = 0;
  const auto n_ops = static_cast<int64_t>(analysis.live_bytes.size());
  for (int64_t i = 0; i < n_ops; ++i) {
    // m_i = #{j : f'_j < i} capped by #{j : first_backward_use_j > i} (both prefixes of pi).
    const int64_t by_f = std::lower_bound(m.nested_last_forward_use.begin(), m.nested_last_forward_use.end(), i) -
                         m.nested_last_forward_use.begin();
    const int64_t by_b = std::partition_point(m.first_backward_use.begin(), m.first_backward_use.end(),
                                              [i](int64_t b) { return b > i; }) -
                         m.first_backward_use.begin();
    const int64_t mi = std::min(by_f, by_b);
    const int64_t need = live[i] - budget_bytes;
    if (need > 0) m.need_units[mi] = std::max(m.need_units[mi], ceil_div(need, g));
    m.least_budget_bytes = std::max(m.least_budget_bytes, live[i] - prefix_cover[mi]);
  }
  m.capacity_units = *std::max_element(m.need_units.begin(), m.need_units.end());
  m.feasible = budget_bytes >= m.least_budget_bytes;
  return m;
}

DpSolution solve_dp(const DpModel& model, size_t num_candidates) {
  DpSolution sol;
  sol.offload.assign(num_candidates, false);
  if (!model.feasible) return sol;
  for (int64_t k : model.forced) sol.offload[k] = true;
  sol.cost = model.forced_cost;
  sol.offloaded_bytes = model.forced_bytes;
  const auto n = static_cast<int64_t>(model.cost.size());  // items
  const int64_t C = model.capacity_units;
  if (C == 0) {  // nothing to free
    sol.feasible = true;
    return sol;
  }
  const size_t width = static_cast<size_t>(C + 1);
  std::vector<Cost> cur(width);
  cur[0] = Cost{0, 0};
  if (model.need_units[0] > 0) return sol;
  // took[k * width + c]: dp_{k+1}[c] came from offloading candidate k.
  std::vector<bool> took(static_cast<size_t>(n) * width, false);
  std::vector<int64_t> cap_pred(n, -1);  // predecessor state of dp_{k+1}[C] when it came from offloading k
  for (int64_t k = 0; k < n; ++k) {
    const int64_t w = model.cover_units[k];
    if (w > 0) {  // w == 0 frees nothing in the model and costs bytes: never chosen
      // In place, states descending: a state is read as a source before it is
      // written as a target (target min(c + w, C) > c for c < C; c == C can
      // only map to itself, which never improves a positive cost).
      const size_t base = static_cast<size_t>(k) * width;
      for (int64_t c = C - 1; c >= 0; --c) {
        if (!cur[c].finite()) continue;
        const int64_t c2 = std::min(c + w, C);
        const Cost cand{cur[c].bytes + model.cost[k], cur[c].tie + k};
        if (cand < cur[c2]) {
          cur[c2] = cand;
          took[base + c2] = true;
          if (c2 == C) cap_pred[k] = c;
        }
      }
    }
    for (int64_t c = 0; c < std::min(model.need_units[k + 1], C + 1); ++c) cur[c] = Cost{};
  }
  int64_t best = -1;
  for (int64_t c = 0; c <= C; ++c)
    if (cur[c].finite() && (best < 0 || cur[c] < cur[best])) best = c;
  if (best < 0) return sol;  // cannot happen when model.feasible
  sol.feasible = true;
  sol.cost += cur[best].bytes;
  sol.tie_break = cur[best].tie;
  int64_t c = best;
  for (int64_t k = n - 1; k >= 0; --k) {
    if (!took[static_cast<size_t>(k) * width + c]) continue;
    for (int64_t q = model.item_begin[k]; q < model.item_begin[k + 1]; ++q) sol.offload[model.order[q]] = true;
    sol.offloaded_bytes += model.bytes[k];
    c = (c == C) ? cap_pred[k] : c - model.cover_units[k];
  }
  MEMSCHED_CHECK(c == 0, "solve_dp: reconstruction ended at state ", c, "; internal error");
  return sol;
}

std::string DpPlanner::description() const {
  return "S1 dynamic program: least bytes offloaded with memory checked at every op (nested model), "
         "prefetch placed by simulation";
}

std::vector<bool> prune_with_exact_windows(const OffloadAnalysis& analysis, const DpModel& model,
                                           const std::vector<bool>& offload, int64_t budget_bytes) {
  if (analysis.candidates.size() > static_cast<size_t>(kMaxItems)) return offload;
  std::vector<bool> out = offload;
  std::vector<int64_t> mem = modelled_memory(analysis, offload_set_decisions(analysis, offload));
  for (auto it = model.order.rbegin(); it != model.order.rend(); ++it) {
    if (!out[*it]) continue;
    const auto& c = analysis.candidates[*it];
    bool fits = true;
    for (int64_t i = c.last_forward_use + 1; i < c.first_backward_use && fits; ++i) fits = mem[i] + c.bytes <= budget_bytes;
    if (!fits) continue;
    out[*it] = false;
    for (int64_t i = c.last_forward_use + 1; i < c.first_backward_use; ++i) mem[i] += c.bytes;
  }
  return out;
}

Plan DpPlanner::make_plan(const Trace& trace, const DeviceModel& device, int64_t budget_bytes) const {
  const OffloadAnalysis analysis = analyze_offload(trace);
  Plan best;
  double best_time = std::numeric_limits<double>::infinity();
  int64_t best_bytes = 0;
  std::vector<std::vector<bool>> tried;
  // Two candidate families (See Note [Nested subfamily]): all candidates, and
  // the largest nested subfamily. The model is infeasible for a family
  // whatever the cost, so feasibility is settled by the first cost.
  struct Family {
    std::vector<bool> eligible;  // empty: every candidate
    bool force_ineligible;
    const char* suffix;          // appended to Plan::objective_name
  };
  std::vector<Family> families = {{{}, false, ""}};
  const std::vector<bool> nested = nested_subfamily(analysis);
  if (std::find(nested.begin(), nested.end(), false) != nested.end()) {
    families.push_back({nested, false, "+nested"});
    families.push_back({nested, true, "+nested_forced"});
  }
  int64_t least_model_budget = std::numeric_limits<int64_t>::max();
  bool any_feasible = false;
  // One offload set, with prefetches by the latest-hiding rule at three slacks, judged by the
  // simulator. Returns true when the set offloads nothing: that plan is `best` and final.
  auto consider = [&](const std::vector<bool>& set, double objective, const std::string& objective_name) {
    const std::vector<TensorDecision> base = offload_set_decisions(analysis, set);
    int64_t set_bytes = 0;
    for (size_t k = 0; k < set.size(); ++k) set_bytes += set[k] ? analysis.candidates[k].bytes : 0;
    for (double slack : {1.0, 2.0, 4.0}) {
      DeviceModel slow = device;  // the latest-hiding rule with `slack` times the copy time
      slow.h2d_bw_gbps /= slack;
      slow.h2d_latency_us *= slack;
      std::vector<TensorDecision> d = base;
      place_prefetch_latest_hiding(trace, slow, analysis, d);
      const bool fits = fit_prefetches_to_budget(analysis, d, budget_bytes);
      MEMSCHED_CHECK(fits, "dp: a model-feasible plan does not fit the modelled memory; internal error");
      Plan p = keep_all_plan(analysis, budget_bytes);
      p.planner = name();
      p.decisions = std::move(d);
      p.objective = objective;
      p.objective_name = objective_name;
      if (set_bytes == 0) {
        best = std::move(p);
        return true;
      }
      const double t = simulate(trace, p, device).step_time_us;
      if (t < best_time || (t == best_time && set_bytes < best_bytes)) {
        best_time = t;
        best_bytes = set_bytes;
        best = std::move(p);
      }
    }
    return false;
  };
  for (const Family& family : families) {
  for (DpCost kind : kDpCosts) {
    const DpModel model = build_dp_model(analysis, budget_bytes, dp_costs(trace, device, analysis, kind),
                                         family.eligible, family.force_ineligible);
    least_model_budget = std::min(least_model_budget, model.least_budget_bytes);
    if (!model.feasible) break;
    any_feasible = true;
    const DpSolution sol = solve_dp(model, analysis.candidates.size());
    MEMSCHED_CHECK(sol.feasible, "dp: the model is feasible but the DP found no solution; internal error");
    if (std::find(tried.begin(), tried.end(), sol.offload) != tried.end()) continue;
    tried.push_back(sol.offload);
    const std::string cost_name = std::string(to_string(kind)) + family.suffix;
    if (consider(sol.offload, static_cast<double>(sol.cost), cost_name)) return best;
    std::vector<bool> pruned = prune_with_exact_windows(analysis, model, sol.offload, budget_bytes);
    if (pruned != sol.offload && consider(pruned, static_cast<double>(sol.cost), cost_name + "+pruned")) return best;
  }
  }
  // Greedy's set too (Note [DP planner model], THE PLANNER): where the nested model is loose -- windows
  // that a caller's frame stretches (Note [Held by the caller]), several micro-batches (Note
  // [Micro-batches]) -- the DP's proxies can miss a set greedy finds; the simulator judges.
  if (budget_bytes >= least_budget_bytes(analysis)) {
    const std::vector<bool> greedy = greedy_offload_set(trace, device, analysis, budget_bytes);
    if (std::find(tried.begin(), tried.end(), greedy) == tried.end()) {
      any_feasible = true;
      int64_t bytes = 0;
      for (size_t k = 0; k < greedy.size(); ++k) bytes += greedy[k] ? analysis.candidates[k].bytes : 0;
      if (consider(greedy, static_cast<double>(bytes), "offloaded_bytes+greedy_set")) return best;
    }
  }
  if (!any_feasible) {
    throw_budget_unreachable(name(), budget_bytes, least_model_budget, least_budget_bytes(analysis),
                             "its nested model keeps a tensor on the device until every tensor needed later "
                             "in backward has finished its forward use");
  }
  return best;
}

}  // namespace memsched
