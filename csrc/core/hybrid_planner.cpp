// hybrid_planner.cpp -- keep, offload or recompute per activation (See Note [Hybrid planner] in hybrid_planner.h).
#include "core/hybrid_planner.h"

#include <algorithm>
#include <cmath>
#include <future>
#include <iterator>
#include <limits>
#include <optional>
#include <sstream>

#include "core/check.h"
#include "core/dp_planner.h"
#include "core/prefetch_placement.h"
#include "core/recompute.h"
#include "core/simulator.h"

namespace memsched {

namespace {

constexpr size_t kMaxCandidatesForSlacks = 2048;  // beyond: one prefetch placement per set (planning time)
constexpr size_t kMaxCandidatesForLocalSearch = 128;  // local search: up to 2 * rounds * n simulations
constexpr int kLocalSearchRounds = 2;
constexpr int kOffloadPassPatience = 32;  // (e) stops after this many tried offloads in a row found no faster,
constexpr int kOffloadPassTrials = 128;   // or after this many in all (planning time: one simulation each)

double cost_cap(const OffloadAnalysis& analysis) {  // any sum of n capped costs fits in an int64
  return static_cast<double>((int64_t{1} << 62) / std::max<int64_t>(1, analysis.candidates.size()));
}

int64_t to_ps(double us, double cap) { return std::llround(std::min(us * 1e6, cap)); }

std::string format_weight(double w) {
  if (w == kHybridNoOffload) return "recompute_first";
  std::ostringstream os;
  os << "w=" << w;
  return os.str();
}

}  // namespace

std::vector<int64_t> hybrid_offload_costs(const Trace& trace, const DeviceModel& device,
                                          const OffloadAnalysis& analysis, double w) {
  const double cap = cost_cap(analysis);
  std::vector<int64_t> out;
  out.reserve(analysis.candidates.size());
  const std::vector<double> start = stall_free_start_us(trace, device);
  for (const auto& c : analysis.candidates) {
    if (w == kHybridNoOffload) {
      out.push_back(static_cast<int64_t>(cap));
      continue;
    }
    const double copy_us = d2h_time_us(device, c.bytes) + h2d_time_us(device, c.bytes);
    const double idle_us = start[c.first_backward_use] - start[c.last_forward_use + 1];
    out.push_back(to_ps(w * copy_us + std::max(0.0, copy_us - idle_us), cap));
  }
  return out;
}

std::vector<int64_t> hybrid_recompute_costs(const Trace& trace, const DeviceModel& device,
                                            const OffloadAnalysis& analysis) {
  const double cap = cost_cap(analysis);
  std::vector<int64_t> out;
  out.reserve(analysis.candidates.size());
  for (size_t k = 0; k < analysis.candidates.size(); ++k) {
    const RecomputeChain chain = recompute_chain(trace, analysis, static_cast<int64_t>(k));
    out.push_back(chain.feasible ? to_ps(recompute_time_us(trace, device, chain.ops), cap) : -1);
  }
  return out;
}

HybridSolution solve_hybrid(const OffloadAnalysis& analysis, int64_t budget_bytes,
                            const std::vector<int64_t>& offload_cost, const std::vector<int64_t>& recompute_cost,
                            const std::vector<bool>& eligible, bool force_ineligible) {
  const size_t n = analysis.candidates.size();
  MEMSCHED_CHECK(offload_cost.size() == n && recompute_cost.size() == n, "solve_hybrid: ", offload_cost.size(),
                 " offload and ", recompute_cost.size(), " recompute costs for ", n, " candidates");
  std::vector<int64_t> cost(n);
  std::vector<Action> off_action(n);  // the cheaper way off the device (offload on ties)
  for (size_t k = 0; k < n; ++k) {
    MEMSCHED_CHECK(offload_cost[k] >= 0, "solve_hybrid: negative offload cost for candidate ", k);
    const bool recompute = recompute_cost[k] >= 0 && recompute_cost[k] < offload_cost[k];
    cost[k] = recompute ? recompute_cost[k] : offload_cost[k];
    off_action[k] = recompute ? Action::kRecompute : Action::kOffload;
  }
  HybridSolution sol;
  const DpModel model = build_dp_model(analysis, budget_bytes, cost, eligible, force_ineligible);
  sol.least_budget_bytes = model.least_budget_bytes;
  sol.action.assign(n, Action::kKeep);
  if (!model.feasible) return sol;
  const DpSolution dp = solve_dp(model, n);
  MEMSCHED_CHECK(dp.feasible, "hybrid: the model is feasible but the DP found no solution; internal error");
  sol.feasible = true;
  sol.cost = dp.cost;
  sol.tie_break = dp.tie_break;
  for (size_t k = 0; k < n; ++k)
    if (dp.offload[k]) sol.action[k] = off_action[k];
  return sol;
}

std::vector<TensorDecision> hybrid_decisions(const Trace& trace, const OffloadAnalysis& analysis,
                                             std::vector<Action> action, int64_t budget_bytes) {
  const size_t n = analysis.candidates.size();
  MEMSCHED_CHECK(action.size() == n, "hybrid_decisions: ", action.size(), " actions for ", n, " candidates");
  std::vector<TensorDecision> d(n);
  for (size_t k = 0; k < n; ++k) {
    const auto& c = analysis.candidates[k];
    d[k] = TensorDecision(c.tensor_id, false, -1, -1);
    if (action[k] == Action::kOffload) d[k] = TensorDecision(c.tensor_id, true, c.earliest_offload_op, c.first_backward_use);
    if (action[k] == Action::kRecompute) d[k].recompute = true;
  }
  auto to_offload = [&](size_t k) {
    const auto& c = analysis.candidates[k];
    d[k] = TensorDecision(c.tensor_id, true, c.earliest_offload_op, c.first_backward_use);
  };
  // Chains (Note [Recompute model]: shared replays) depend on the other
  // decisions; turning a recompute into an offload changes them, so repeat
  // until every chain is feasible and the modelled memory fits, or no
  // recompute with extra bytes (transient or kept alive) is left. Each round
  // turns at least one recompute into an offload.
  while (true) {
    const RecomputeSchedule schedule = recompute_schedule(trace, analysis, d);
    bool changed = false;
    for (size_t k = 0; k < n; ++k) {
      if (!d[k].recompute) continue;
      if (!schedule.chains[k].feasible) {
        to_offload(k);
        changed = true;
        continue;
      }
      d[k].recompute_ops = schedule.chains[k].ops;
      d[k].recompute_at_op = schedule.at_op[k];
    }
    if (changed) continue;
    const std::vector<int64_t> mem = modelled_memory(analysis, d);
    if (*std::max_element(mem.begin(), mem.end()) <= budget_bytes) break;
    // Replays whose extra bytes lie at an op over the budget: their transient at
    // their op, or a tensor they keep alive before its own first backward use.
    auto over = [&](int64_t lo, int64_t hi) {  // some op in [lo, hi] over the budget
      for (int64_t i = lo; i <= hi; ++i)
        if (mem[i] > budget_bytes) return true;
      return false;
    };
    std::vector<size_t> extra;
    for (size_t k = 0; k < n; ++k) {
      if (!d[k].recompute || d[k].recompute_ops.empty()) continue;
      const int64_t at = d[k].recompute_at_op;
      bool hit = recompute_transient_bytes(analysis, analysis.candidates[k], d[k].recompute_ops) > 0 && over(at, at);
      for (int64_t j : schedule.kept_alive[k]) hit = hit || over(at, analysis.candidates[j].first_backward_use - 1);
      if (hit) extra.push_back(k);
    }
    if (extra.empty()) {  // fall back: every replay with extra bytes
      for (size_t k = 0; k < n; ++k)
        if (d[k].recompute && recompute_transient_bytes(analysis, analysis.candidates[k], d[k].recompute_ops) > 0)
          extra.push_back(k);
    }
    if (extra.empty()) break;  // single-op replays with no extra bytes only: nothing left to change
    for (size_t k : extra) to_offload(k);
  }
  return d;
}

Plan HybridPlanner::make_plan(const Trace& trace, const DeviceModel& device, int64_t budget_bytes) const {
  const OffloadAnalysis analysis = analyze_offload(trace);
  Plan best;
  double best_time = std::numeric_limits<double>::infinity();
  int64_t best_bytes = 0;
  double best_stall = 0.0;
  bool found = false;
  auto consider = [&](Plan p, const std::string& source) {
    const SimResult r = simulate(trace, p, device);
    if (r.over_budget) return;  // cannot happen for a plan that fits its modelled memory; never chosen
    const int64_t moved = p.offloaded_bytes(trace) + p.recomputed_bytes(trace);
    if (found && !(r.step_time_us < best_time || (r.step_time_us == best_time && moved < best_bytes))) return;
    found = true;
    best_time = r.step_time_us;
    best_bytes = moved;
    best_stall = r.stall_us;
    p.planner = name();
    p.budget_bytes = budget_bytes;
    p.objective = r.step_time_us;
    p.objective_name = source;
    best = std::move(p);
  };

  // (a) Every other planner's plan; dp, the slowest, on a second thread while
  // the rest of (a) and (b) run (See Note [Hybrid planner]: PLANNING TIME).
  auto plan_of = [&trace, &device, budget_bytes](const std::string& other) -> std::optional<Plan> {
    try {
      return create_planner(other)->make_plan(trace, device, budget_bytes);
    } catch (const Error&) {
      return std::nullopt;  // that planner cannot reach this budget
    }
  };
  std::vector<std::pair<std::string, std::vector<Action>>> other_sets;  // for (d)
  auto consider_planner = [&](const std::string& other, std::optional<Plan> p) {
    if (!p) return;
    const std::string source = other + (p->objective_name.empty() ? "" : ":" + p->objective_name);
    std::vector<Action> actions(p->decisions.size());
    for (size_t k = 0; k < actions.size(); ++k) actions[k] = action_of(p->decisions[k]);
    other_sets.emplace_back(source, std::move(actions));
    consider(std::move(*p), source);
  };
  const std::string kDp = "dp";
  std::future<std::optional<Plan>> dp_plan = std::async(std::launch::async, plan_of, kDp);
  for (const std::string& other : planner_names())
    if (other != name() && other != kDp) consider_planner(other, plan_of(other));

  // (b) The DP over keep/offload/recompute, per copy weight and family.
  struct Family {
    std::vector<bool> eligible;
    bool force_ineligible;
    const char* suffix;
  };
  std::vector<Family> families = {{{}, false, ""}};
  const std::vector<bool> nested = nested_subfamily(analysis);
  if (std::find(nested.begin(), nested.end(), false) != nested.end()) {
    families.push_back({nested, false, "+nested"});
    families.push_back({nested, true, "+nested_forced"});
  }
  const std::vector<int64_t> recompute_cost = hybrid_recompute_costs(trace, device, analysis);
  const bool any_recomputable =
      std::any_of(recompute_cost.begin(), recompute_cost.end(), [](int64_t c) { return c >= 0; });
  std::vector<double> slacks = {1.0, 2.0, 4.0};
  std::vector<double> weights(std::begin(kHybridCopyWeights), std::end(kHybridCopyWeights));
  if (analysis.candidates.size() > kMaxCandidatesForSlacks) {  // planning time: see Note [Hybrid planner]
    slacks = {1.0};
    weights = {0.25, kHybridNoOffload};
    families.resize(1);  // all candidates; dp (in (a)) covers the nested families for offload-only plans
  }
  int64_t least_model_budget = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<Action>> tried;
  for (double w : weights) {
    if (!any_recomputable) break;  // then the DP is dp's own with other costs: (a) covers offload-only plans
    const std::vector<int64_t> offload_cost = hybrid_offload_costs(trace, device, analysis, w);
    for (const Family& family : families) {
      const HybridSolution sol =
          solve_hybrid(analysis, budget_bytes, offload_cost, recompute_cost, family.eligible, family.force_ineligible);
      least_model_budget = std::min(least_model_budget, sol.least_budget_bytes);
      if (!sol.feasible) continue;
      // The pruned form: drop what the exact windows do not need (pruning treats both actions as "off").
      std::vector<bool> off(sol.action.size());
      for (size_t k = 0; k < off.size(); ++k) off[k] = sol.action[k] != Action::kKeep;
      const DpModel model = build_dp_model(analysis, budget_bytes, {}, family.eligible, family.force_ineligible);
      const std::vector<bool> pruned_off = prune_with_exact_windows(analysis, model, off, budget_bytes);
      std::vector<Action> pruned = sol.action;
      for (size_t k = 0; k < pruned.size(); ++k)
        if (!pruned_off[k]) pruned[k] = Action::kKeep;
      for (const auto& [actions, is_pruned] : {std::make_pair(sol.action, false), std::make_pair(pruned, true)}) {
        if (is_pruned && actions == sol.action) continue;
        if (std::find(tried.begin(), tried.end(), actions) != tried.end()) continue;
        tried.push_back(actions);
        const std::vector<TensorDecision> base = hybrid_decisions(trace, analysis, actions, budget_bytes);
        for (double slack : slacks) {
          DeviceModel slow = device;  // the latest-hiding rule with `slack` times the copy time
          slow.h2d_bw_gbps /= slack;
          slow.h2d_latency_us *= slack;
          std::vector<TensorDecision> d = base;
          place_prefetch_latest_hiding(trace, slow, analysis, d);
          if (!fit_prefetches_to_budget(analysis, d, budget_bytes)) continue;
          Plan p = keep_all_plan(analysis, budget_bytes);
          p.decisions = std::move(d);
          consider(std::move(p), std::string("hybrid:") + format_weight(w) + family.suffix +
                                     (is_pruned ? "+pruned" : "") + (slack != 1.0 ? "+slack" + std::to_string(static_cast<int>(slack)) : ""));
        }
      }
    }
  }
  consider_planner(kDp, dp_plan.get());

  // A candidate from per-tensor actions (chains rebuilt, prefetches placed at slack 1 and fitted): true
  // when the simulator finds it faster than the best so far, which it then is.
  auto try_actions = [&](const std::vector<Action>& actions, const std::string& source) {
    std::vector<TensorDecision> d = hybrid_decisions(trace, analysis, actions, budget_bytes);
    place_prefetch_latest_hiding(trace, device, analysis, d);
    if (!fit_prefetches_to_budget(analysis, d, budget_bytes)) return false;
    Plan p = keep_all_plan(analysis, budget_bytes);
    p.decisions = std::move(d);
    const bool before_found = found;
    const double before = best_time;
    consider(std::move(p), source);
    return found && (!before_found || best_time < before);
  };

  // (d) When no plan so far recomputes and the best one stalls on copies: each other planner's off-device
  // set, recomputed where a chain can recreate it (See Note [Hybrid planner]: the DP's plans may not
  // survive on micro-batch traces).
  const bool stalls_without_recompute = !found || (best.num_recomputed() == 0 && best_stall > 0.0);
  for (const auto& [source, actions] : other_sets) {
    if (!any_recomputable || !stalls_without_recompute) break;
    std::vector<Action> trial = actions;
    bool changed = false;
    for (size_t k = 0; k < trial.size(); ++k) {
      if (trial[k] != Action::kOffload || recompute_cost[k] < 0) continue;
      trial[k] = Action::kRecompute;
      changed = true;
    }
    if (changed) try_actions(trial, "hybrid:recompute(" + source + ")");
  }

  // (c) Local search from the best plan: one tensor's action at a time (See Note [Hybrid planner]).
  const size_t n = analysis.candidates.size();
  if (found && n <= kMaxCandidatesForLocalSearch) {
    const std::string start = best.objective_name;
    std::vector<Action> current(n);
    for (size_t k = 0; k < n; ++k) current[k] = action_of(best.decisions[k]);
    bool improved = true;
    for (int round = 0; round < kLocalSearchRounds && improved; ++round) {
      improved = false;
      for (size_t k = 0; k < n; ++k) {
        for (Action alt : {Action::kKeep, Action::kOffload, Action::kRecompute}) {
          if (alt == current[k] || (alt == Action::kRecompute && recompute_cost[k] < 0)) continue;
          std::vector<Action> trial = current;
          trial[k] = alt;
          if (try_actions(trial, "hybrid:local(" + start + ")")) {
            for (size_t q = 0; q < n; ++q) current[q] = action_of(best.decisions[q]);
            improved = true;
          }
        }
      }
    }
  }
  // (e) Beyond (c)'s size: one pass over the best plan's recomputed tensors, earliest first, each tried as an
  // offload (See Note [Hybrid planner]: the copy bandwidth the forward has left, which the DP's separable
  // costs do not see).
  if (found && n > kMaxCandidatesForLocalSearch && n <= kMaxCandidatesForSlacks && best.num_recomputed() > 0) {
    const std::string start = best.objective_name;
    std::vector<Action> current(n);
    for (size_t k = 0; k < n; ++k) current[k] = action_of(best.decisions[k]);
    std::vector<size_t> order;
    for (size_t k = 0; k < n; ++k)
      if (current[k] == Action::kRecompute) order.push_back(k);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return analysis.candidates[a].earliest_offload_op < analysis.candidates[b].earliest_offload_op;
    });
    int misses = 0, trials = 0;  // (once the forward's copy bandwidth is spent, later offloads only stall)
    for (size_t k : order) {
      if (misses == kOffloadPassPatience || trials == kOffloadPassTrials) break;
      if (current[k] != Action::kRecompute) continue;
      ++trials;
      std::vector<Action> trial = current;
      trial[k] = Action::kOffload;
      if (try_actions(trial, "hybrid:offload_pass(" + start + ")")) {
        for (size_t q = 0; q < n; ++q) current[q] = action_of(best.decisions[q]);
        misses = 0;
      } else {
        ++misses;
      }
    }
  }
  if (!found) {
    for (const Family& family : families)
      least_model_budget = std::min(
          least_model_budget,
          build_dp_model(analysis, budget_bytes, {}, family.eligible, family.force_ineligible).least_budget_bytes);
    throw_budget_unreachable(name(), budget_bytes, least_model_budget, least_budget_bytes(analysis),
                             "no plan of its candidates fits");
  }
  return best;
}

}  // namespace memsched
