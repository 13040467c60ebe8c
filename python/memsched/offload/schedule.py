"""What the executor does at run time, derived from a Trace and a Plan.

Entry point: OffloadSchedule.build(trace, plan, min_bytes) -> OffloadSchedule.
Everything is keyed by activation ordinal (See Note [Activation identity] in
docs/CONVENTIONS-activation-identity.md): the executor sees ordinals and labels,
never trace ids.

Note [Plan ops to backward triggers]
  Rationale: the plan says "prefetch tensor T when op p starts", with p an op of
  the profiled trace, but the executor can only observe what autograd shows it
  in eager mode: the unpack of a saved tensor, which happens when the backward
  node that reads it starts.
  Approach: an op is *observable* when it is the first backward use of some
  activation of the trace (kept or offloaded: every saved activation passes
  through the unpack hook). A prefetch planned at op p is issued at the latest
  observable op q <= p, i.e. at the first unpack of any activation whose first
  backward use is q; if no observable op precedes p it is issued at the first
  unpack of the backward pass. When an unpack is observed, every trigger up to
  and including its op fires (so a trigger whose tensors are never unpacked
  cannot hold prefetches back). A prefetch whose trigger is the tensor's own
  first backward use is "on demand": fetched synchronously at its unpack and
  counted as a stall.
  Granularity: rounding p down to an observable op issues a prefetch at most
  one observable op early -- never late -- so it could cost memory (up to the
  tensors of that gap), never time; memsched.optimize therefore moves each
  prefetch of its plan to where it fires before running it (Note [Prefetches
  where they fire] in prefetch_fit.py).
  With the profiled step's node offsets (ProfilerSession.node_of_op) a prefetch
  at backward op p triggers at the first op of p's autograd node instead, and
  the executor fires it from a pre-hook on that node (Note [Backward node
  triggers] in csrc/torch/saved_tensor_path.cpp): early by at most the ops of
  one node. Unpacks keep firing triggers up to their op, as a fallback.
  The D2H copy is issued when the activation is first packed, i.e. during its
  producer op, which is at or before the plan's offload_after_op: never late.

Note [Activations held past the step]
  An activation whose storage outlives the step in the trace (freed_after_op
  == -1: the caller's batch tensors `x` and `y`, an output the caller keeps) is
  held by a reference outside the autograd graph. Copying it to host frees
  nothing -- the device storage stays -- and fetching it back for backward adds
  a second device copy. The executor keeps such a planned offload on the device
  (counted in skipped_held) and planned_activation_curve counts it as kept, so
  the curve is what the executor does. The C++ planners and simulator
  (analyze_offload in csrc/core/plan.cpp) still count it as offloadable and
  credit its bytes between offload and prefetch, so a plan's simulated peak can
  be below what any execution reaches by up to those bytes.
"""
import bisect
import re

_LABEL = re.compile(r"^act:(\d+):")


def ordinal_of_label(label):
    """The activation ordinal written in a trace label "act:<ordinal>:...", or None."""
    m = _LABEL.match(label or "")
    return int(m.group(1)) if m else None


def held_past_step(rec):
    """True when the trace's tensor outlives the step: offloading it frees no device memory
    (See Note [Activations held past the step])."""
    return rec.freed_after_op < 0


def plan_decisions(plan):
    """The TensorDecision list of a plan object (memsched.Plan or a stand-in with .decisions)."""
    decisions = getattr(plan, "decisions", None)
    if decisions is None:
        raise TypeError(f"plan: expected an object with .decisions (a memsched plan), got {type(plan).__name__}")
    return list(decisions)


