"""Stand-ins for the tests of memsched.offload: a minimal trace recorder and a plan object.

Not part of the package. The recorder sees one step the way the executor does
(saved-tensor hooks inside the model's forward, activation labels from
memsched.saved_tensors) and writes a Trace with one forward op per activation
(its producer) and one backward op per unpack, so that the executor can be
tested independently of the profiler and the planners.
"""
import importlib
from dataclasses import dataclass

import torch

import memsched
from memsched.saved_tensors import ActivationNumbering, ModuleStack


@dataclass
class Decision:
    tensor_id: int
    offload: bool
    offload_after_op: int
    prefetch_at_op: int


@dataclass
class StandInPlan:
    decisions: list


class StandInProfiler:
    """start() ... stop() -> Trace, recording what runs in between (the profiler's session contract)."""

    def __init__(self, model, optimizer=None):
        self.model = model
        self.node_of_op = {}  # no autograd node offsets: prefetches fall back to observable ops

    def start(self):
        model = self.model
        self.numbering = ActivationNumbering(model)
        self.stack = ModuleStack(model).install()
        self.events = []      # ("pack", ordinal) on first pack / ("unpack", ordinal)
        self.info = {}        # ordinal -> (label, bytes, dtype)
        self.pushed = False

        def pack(t):
            act = self.numbering.number(t, self.stack.current)
            if act is None:
                return t
            if act.is_first_pack:
                self.events.append(("pack", act.ordinal))
                self.info[act.ordinal] = (act.label, t.untyped_storage().nbytes(),
                                          str(t.dtype).replace("torch.", ""))
            return (act.ordinal, t.detach())

        def unpack(p):
            if isinstance(p, torch.Tensor):
                return p
            self.events.append(("unpack", p[0]))
            return p[1]

        # memsched.optimize starts a session at the step's first forward; like memsched.profile the
        # hooks then cover the rest of the step (loss, backward).
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
        self.pushed = True
        self.handles = []
        return self

    def stop(self):
        if self.pushed:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.pushed = False
        for h in self.handles:
            h.remove()
        self.stack.remove()
        trace = memsched.Trace()
        producer, uses = {}, {}
        for kind, k in self.events:
            phase = "forward" if kind == "pack" else "backward"
            op = trace.add_op(f"{kind}{k}", "", phase, duration_us=10.0)
            if kind == "pack":
                producer[k] = op
            else:
                uses.setdefault(k, []).append(op)
        for k in sorted(self.info):
            label, nbytes, dtype = self.info[k]
            u = uses.get(k, [])
            trace.add_tensor(nbytes, dtype, "activation", producer_op=producer[k], uses=u,
                             freed_after_op=u[-1] if u else producer[k], label=label)
        return trace


def record_trace(model, step_fn):
    """Run step_fn() once under StandInProfiler; return its Trace."""
    session = StandInProfiler(model)
    def start(module, args):
        if not hasattr(session, "pushed"):
            session.start()

    h = model.register_forward_pre_hook(start)
    try:
        step_fn()
        h.remove()
    finally:
        trace = session.stop()
    return trace


def install_standins(monkeypatch, lookahead=1, only_missing=False):
    """Route memsched.optimize's profiler / planner / simulator seams to the stand-ins.

    only_missing=True: substitute only the pieces this build does not have yet.
    """
    opt = importlib.import_module("memsched.optimize")  # memsched.optimize is also the function
    have_profiler = _importable("memsched.profiler")
    if not (only_missing and have_profiler):
        monkeypatch.setattr(opt, "start_profile", lambda model, optimizer, device, offload=None:
                            StandInProfiler(model).start())  # keeps every activation: ignores `offload`
    if not (only_missing and hasattr(memsched, "plan")):
        monkeypatch.setattr(opt, "make_plan", lambda trace, budget, planner, device:
                            offload_all_plan(trace, lookahead))
        monkeypatch.setattr(opt, "simulate", lambda trace, plan, device: None)


def _importable(name):
    import importlib
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def offload_all_plan(trace, lookahead=1):
    """Offload every activation read in backward; prefetch `lookahead` backward ops before first use
    (lookahead=0: on demand)."""
    bwd = [op.id for op in trace.ops if op.phase == "backward"]
    decisions = []
    for rec in trace.tensors:
        b = [u for u in rec.uses if trace.ops[u].phase == "backward"]
        if rec.kind != "activation" or not b:
            continue
        i = bwd.index(min(b))
        decisions.append(Decision(rec.id, True, rec.producer_op, bwd[max(0, i - lookahead)]))
    return StandInPlan(decisions)
