"""Plans whose prefetches start where the executor starts them.

Entry point: fit_prefetches(trace, plan, points), with points a schedule.PrefetchPoints.

Note [Prefetches where they fire]
  Rationale: a plan may prefetch at any backward op, but the executor starts a prefetch only where
  autograd shows it something: at the start of a backward node (a pre-hook) or at the first unpack of a
  saved activation (Note [Plan ops to backward triggers] in schedule.py), so it rounds the planned op
  down. An op in the middle of a node (an add inside LayerNorm's backward) or of no hookable node (the
  add_ of AccumulateGrad under gradient accumulation) started its prefetch a node or more early, beside
  tensors the plan had freed by then: the measured saved-activation peak 8.5% (transformer) and 72.6%
  (two-layer LSTM, two micro-batches) over the plan's, with the simulation and run.report() describing
  a step that never ran (found by a helper checking budgets on CPU).
  Approach: after planning, each prefetch moves to the op where the executor starts it where the plan's
  modelled memory (copies taken as instantaneous: what the CPU executor measures, and what a GPU holds
  once a prefetch is issued) stays within both the budget and the plan's own peak; otherwise to the first
  op at or after the planned one where a prefetch can start (on demand at the tensor's first backward
  use when there is none): later costs time, which the simulation shows, never memory. Each prefetch is
  decided on its own, earliest first, against the memory of those decided before it (all-or-nothing put
  20 of 26 of an LSTM's prefetches on demand where 2 had to be). The plan the Run reports, simulates and
  executes is the one that runs. (The simulator is no judge here: it holds a prefetch back until it
  fits, which the executor does not.)
  Limitations: only offloads move (a replay runs at its unpack, where the plan puts it); the order is
  greedy, not searched.
"""
from memsched._C import Plan, modelled_memory
from memsched.offload.schedule import plan_decisions


def _passes(trace):
    """Per tensor id: (backward_start, first_backward_use) of its own backward pass (Note [Micro-batches]
    in csrc/core/plan.h), for the tensors with a backward use after their producer."""
    ops = trace.ops
    n = len(ops)
    next_backward = [n] * (n + 1)
    for i in range(n - 1, -1, -1):
        next_backward[i] = i if ops[i].phase == "backward" else next_backward[i + 1]
    out = {}
    for rec in trace.tensors:
        beta = next_backward[max(rec.producer_op, 0)]
        uses = [u for u in rec.uses if u >= beta]
        if uses:
            out[rec.id] = (beta, min(uses))
    return out


def fit_prefetches(trace, plan, points):
    """`plan` with each prefetch at the op where the executor starts it (Note [Prefetches where they fire]);
    returns (plan, later, on_demand): how many prefetches start later than planned, and how many of those
    at their tensor's first use."""
    if not isinstance(plan, Plan):
        return plan, 0, 0  # no plan, or a stand-in without the C++ memory model (tests of the executor)
    decisions = plan_decisions(plan)
    passes = _passes(trace)
    earlier, later = [], []
    for k, d in enumerate(decisions):
        if not d.offload or d.tensor_id not in passes:
            continue
        beta, first_use = passes[d.tensor_id]
        p = min(d.prefetch_at_op, first_use)
        q = points.fires_at(p, first_use)
        if q == p:
            continue
        if beta <= q < p:
            earlier.append((k, q, points.at_or_after(p, first_use)))
        else:
            later.append((k, points.at_or_after(p, first_use)))
    if not earlier and not later:
        return plan, 0, 0
    limit = max(plan.budget_bytes, max(modelled_memory(trace, plan), default=0))
    for k, q in later:
        decisions[k].prefetch_at_op = q
    for k, _, q in earlier:
        decisions[k].prefetch_at_op = q  # first all later; then each one earlier where that fits
    plan.decisions = decisions
    if earlier:
        mem = list(modelled_memory(trace, plan))
        tensors = trace.tensors  # once: each read copies every record
        for k, q, late in sorted(earlier, key=lambda e: e[1]):
            nbytes = tensors[decisions[k].tensor_id].bytes
            if max(mem[q:late], default=0) + nbytes <= limit:  # resident over [q, late) instead
                decisions[k].prefetch_at_op = q
                for i in range(q, late):
                    mem[i] += nbytes
        plan.decisions = decisions
    moved = [(k, q) for k, q in later] + [(k, decisions[k].prefetch_at_op) for k, f, _ in earlier
                                          if decisions[k].prefetch_at_op != f]
    return plan, len(moved), sum(q == passes[decisions[k].tensor_id][1] for k, q in moved)
