// hybrid_planner.h -- the `hybrid` planner: per offloadable activation keep,
// offload (with a prefetch point) or recompute (replaying forward ops on the
// compute stream just before its first backward use), least simulated step
// time under the byte budget.
//
// Entry points: hybrid_offload_costs(), hybrid_recompute_costs(),
// solve_hybrid(), HybridPlanner.
//
// Note [Hybrid planner]
//   Rationale: offload alone cannot free more during forward than the copy
//   bandwidth moves in that time (issue 12); recompute frees the same window
//   (last forward use .. first backward use) for compute time instead of copy
//   bandwidth, so the two mix.
//   THE MODEL (exact, checked against brute force over keep/offload/recompute
//   per tensor): Note [DP planner model]'s nested windows and memory
//   constraint, where a tensor that is offloaded OR recomputed counts as off
//   the device during its nested window. Costs are per tensor, in picoseconds
//   of estimated step time:
//     offload   round(1e6 * (w * copy_us + max(0, copy_us - idle_us))): the
//               copy time that cannot hide in the tensor's idle window, plus a
//               share w of the whole copy time for contention on the copy
//               streams (w in kHybridCopyWeights; w = kHybridNoOffload makes
//               offload cost the cap, i.e. recompute wherever possible)
//     recompute round(1e6 * time of recompute_chain() with every other tensor
//               kept): the replay is never hidden; unavailable (-1) when the
//               tensor cannot be recomputed (Note [Recompute model]).
//   A choice's model is then a dp model whose per-tensor cost is the lesser
//   of the two (offload on ties), so solve_dp() is exact for it: the least
//   (sum of costs, sum of positions in pi) over all 3^n assignments.
//   WHY IT IS SOUND: both actions release the tensor over at least its true
//   window, so every model-feasible assignment fits the modelled memory
//   (plan.h) -- except for a replay's transient bytes and a chain longer than
//   modelled (an input that is no longer kept), and for a replay that keeps
//   another recomputed tensor alive from its own op (shared replays, Note
//   [Recompute model]). The planner therefore rebuilds every chain from the
//   final decisions (recompute_schedule) and turns a recompute whose chain is
//   not feasible, or whose extra bytes lie at an op over the budget, into an
//   offload (the same window, no extra bytes), until the modelled memory fits.
//   THE PLANNER: candidates are (a) the plans of every other registered
//   planner (keep_all, the heuristics and dp) -- so hybrid is never slower in
//   simulation than any of them at the same budget -- and (b) for each copy
//   weight and each of dp's three families (Note [Nested subfamily]) the DP
//   optimum and its pruned form (prune_with_exact_windows), with prefetches
//   placed by Capuchin's latest-hiding rule at slack 1, 2 and 4 and pulled
//   later to fit (fewer beyond 2048 candidates: see PLANNING TIME). The
//   simulator, which models replays on the compute stream, picks the least
//   step time (ties: fewer bytes offloaded plus recomputed, then the order
//   in which they are considered: the other planners but dp, (b), dp). (c) Up to
//   128 candidates, a local search then changes one tensor's action at a
//   time (keep / offload / recompute, chains rebuilt, prefetches placed at
//   slack 1) and keeps any change the simulator finds faster, for at most two
//   rounds over all tensors. (d) When no plan so far recomputes anything and
//   the best one stalls on copies (where copies hide, a replay only adds
//   time): each plan of (a) with its offloaded tensors recomputed wherever a
//   chain can recreate them (chains rebuilt, prefetches at slack 1). On traces of
//   several micro-batches the DP's plans may all fail hybrid_decisions'
//   budget check, and beyond 128 candidates (c) is off, so a plan that
//   offloads over a slow link stood where recomputing the same tensors
//   fitted and simulated up to 2000x faster (found by a helper on Hugging
//   Face models with gradient accumulation). Every step only accepts a
//   faster plan, so the result stays no slower than (a). (e) Beyond (c)'s 128
//   candidates (up to 2048): one pass over the best plan's recomputed
//   tensors in forward order, each tried as an offload (chains rebuilt,
//   prefetches at slack 1), kept when the simulator finds it faster. The
//   DP's separable offload cost cannot see how much copy bandwidth the
//   forward has left, so on a decoder's trace every candidate recomputed all
//   it freed, matmuls included, where the first blocks' copies hide in the
//   forward: a GPT-2-medium-shaped decoder (24 blocks, 416 candidates, H100
//   roofline, bf16) at 0.5 of its activations simulated 1.056x keep_all's
//   step, 1.038x with the pass (at 0.7: 1.050x, 1.033x), for one simulation
//   per tried tensor (300 -> 700 ms of planning there). On its 8-block
//   form (145 candidates) the pass found the plans (c) finds, in 40% of
//   (c)'s planning time. The pass stops after 32 tries in a row found
//   nothing faster (the forward's bandwidth is spent) or 128 tries in all:
//   on a 2001-candidate synthetic trace it adds 0.25 s to 0.74 s (an
//   untried later tensor stays recomputed).
//   Plan::objective is that simulated step time; objective_name says which
//   candidate won ("hybrid:w=0.25+nested+pruned", "dp:exposed_time_ps",
//   "hybrid:local(greedy:offloaded_bytes)", ...).
//   PLANNING TIME: dp is the most expensive candidate (18 DP solves and up
//   to 54 simulations beyond 2048 activations), so it runs on a second
//   thread (std::async; every planner is a pure function of its const
//   inputs) while the other planners and (b) run; it is considered after
//   (b), and the result does not depend on thread timing. Beyond 2048
//   candidates (where pruning is the identity) (b) tries only slack 1, the
//   weights 0.25 and recompute-first and the family of all candidates (dp
//   still covers the nested families for offload-only plans).
//   benchmarks/python/bench_hybrid_planner.py times a 10k-activation trace.
//   LIMITATIONS: the costs are separable proxies (a chain's real length
//   depends on which inputs stay kept; copy contention is seen only by the
//   simulator), so optimality holds for the stated model, not for simulated
//   step time; the least budget is the offload model's (recompute frees the
//   same windows). memsched.optimize() executes the decisions (Note
//   [Unpack-time recompute] in python/memsched/offload/recompute.py).
#pragma once