class PrefetchPoints:
    """The ops of one trace where the executor starts a prefetch (Note [Plan ops to backward triggers])."""

    def __init__(self, trace, node_of_op=None):
        ops = trace.ops
        first_bwd = set()
        for rec in trace.tensors:
            if rec.kind != "activation" or ordinal_of_label(rec.label) is None:
                continue
            bwd = [u for u in rec.uses if ops[u].phase == "backward"]
            if bwd:
                first_bwd.add(min(bwd))
        self.observable_ops = sorted(first_bwd)  # ops whose first unpack the unpack hook reveals
        self.node_of_op = dict(node_of_op or {})  # backward op -> autograd node offset
        self.node_first_op = {}
        for op, node in sorted(self.node_of_op.items()):
            self.node_first_op.setdefault(node, op)
        backward = [op.id for op in ops if op.phase == "backward"]
        self.first_backward_op = backward[0] if backward else len(ops)
        starts = set(self.node_first_op.values()) | set(self.observable_ops)
        self.points = sorted(q for q in starts if self.trigger(q, q + 1)[0] == q)  # where a trigger fires as planned

    def trigger(self, p, first_use):
        """(trigger op, node or None) for a prefetch planned at op p of a tensor first used at first_use: the
        start of p's node, else the latest observable op <= p (-1: the step's first unpack). A trigger at
        or after first_use means on demand."""
        node = self.node_of_op.get(p)
        if node is not None and p < first_use:
            return self.node_first_op[node], node
        i = bisect.bisect_right(self.observable_ops, p) - 1
        return (self.observable_ops[i] if i >= 0 else -1), None

    def fires_at(self, p, first_use):
        """The op at which a prefetch planned at p starts: first_use when on demand."""
        q = self.trigger(min(p, first_use), first_use)[0]
        if q < 0:
            q = self.first_backward_op
        return min(q, first_use)

    def at_or_after(self, p, first_use):
        """The first op at or after p where a prefetch starts as planned, or first_use (on demand)."""
        i = bisect.bisect_left(self.points, p)
        return self.points[i] if i < len(self.points) and self.points[i] < first_use else first_use


