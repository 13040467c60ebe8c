// plan.cpp -- offload analysis, plan validation and the modelled memory curve (see plan.h).
#include "core/plan.h"

#include <algorithm>

#include "core/check.h"
#include "core/recompute.h"

namespace memsched {

namespace {
std::string format_ids(const std::vector<int64_t>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? ", " : "") + std::to_string(ids[i]);
  return out + "]";
}
}  // namespace

int64_t Plan::num_offloaded() const {
  int64_t n = 0;
  for (const auto& d : decisions) n += d.offload ? 1 : 0;
  return n;
}

int64_t Plan::offloaded_bytes(const Trace& trace) const {
  int64_t total = 0;
  for (const auto& d : decisions) {
    if (d.offload && d.tensor_id >= 0 && d.tensor_id < static_cast<int64_t>(trace.tensors.size()))
      total += trace.tensors[d.tensor_id].bytes;
  }
  return total;
}

const char* to_string(Action action) {
  switch (action) {
    case Action::kKeep: return "keep";
    case Action::kOffload: return "offload";
    case Action::kRecompute: return "recompute";
  }
  return "?";
}

int64_t Plan::num_recomputed() const {
  int64_t n = 0;
  for (const auto& d : decisions) n += d.recompute ? 1 : 0;
  return n;
}

int64_t Plan::recomputed_bytes(const Trace& trace) const {
  int64_t total = 0;
  for (const auto& d : decisions) {
    if (d.recompute && d.tensor_id >= 0 && d.tensor_id < static_cast<int64_t>(trace.tensors.size()))
      total += trace.tensors[d.tensor_id].bytes;
  }
  return total;
}

OffloadAnalysis analyze_offload(const Trace& trace) {
  trace.validate();
  OffloadAnalysis a;
  const auto n_ops = static_cast<int64_t>(trace.ops.size());
  a.next_backward_op.assign(n_ops + 1, n_ops);
  for (int64_t i = n_ops - 1; i >= 0; --i)
    a.next_backward_op[i] = trace.ops[i].phase == Phase::kBackward ? i : a.next_backward_op[i + 1];
  a.first_backward_op = a.next_backward_op[0];
  a.live_bytes = trace.live_bytes();
  a.candidate_index.assign(trace.tensors.size(), -1);
  a.op_output_bytes.assign(n_ops, 0);
  for (const auto& t : trace.tensors)
    if (t.producer_op != kBeforeStep) a.op_output_bytes[t.producer_op] += t.bytes;
  a.op_inputs_begin.assign(n_ops + 1, 0);
  for (const auto& t : trace.tensors)
    for (int64_t u : t.uses) ++a.op_inputs_begin[u + 1];
  for (int64_t i = 0; i < n_ops; ++i) a.op_inputs_begin[i + 1] += a.op_inputs_begin[i];
  a.op_inputs.assign(a.op_inputs_begin[n_ops], 0);
  {
    std::vector<int64_t> fill(a.op_inputs_begin.begin(), a.op_inputs_begin.end() - 1);
    for (const auto& t : trace.tensors)  // ascending id, so each op's list is ascending
      for (int64_t u : t.uses) a.op_inputs[fill[u]++] = t.id;
  }
  for (const auto& t : trace.tensors) {
    if (t.kind != TensorKind::kActivation || n_ops == 0) continue;
    // See Note [The executor's size floor]: the executor keeps these on the device.
    if (t.bytes < trace.min_offload_bytes) continue;
    // Held past the step (the caller's batch, a retained output): someone else keeps the device
    // copy alive, so an offload would free nothing and its fetch would add a second copy. The
    // executor keeps these on the device too (held_past_step in offload/schedule.py).
    if (t.freed_after_op == kAfterStep) continue;
    if (t.producer_op != kBeforeStep && trace.ops[t.producer_op].phase != Phase::kForward) continue;
    // Its own backward pass (Note [Micro-batches]).
    const int64_t beta = a.next_backward_op[std::max<int64_t>(t.producer_op, 0)];
    auto it = std::lower_bound(t.uses.begin(), t.uses.end(), beta);
    if (it == t.uses.end() || trace.ops[*it].phase != Phase::kBackward) continue;
    // Held into the backward pass by the caller (Note [Held by the caller] in trace.h): leaving the
    // device would free nothing while it is held, and its fetch would add a second copy.
    if (t.held_until_op >= beta) continue;
    // Saved through several version counters: each would come back as a copy of its own (Note [Saves
    // through several counters] in trace.h).
    if (t.save_counters > 1) continue;
    OffloadCandidate c;
    c.tensor_id = t.id;
    c.bytes = t.bytes;
    c.live_start = trace.live_start(t);
    c.live_end = trace.live_end(t);
    c.earliest_offload_op = std::max<int64_t>(t.producer_op, 0);
    c.last_forward_use = it == t.uses.begin() ? c.earliest_offload_op : std::max(c.earliest_offload_op, *(it - 1));
    c.last_forward_use = std::max(c.last_forward_use, t.held_until_op);  // Note [Held by the caller]
    c.first_backward_use = *it;
    c.backward_start = beta;
    a.candidate_index[t.id] = static_cast<int64_t>(a.candidates.size());
    a.candidates.push_back(c);
  }
  return a;
}