#include <cstdint>
#include <vector>

#include "core/planner.h"

namespace memsched {

constexpr double kHybridNoOffload = -1.0;  // copy weight meaning "offload costs the cap"
constexpr double kHybridCopyWeights[] = {0.05, 0.25, 1.0, kHybridNoOffload};

// Per-candidate offload cost of Note [Hybrid planner] for copy weight `w`, ps.
std::vector<int64_t> hybrid_offload_costs(const Trace& trace, const DeviceModel& device,
                                          const OffloadAnalysis& analysis, double w);
// Per-candidate recompute cost, ps; -1 where the tensor cannot be recomputed.
std::vector<int64_t> hybrid_recompute_costs(const Trace& trace, const DeviceModel& device,
                                            const OffloadAnalysis& analysis);

struct HybridSolution {
  bool feasible = false;
  int64_t cost = 0;                  // sum of the chosen actions' costs
  int64_t tie_break = 0;             // sum of positions in pi of the tensors off the device
  std::vector<Action> action;        // per candidate (OffloadAnalysis order)
  int64_t least_budget_bytes = 0;    // the least budget the model reaches
};

// The exact optimum of Note [Hybrid planner]'s model (family as in build_dp_model).
HybridSolution solve_hybrid(const OffloadAnalysis& analysis, int64_t budget_bytes,
                            const std::vector<int64_t>& offload_cost, const std::vector<int64_t>& recompute_cost,
                            const std::vector<bool>& eligible = {}, bool force_ineligible = false);

// Decisions for per-candidate actions: offloads out after their producer and
// fetched on demand, recomputes with their chains rebuilt under these actions
// (recompute_schedule); a recompute whose chain is not feasible becomes an
// offload, and so does one whose extra bytes lie at an op over the budget.
std::vector<TensorDecision> hybrid_decisions(const Trace& trace, const OffloadAnalysis& analysis,
                                             std::vector<Action> action, int64_t budget_bytes);

class HybridPlanner final : public Planner {
 public:
  std::string name() const override { return "hybrid"; }
  std::string description() const override {
    return "keep, offload or recompute per activation: exact DP over the three actions plus every other "
           "planner's plan, least simulated step time";
  }
  Plan make_plan(const Trace& trace, const DeviceModel& device, int64_t budget_bytes) const override;
};

}  // namespace memsched