class OffloadSchedule:
    """Per-ordinal actions for one profiled step."""

    def __init__(self):
        self.labels = {}           # ordinal -> label expected at that ordinal
        self.bytes = {}            # ordinal -> storage bytes in the trace
        self.first_bwd_op = {}     # ordinal -> trace op index of its first backward use (absent: none)
        self.offload = set()       # ordinals to copy to host
        self.trigger_op = {}       # offloaded ordinal -> observable op at whose first unpack it is prefetched;
                                   #   -1: at the first unpack of the step; absent: on demand
        self.prefetch_at = {}      # observable op (or -1) -> ordinals prefetched there, in plan order
        self.observable_ops = []   # sorted trace op indices that the unpack hook reveals
        self.trigger_ops = []      # sorted keys of prefetch_at
        self.trigger_nodes = {}    # autograd node offset -> trigger op at its start (Note [Backward node triggers])
        self.skipped_small = 0     # COUNT: planned offloads below the size floor (kept)
        self.skipped_held = 0      # COUNT: planned offloads of tensors held past the step (kept)
        self.copies_on_compute_stream = False  # the plan wants copies on the compute stream (offload_all_sync)
        self.recompute = set()     # ordinals released after the forward and replayed (Note [Unpack-time recompute])
        self.recompute_ops = set() # forward trace op ids of their chains: what the forward records
        self.shared = set()        # recomputed ordinals the plan recreates inside another one's replay
        self.forward_starts = []   # trace op id where each forward of the step begins
        self.before_step = set()   # ordinals whose storage existed before the step (the caller's batch)

    @classmethod
    def build(cls, trace, plan, min_bytes=0, node_of_op=None, forward_starts=None):
        """Turn (trace, plan) into an OffloadSchedule. plan=None: keep everything.

        node_of_op: the profiled step's backward op -> autograd node offset (ProfilerSession.node_of_op);
        with it a prefetch fires when its op's node starts (Note [Backward node triggers] in
        csrc/torch/saved_tensor_path.cpp), without it at the latest observable op before it.
        forward_starts: the profiled step's first op of each forward with grad enabled
        (ProfilerSession.forward_starts); without it, each run of forward ops starts one (Note [Forwards
        that save nothing] in recompute.py).
        """
        s = cls()
        ops = trace.ops
        tensors = trace.tensors
        ordinal_of_id = {}
        held = set()
        for rec in tensors:
            k = ordinal_of_label(rec.label)
            if k is None:
                continue
            s.labels[k] = rec.label  # every saved storage, whatever kind it ended the step as
            if rec.kind != "activation":
                continue  # e.g. upgraded to gradient: matched by label, never offloaded
            ordinal_of_id[rec.id] = k
            if rec.producer_op < 0:
                s.before_step.add(k)
            if held_past_step(rec):
                held.add(k)
            s.bytes[k] = rec.bytes
            bwd = [u for u in rec.uses if ops[u].phase == "backward"]
            if bwd:
                s.first_bwd_op[k] = min(bwd)
        points = PrefetchPoints(trace, node_of_op)
        s.observable_ops = points.observable_ops
        if plan is None:
            return s
        s.copies_on_compute_stream = bool(getattr(plan, "copies_on_compute_stream", False))
        for d in plan_decisions(plan):
            recompute = getattr(d, "recompute", False)
            if not (d.offload or recompute):
                continue
            k = s._executable(d, ordinal_of_id, held, min_bytes)
            if k is None:
                continue
            if recompute:
                s.recompute.add(k)
                s.recompute_ops.update(d.recompute_ops)
                if not d.recompute_ops:
                    s.shared.add(k)
                continue
            s.offload.add(k)
            first_use = s.first_bwd_op[k]
            trigger, node = points.trigger(min(d.prefetch_at_op, first_use), first_use)
            if node is not None:
                s.trigger_nodes[node] = trigger  # the start of p's node: at most that node's ops early
            if trigger >= first_use:
                continue  # on demand
            s.trigger_op[k] = trigger
            s.prefetch_at.setdefault(trigger, []).append(k)
        if s.recompute and forward_starts is not None:
            s.forward_starts = list(forward_starts)
        elif s.recompute:
            s.forward_starts = [op.id for op in ops
                                if op.phase == "forward" and (op.id == 0 or ops[op.id - 1].phase != "forward")]
        s.trigger_ops = sorted(s.prefetch_at)
        s.trigger_nodes = {n: q for n, q in s.trigger_nodes.items() if q in s.prefetch_at}
        s.check_invariants()
        return s

    def _executable(self, d, ordinal_of_id, held, min_bytes):
        """The ordinal a planned offload or recompute acts on, or None where the executor keeps it."""
        k = ordinal_of_id.get(d.tensor_id)
        if k is None or k not in self.first_bwd_op:
            return None  # not a matchable activation, or never read in backward: nothing to do
        if k in held:
            self.skipped_held += 1  # See Note [Activations held past the step]
            return None
        if self.bytes[k] < min_bytes:
            self.skipped_small += 1
            return None
        return k

    def triggers_through(self, op, fired_upto):
        """Trigger ops in (fired_upto, op], in order; -1 (backward start) first when fired_upto < -1."""
        lo = bisect.bisect_right(self.trigger_ops, fired_upto)
        hi = bisect.bisect_right(self.trigger_ops, op)
        return self.trigger_ops[lo:hi]

    @property
    def offloaded_bytes(self):
        return sum(self.bytes[k] for k in self.offload)

    def check_invariants(self):
        assert self.offload <= set(self.first_bwd_op), "offloaded tensors are read in backward"
        assert self.recompute <= set(self.first_bwd_op) and not (self.recompute & self.offload)
        for k, q in self.trigger_op.items():
            assert k in self.offload and q < self.first_bwd_op[k], "a prefetch fires before its first use"
            assert k in self.prefetch_at[q]
        assert sum(len(v) for v in self.prefetch_at.values()) == len(self.trigger_op)