Plan keep_all_plan(const OffloadAnalysis& analysis, int64_t budget_bytes) {
  Plan p;
  p.budget_bytes = budget_bytes;
  p.decisions.reserve(analysis.candidates.size());
  for (const auto& c : analysis.candidates) p.decisions.push_back({c.tensor_id, false, -1, -1});
  p.objective_name = "offloaded_bytes";
  return p;
}

void validate_plan(const Trace& trace, const OffloadAnalysis& analysis, const Plan& plan) {
  MEMSCHED_CHECK(plan.budget_bytes >= 0, "plan: field 'budget_bytes' is negative (", plan.budget_bytes, ")");
  MEMSCHED_CHECK(plan.decisions.size() == analysis.candidates.size(), "plan: has ", plan.decisions.size(),
                 " decisions but the trace has ", analysis.candidates.size(),
                 " offloadable tensors; a plan needs one decision per offloadable tensor, ascending tensor_id");
  RecomputeSchedule schedule;  // derived once, at the first recompute decision
  bool schedule_done = false;
  for (size_t k = 0; k < plan.decisions.size(); ++k) {
    const TensorDecision& d = plan.decisions[k];
    const OffloadCandidate& c = analysis.candidates[k];
    MEMSCHED_CHECK(d.tensor_id == c.tensor_id, "plan: decisions[", k, "] field 'tensor_id' is ", d.tensor_id,
                   " but the ", k, "-th offloadable tensor is ", c.tensor_id, " (ascending tensor_id expected)");
    if (d.recompute) {
      MEMSCHED_CHECK(!d.offload && d.offload_after_op == -1 && d.prefetch_at_op == -1, "plan: decisions[", k,
                     "] (tensor ", d.tensor_id, ") sets both 'recompute' and 'offload' (or an offload/prefetch op); "
                     "a tensor is kept, offloaded or recomputed: set offload=False and both op fields to -1");
      if (!schedule_done) {
        schedule = recompute_schedule(trace, analysis, plan.decisions);
        schedule_done = true;
      }
      const RecomputeChain& chain = schedule.chains[k];
      MEMSCHED_CHECK(chain.feasible, "plan: decisions[", k, "] (tensor ", d.tensor_id,
                     ") field 'recompute' is true but the tensor cannot be recomputed: ", chain.why,
                     "; keep or offload it instead");
      MEMSCHED_CHECK(d.recompute_ops == chain.ops, "plan: decisions[", k, "] (tensor ", d.tensor_id,
                     ") field 'recompute_ops' is ", format_ids(d.recompute_ops), " but under this plan the tensor is "
                     "recreated by replaying ops ", format_ids(chain.ops),
                     chain.ops.empty() ? " (none: an earlier replay recreates and keeps it)" : "",
                     " (recompute_schedule()); set it to that");
      MEMSCHED_CHECK(d.recompute_at_op == schedule.at_op[k], "plan: decisions[", k, "] (tensor ", d.tensor_id,
                     ") field 'recompute_at_op' is ", d.recompute_at_op, " but under this plan the tensor is "
                     "recreated just before op ", schedule.at_op[k], " (recompute_schedule()); set it to that");
      continue;
    }
    MEMSCHED_CHECK(d.recompute_ops.empty() && d.recompute_at_op == -1, "plan: decisions[", k, "] (tensor ",
                   d.tensor_id, ") field 'recompute_ops' or 'recompute_at_op' is set but 'recompute' is false; "
                   "clear them (recompute_ops=[], recompute_at_op=-1) or set recompute=True");
    if (!d.offload) continue;
    MEMSCHED_CHECK(d.offload_after_op >= c.earliest_offload_op && d.offload_after_op < c.backward_start,
                   "plan: decisions[", k, "] (tensor ", d.tensor_id, ") field 'offload_after_op' is ",
                   d.offload_after_op, "; it must lie in [", c.earliest_offload_op, ", ",
                   c.backward_start - 1, "] (after its producer, before its backward pass)");
    MEMSCHED_CHECK(d.prefetch_at_op >= c.backward_start && d.prefetch_at_op <= c.first_backward_use,
                   "plan: decisions[", k, "] (tensor ", d.tensor_id, ") field 'prefetch_at_op' is ", d.prefetch_at_op,
                   "; it must lie in [", c.backward_start, ", ", c.first_backward_use,
                   "] (a backward op no later than the tensor's first backward use)");
  }
}

std::vector<int64_t> modelled_memory(const OffloadAnalysis& analysis, const std::vector<TensorDecision>& decisions) {
  const auto n = static_cast<int64_t>(analysis.live_bytes.size());
  MEMSCHED_CHECK(decisions.size() == analysis.candidates.size(), "modelled_memory: ", decisions.size(),
                 " decisions for ", analysis.candidates.size(), " offloadable tensors");
  std::vector<int64_t> diff(n + 1, 0);
  for (size_t k = 0; k < decisions.size(); ++k) {
    const auto& d = decisions[k];
    const auto& c = analysis.candidates[k];
    if (d.recompute) {
      // Off the device during ops (last_forward_use, recompute_at_op); the replay's other outputs at that op.
      const int64_t at = d.recompute_at_op;
      MEMSCHED_CHECK(at > c.last_forward_use && at <= c.first_backward_use, "modelled_memory: decisions[", k,
                     "] (tensor ", d.tensor_id, ") field 'recompute_at_op' is ", at, "; it must lie in [",
                     c.last_forward_use + 1, ", ", c.first_backward_use, "] (see recompute_schedule())");
      diff[c.last_forward_use + 1] -= c.bytes;
      diff[at] += c.bytes;
      const int64_t extra = recompute_transient_bytes(analysis, c, d.recompute_ops);
      diff[at] += extra;
      diff[at + 1] -= extra;
      continue;
    }
    if (!d.offload) continue;
    // Off the device during ops (max(offload_after_op, last_forward_use), prefetch_at_op).
    const int64_t lo = std::max(d.offload_after_op, c.last_forward_use) + 1;
    const int64_t hi = d.prefetch_at_op;  // exclusive
    if (lo < hi) {
      diff[lo] -= c.bytes;
      diff[hi] += c.bytes;
    }
  }
  std::vector<int64_t> mem(n);
  int64_t run = 0;
  for (int64_t i = 0; i < n; ++i) {
    run += diff[i];
    mem[i] = analysis.live_bytes[i] + run;
  }
  return mem;
}

int64_t least_budget_bytes(const OffloadAnalysis& analysis) {
  std::vector<TensorDecision> all;
  all.reserve(analysis.candidates.size());
  for (const auto& c : analysis.candidates)
    all.push_back({c.tensor_id, true, c.earliest_offload_op, c.first_backward_use});
  const auto mem = modelled_memory(analysis, all);
  int64_t least = 0;
  for (int64_t m : mem) least = std::max(least, m);
  return least;
}

}  // namespace memsched
