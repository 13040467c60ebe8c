"""memsched.optimize(): profile the first step, plan for the budget, execute the plan from then on.

Entry point: optimize(model, optimizer=None, budget=None, planner="dp", ...) -> Run,
a context manager:

    with memsched.optimize(model, optimizer=opt, budget="6GiB", timeline=True) as run:
        for batch in loader:
            loss_fn(model(batch)).backward()
            run.step()          # optimizer.step() + zero_grad(); plans after the first step
    run.report()                # prints the planned-vs-measured table, returns a RunReport
    run.save_timeline("step.png")  # or "step.json": a Chrome trace (Perfetto)

A loop that calls optimizer.step() and zero_grad() itself (Hugging Face Trainer, Lightning) needs
no run.step(): see Note [optimizer.step() without run.step()] in step_hook.py, and
memsched.integrations for the trainers' callbacks.

Note [Profiling inside the user's first step]
  Rationale: memsched.profile(step_fn, ...) runs a step it is given, but here
  the user drives the loop, so there is no step function to hand over.
  Approach: the step's first forward starts a memsched.profiler.ProfilerSession
  (the instrumentation of memsched.profile(), so the trace is the one profile()
  records); that forward, backward (and whatever else runs until run.step())
  is recorded; run.step() stops the session (a step that raised is aborted and
  the next one recorded instead), plans the Trace for the budget, simulates
  the plan, and from the second step on the OffloadExecutor executes it (the
  executor's hooks are installed at __enter__ but stay inactive while
  profiling). The first step's optimizer.step() runs after the Trace is closed,
  so the trace holds forward + backward only.
  How the profiled step holds its saved activations: Note [Profiling a step that does not fit].
  A step that does not match the trace (See Note [Activation identity]) runs
  without offloading from the first mismatching activation on, with one
  warning per Run; after two mismatching steps in a row the next step is
  profiled again and re-planned (Note [A lone mismatching step]), at most
  `max_reprofiles` times -- after that mismatching steps simply run plainly.

Note [A lone mismatching step]
  Rationale: the commonest mismatch is a lone step -- the last, smaller batch of an epoch
  (DataLoader's drop_last=False), one eval-mode forward left with gradients on. Re-profiling at
  once spent a slow profiled step on it every epoch and used up max_reprofiles on batches that
  never come back, so a lasting change later (a new sequence length) was no longer re-profiled.
  Approach: a mismatching step runs plainly from its mismatch on, as before, and the plan stays;
  the next step runs it. Only a second mismatching step in a row gets the step after it profiled
  (and counts against max_reprofiles).
  Limitations: a lasting change runs two steps plainly instead of one before it is re-planned.

Note [Profiling a step that does not fit]
  Rationale: a profile that keeps every saved activation on the device needs plain PyTorch's
  memory, so memsched could only train a batch whose plain step already fits.
  Approach: with profile="offload" -- the default (profile="auto") when the budget is given in
  bytes, the one form known before profiling -- the profiled step's saved activations go to host
  memory as soon as nothing but autograd holds them and come back when backward unpacks them,
  while the Trace still describes the step as plain PyTorch runs it (Note [Profiling with saved
  activations offloaded] in profiler/offloaded_saves.py: same ops, activations, sizes, producers,
  uses and frees; exact copies, so gradients are plain's). Copies use the Run's HostBuffers
  (host_memory_limit holds: a save past it stays on the device) and a CopyEngine of its own.
  profile="keep" profiles as plain PyTorch runs. run.profile_stats (ProfiledStepStats) and
  run.report() say which, and what the profiled step measured.
  Limitations: a fraction ("0.5") or a percentage ("50%") is resolved to bytes only from the
  profile, so "auto" keeps every activation for those budgets (and for budget=None): the first
  step then needs plain's memory -- pass bytes, or profile="offload". The offloaded profile needs
  about what torch.autograd.graph.save_on_cpu needs (each activation leaves the device once its
  forward users let go; backward fetches on demand), so a byte budget below that, which a plan
  with prefetch or recompute may still meet from the second step on, is exceeded by the first
  step. The profiled step is slower (copies, no prefetch).

Note [What a Run changes while it is active]
  - hooks: a forward pre-hook and an always-called forward hook on the root
    module (the Run's), the executor's pair, ModuleStack's pair on every
    submodule, and -- while profiling -- the profiler's (with step pre/post
    hooks on the optimizer); our saved-tensor hooks from a step's first
    forward to run.step(). All are removed by __exit__,
    also when the body raised (KeyboardInterrupt included).
  - ooo=True: memsched.ooo patches eligible layers' forward; removed likewise.
  - optimizer.step is routed through the Run (a bound method on the optimizer instance), so a
    loop that calls optimizer.step() itself -- Trainer, accelerate, Lightning -- needs no
    run.step(); restored by __exit__. See Note [optimizer.step() without run.step()] in
    step_hook.py.
  - CUDA: torch.cuda peak-memory statistics are reset at the start of every
    executed and profiled step (the measured peak is per step).
  Parameters, buffers, gradients and optimizer state are never touched except
  by optimizer.step() / zero_grad(set_to_none=True) in run.step().
  A step whose first forward starts under the caller's own saved-tensor hooks
  (save_on_cpu, checkpoint(model, ...), disable_saved_tensors_hooks) -- or,
  for a step to be profiled, a TorchDispatchMode -- runs plainly: ours would
  be pushed inside their context and popped outside it. One warning; counted
  in run.steps_not_profiled / as a mismatch, and in run.report(). See Note
  [Foreign saved-tensor hooks] in offload/executor.py.

Note [Compiled modules run plainly]
  A model that is, or holds, a compiled module (torch.compile(m) -- an
  OptimizedModule -- or m.compile(), which sets m._compiled_call_impl, or
  m.forward = torch.compile(m.forward), as Lightning's fit(torch.compile(m))
  does: found by a helper, 3e-2 off both plain runs with no word) is
  found in optimize(): the compiled graph (AOTAutograd) saves other tensors
  for backward than the eager forward -- fused, recomputed, functionalized --
  and under dynamo the profile would not see the graph's own, so no step
  would match a plan: each mismatched, was re-profiled twice and then ran
  plainly, with a warning that did not say why. Instead the Run warns once
  at optimize(), installs no hook (no profile, plan, offload or ooo), lets
  run.step() step the optimizer, and run.report() says so. Offload needs the
  module before torch.compile().

Note [A step that raises]
  Rationale: batch-size finders (Hugging Face auto_find_batch_size,
  Lightning's BatchSizeFinder) catch torch.OutOfMemoryError, drop it and
  retry with a smaller batch, in the same loop or by running it again. If
  anything of ours still holds a tensor of the failed step, its memory stays
  allocated and every retry fails too.
  Approach: per-step state is owned by the step's autograd graph, and we keep
  only weak references to it, so it dies when the caller drops the exception
  (whose traceback frames hold the graph):
  - the profiler's pack hook stores a detached alias, never a tensor with a
    grad_fn: an output saved by its own node made a cycle through C++ that gc
    cannot see, and a graph never run backward stayed alive for good;
  - the executor's handles of offloaded activations (host copies, fetched and
    prefetched device copies) are held by the graph's packed objects; its own
    table is weak. When the last dies outside the engine, copies in flight are
    waited for and released (Note [Offload copy ordering]);
  - the out-of-order backward's nodes keep a per-iteration token: when all of
    them die outside the engine before their backward pass ended, the
    iteration is abandoned -- deferred work and partial gradient sums dropped,
    parked gradients restored (Note [A failed backward] in ooo/backward.py).
  A forward that raises is seen by the always-called hooks on the root: the
  executor pops its hooks and drops the step; ooo abandons the iteration; the
  profiler session is aborted at the next forward (which is recorded
  instead), run.step() or __exit__ -- torch iterates the module's hooks while
  calling ours, so the session's cannot be removed there. A backward pass that raised during the profiled
  step is seen at the next forward (the engine never ran the callback queued
  at its first op): that step is recorded afresh. __exit__ removes
  everything, abandoning a half-run iteration.
  Limitations: after a backward or a loss that raised, and after a profiled
  forward that raised, our saved-tensor hooks (and, while profiling, the
  dispatch mode) stay until run.step(), the next forward or __exit__, as
  within any step -- they hold no tensor. A loss that raised in the
  profiled step cannot be told from a second forward of the same step, so the
  retry is recorded into the same trace (the plan may then mismatch and
  re-profile). Parameters the fused update stepped before a backward raised
  keep their update, as documented in ooo; a RuntimeWarning names how many
  when the iteration is abandoned (Note [A failed backward] in ooo/backward.py).

Note [Budgets]
  budget=None: "as fast as possible within the device's memory": keep_all when
  the profiled peak fits the device (always on CPU), else `planner` at 90% of
  the device's total memory. Every other budget means what it means to
  memsched.plan (Note [Budget forms] in planning.py; one shared
  parse_budget / resolve_budget): an int or a string ("6GiB"): a device-memory
  budget in bytes for the whole step (parameters, gradients and optimizer
  state included); a string "50%": that share of the profiled step's peak; a
  float f in (0, 1]: "f of plain's activation memory" -- the step's peak if its
  saved activations never exceeded f times their keep-all peak (the budgets
  of the benchmark). Where the step's peak lies outside the saved activations
  (gradients in backward, optimizer state: what offload cannot lower), that
  peak bounds the budget rather than a byte count below it that no plan can
  reach, and run.report() names the op and phase. The budget is checked in
  optimize() (ValueError naming budget and the forms); a budget below what any
  plan can reach raises the planner's MemschedError (naming the least budget)
  from the first run.step().

Note [Optimizer state the profiled step did not see]
  Rationale: Adam(W) and SGD with momentum create their state in the first optimizer.step(), after
  the profiled first step's trace was closed, so that trace has none of it while every later step
  holds it all: a byte budget planned on the trace alone was exceeded by the state (70% over for a
  tiny GPT-2 under AdamW), and the re-profile after a mismatch, which does see the state, then
  refused a budget the first plan had accepted.
  Approach: what the update will create (extra) is predicted when the profile closes, before the
  update, for torch.optim's optimizers (_STATE_OF: tensors like each parameter with a gradient, and
  0-dim step counts; Adagrad's exists from its construction), and checked after it against the state's bytes on the Run's device (read when the
  profile started and after the update); another optimizer's state is measured there. extra is
  constant over every later step, so it shifts the whole memory curve by extra. Byte budgets
  (bytes, "6GiB", and "P%" of the step's peak with the state) are planned as budget - extra on the
  trace, budget=None compares peak + extra with the device, and run.report() shows budget and
  planned peak with extra. A fraction f needs nothing: its byte budget is taken from the same
  trace and compares like with like. A byte budget that cannot hold the state is refused before
  the first update, naming the least budget with the state; only state the prediction missed is
  found after the update, re-planned then and refused there (the first step was then a complete
  plain step). A refusal before the update drops the step's gradients (set to None), so a retry
  with the named budget trains as plain PyTorch.
  With fuse_optimizer too: the profiled step updates after backward (Note [The profiled step updates
  after backward]).
  Limitations: state made later than the first update (an optimizer that allocates at step 2) is not
  seen.

Note [The profiled step updates after backward]
  Rationale: with fuse_optimizer the update ran inside the profiled step's backward, before run.step()
  planned. A budget refused there left the model and optimizer one update further, and the retry the
  error named was refused again (the optimizer state now existed; found by probing). And a backward
  node or hook that reads a weight after its gradient is final (a tensor hook, another parameter's
  post-accumulate-grad hook, a weight kept on a custom Function's ctx) can only be seen by watching
  backward, which must not run after the weights changed.
  Approach: while a profile is open, out-of-order backward runs its backward passes unfused
  (OutOfOrderBackward.fusion_paused: gradients are kept as without fusion), and the step boundary
  runs optimizer.step() as for ooo=True alone -- after planning, so a refusal changes nothing. The
  state that update creates is predicted as without fusion (Note [Optimizer state the profiled step
  did not see]); its peak is not taken as every update's (Note [Where the peak went]): later updates
  are fused, inside backward. run.step() after it counts the gradients it zeroes as freed by a fused
  update (OutOfOrderBackward.note_step_zeroed), so a loop's zero_grad(set_to_none=False) after it
  gets the zeros plain PyTorch holds, as after the other steps. The profiler's
  dispatch mode notes every backward op that reads a parameter whose gradient is already final; such
  a parameter is held to the end of backward from then on (Note [A parameter read after its gradient
  is final] in ooo/backward.py). Later steps fuse.
  Limitations: the profiled step keeps every gradient until its update, as plain PyTorch does, so the
  plan counts them (a budget is then met with room to spare on fused steps).

Note [A step with no end]
  A Run whose loop never reaches its step boundary -- no run.step(), and no optimizer passed to
  optimize() whose step() would end the step -- kept its first profile open for good: every
  forward and backward was recorded into one trace (RSS grew by 44 MiB over 2000 steps) and
  nothing was ever planned, without a word. After _MAX_PROFILED_FORWARDS forwards in one profiled
  step (far more micro-batches than gradient accumulation uses) the profile is dropped, the model
  runs plainly, and one warning says how to end a step. A Run left (without an error) before its
  first step boundary warns likewise, and run.report() says why nothing was planned.

Note [Recompute decisions run]
  planner="hybrid" may recompute activations (Note [Hybrid planner] in
  csrc/core/hybrid_planner.h). The executor runs those decisions as planned:
  each is released after the forward and replayed from the ops that made it
  at its first unpack (Note [Unpack-time recompute] in offload/recompute.py).
  A save the executor cannot replay exactly keeps its tensor, and run.report()
  counts it with the reason; the budget may then be exceeded by its bytes.
"""
import bisect
import collections
import contextlib
import re
import sys
import threading
import warnings
import weakref

import torch

from memsched import _C, allocator
from memsched.copy_inert import inert_on_copy
from memsched.device import resolve_device
from memsched.offload.executor import OffloadExecutor, foreign_hooks_reason
from memsched.offload.guard import guard_headroom
from memsched.offload.host_buffers import HostBuffers, parse_host_limit
from memsched.offload.host_limit import plan_within_host_limit
from memsched.offload.peak_gap import explain_peak_gap
from memsched.offload.report import build_report, largest_planned, planned_activation_curve, save_timeline
from memsched.offload.prefetch_fit import fit_prefetches
from memsched.offload.schedule import OffloadSchedule, PrefetchPoints
from memsched.offload.shape_plans import MAX_SHAPE_PLANS, PLAN_FIELDS, describe, step_signature
from memsched.planning import (fraction_budget, fraction_refusal, least_working_budget, parse_budget,
                               percent_refusal, planner_least_bytes, planner_names, resolve_budget)
from memsched.step_hook import (OptimizerStepHook, accelerate_end_of_dataloader, accelerate_would_not_step,
                                accelerate_wrappers, check_closure_optimizer, is_skipped_update, split_closure,
                                torch_optimizer)
from memsched.units import format_bytes, parse_bytes
from memsched.wording import counted
from memsched.user_frame import user_stacklevel  # See Note [Warnings point at the caller's code]

__all__ = ["optimize", "Run"]

_DEFAULT_MIN_BYTES_CUDA = 1 << 20   # offloading less than 1 MiB costs more in latency than it saves
_DEVICE_MEMORY_FRACTION = 0.9       # budget=None on a device that the step does not fit
# Note [Optimizer state the profiled step did not see]: what torch.optim's update creates per parameter
# with a gradient, by group settings: (tensors like the parameter, 0-dim float32 tensors, whether those
# are on the parameter's device whatever `capturable` says). A retry at the least budget a refusal named
# must not be refused again once the state exists (RMSprop was, found by fuzzing). Adagrad, and any
# optimizer whose state exists before its first step, count as they are.
_STATE_OF = {
    torch.optim.SGD: lambda g: (1 if g.get("momentum", 0) else 0, 0, False),
    torch.optim.Adam: lambda g: (3 if g.get("amsgrad") else 2, 1, False),
    torch.optim.AdamW: lambda g: (3 if g.get("amsgrad") else 2, 1, False),
    torch.optim.RMSprop: lambda g: (1 + (1 if g.get("momentum", 0) else 0) + (1 if g.get("centered") else 0), 1, False),
    torch.optim.Adamax: lambda g: (2, 1, False),
    torch.optim.RAdam: lambda g: (2, 1, False),
    torch.optim.NAdam: lambda g: (2, 2, False),
    torch.optim.Adadelta: lambda g: (2, 1, False),
    torch.optim.Rprop: lambda g: (2, 1, False),
    torch.optim.ASGD: lambda g: (1, 3, True),
}

_MAX_PROFILED_FORWARDS = 256        # forwards one profiled step may hold (Note [A step with no end])
_STEP_BOUNDARY_FIX = ("memsched ends a step at run.step(), or at optimizer.step() of the optimizer passed to "
                      "optimize(optimizer=...): call run.step() where the optimizer steps (it steps the optimizer "
                      "too), or pass the optimizer")


# -- the pieces of other issues, behind one seam each (tests may substitute stand-ins) -----------------
def start_profile(model, optimizer, device, offload=None):
    """Start recording one step (called at the step's first forward): a started
    memsched.profiler.ProfilerSession, whose stop() returns the memsched.Trace and whose abort()
    drops a failed step. offload: an OffloadedSaves (Note [Profiling a step that does not fit])."""
    from memsched.profiler import ProfilerSession
    return ProfilerSession(model, optimizer, device, offload=offload).start()


def make_plan(trace, budget_bytes, planner, device):
    """memsched.plan() of the planner issue."""
    import memsched
    return memsched.plan(trace, budget=budget_bytes, planner=planner, device=device)


def simulate(trace, plan, device):
    """memsched.simulate() of the planner issue; None when it is not available."""
    import memsched
    fn = getattr(memsched, "simulate", None)
    return fn(trace, plan, device=device) if fn is not None else None



def _storages_of(t: torch.Tensor):
    """The storages holding t's data: a sparse tensor has none of its own, its index and value tensors
    do (SGD's momentum buffer of an nn.Embedding(sparse=True) is sparse; untyped_storage() raised)."""
    if t.layout == torch.strided and not t.is_nested:
        return (t.untyped_storage(),)
    if t.layout == torch.sparse_coo:
        return (t._indices().untyped_storage(), t._values().untyped_storage())
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return tuple(x.untyped_storage() for x in (t.crow_indices(), t.col_indices(), t.values()))
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return tuple(x.untyped_storage() for x in (t.ccol_indices(), t.row_indices(), t.values()))
    return ()  # a nested tensor: not counted

def check_options(budget=None, planner="dp", ooo=False, fuse_optimizer=False, min_offload_bytes=None,
                  max_reprofiles=2, device_model=None, grad_accumulation_steps=1, timeline=False, history=100,
                  host_memory_limit=None, profile="auto", max_shape_plans=MAX_SHAPE_PLANS):
    """The checks of optimize()'s arguments that need no model or optimizer (Run.__init__ makes them first;
    the framework callbacks when they are built, integrations/_common.py): a ValueError naming the argument
    and what it accepts."""
    known = planner_names()
    if not isinstance(planner, str) or planner not in known:
        raise ValueError(f"planner: unknown planner {planner!r}; known planners: {', '.join(known)}")
    if parse_budget(budget) == 0:  # parse_budget: a ValueError naming budget and its forms
        # no step fits in 0 bytes: refused here, not after the profiled step (planning.plan takes 0 to ask
        # for the least budget a trace needs)
        raise ValueError(f"budget: 0 bytes holds no training step; give the device memory to plan within "
                         f"(e.g. '6GiB'), a fraction of the activation memory (e.g. 0.5), or None (no limit); "
                         f"got {budget!r}")
    if not isinstance(profile, str) or profile not in PROFILE_MODES:
        raise ValueError(f"profile: expected one of {', '.join(repr(m) for m in PROFILE_MODES)} -- how the "
                         f"first, profiled step holds its saved activations: 'offload' keeps them in host memory "
                         f"(a step that does not fit can be profiled), 'keep' on the device as plain PyTorch "
                         f"does, 'auto' offloads when the budget is given in bytes -- got {profile!r}")
    if device_model is not None:
        try:
            resolve_device(device_model)  # a ValueError naming the preset, file or field, before any step
        except ValueError as err:
            raise ValueError("device_model: " + str(err).removeprefix("device: ")) from None
    if min_offload_bytes is not None:
        parse_bytes(min_offload_bytes, name="min_offload_bytes")
    if isinstance(max_reprofiles, bool) or not isinstance(max_reprofiles, int) or max_reprofiles < 0:
        raise ValueError(f"max_reprofiles: expected an int >= 0 (re-profiles after a mismatching step), "
                         f"got {max_reprofiles!r}")
    if isinstance(max_shape_plans, bool) or not isinstance(max_shape_plans, int) or max_shape_plans < 1:
        raise ValueError(f"max_shape_plans: expected an int >= 1 (plans kept, one per input shape; 1: one plan, "
                         f"a step of other shapes mismatches it), got {max_shape_plans!r}")
    if isinstance(grad_accumulation_steps, bool) or not isinstance(grad_accumulation_steps, int) \
            or grad_accumulation_steps < 1:
        raise ValueError(f"grad_accumulation_steps: expected an int >= 1 (backward passes per run.step()), "
                         f"got {grad_accumulation_steps!r}")
    if grad_accumulation_steps != 1 and not (ooo or fuse_optimizer):
        raise ValueError("grad_accumulation_steps: applies with ooo=True or fuse_optimizer=True (their update "
                         "runs inside backward); without them run.step() is optimizer.step(): call it once "
                         "after the K backward passes of a step, as with plain PyTorch, and leave "
                         "grad_accumulation_steps at 1")
    if isinstance(history, bool) or not isinstance(history, int) or history < 1:
        raise ValueError(f"history: expected an int >= 1 (executed steps whose StepStats run.step_stats "
                         f"keeps), got {history!r}")
    for name, flag in (("ooo", ooo), ("fuse_optimizer", fuse_optimizer), ("timeline", timeline)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}: expected True or False, got {flag!r}")
    parse_host_limit(host_memory_limit)  # See Note [Host memory limit]


class Run:
    """A memsched.optimize() session; see the module docstring."""

    def __init__(self, model, optimizer=None, budget=None, planner="dp", device=None, ooo=False,
                 fuse_optimizer=False, min_offload_bytes=None, max_reprofiles=2, device_model=None,
                 grad_accumulation_steps=1, timeline=False, history=100, host_memory_limit=None, profile="auto",
                 max_shape_plans=MAX_SHAPE_PLANS):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        lazy = next((n for n, p in model.named_parameters() if torch.nn.parameter.is_lazy(p)), None)
        if lazy is not None:  # the profile, the executor and ooo read every parameter's storage
            raise ValueError(f"model: parameter {lazy} is not initialized yet (a LazyModule such as nn.LazyLinear); "
                             f"run the model once on a batch before memsched.optimize (under torch.no_grad() is "
                             f"enough), as PyTorch asks before building an optimizer")
        if isinstance(optimizer, type):  # the class itself has a step() too: refused here, not at the first forward
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer (or None), got the class "
                            f"{optimizer.__module__}.{optimizer.__qualname__}; pass an instance built from the "
                            f"model's parameters, e.g. {optimizer.__qualname__}(model.parameters(), lr=...)")
        if optimizer is not None and not hasattr(optimizer, "step"):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer (or None), got {type(optimizer).__name__}")
        check_options(budget=budget, planner=planner, ooo=ooo, fuse_optimizer=fuse_optimizer,
                      min_offload_bytes=min_offload_bytes, max_reprofiles=max_reprofiles, device_model=device_model,
                      grad_accumulation_steps=grad_accumulation_steps, timeline=timeline, history=history,
                      host_memory_limit=host_memory_limit, profile=profile, max_shape_plans=max_shape_plans)
        self.model = model
        self.optimizer = torch_optimizer(optimizer)  # accelerate's wrapper -> the optimizer it steps
        # Note [run.step() with a framework's optimizer wrapper]
        self.optimizer_wrapper_ = optimizer if optimizer is not None and self.optimizer is not optimizer else None
        self.wrappers_at_enter_ = None  # ids of accelerate's wrappers around the optimizer at __enter__
        self.inner_of_wrapper_ = None   # such a wrapper there before: run.step() bypasses it
        self.last_sig_same_ = False  # the last step's first forward with gradients had the plan's input signature
        self.planner = planner
        self.device = self._check_device(device) if device is not None else self._model_device(model)
        self.budget_spec = parse_budget(budget)  # None, int bytes, float fraction or "P%" (Note [Budgets])
        # the bytes as the user wrote them ("6GiB"), for refusals to echo; None for every other form
        self.budget_written_ = budget.strip() if isinstance(budget, str) and isinstance(self.budget_spec, int) else None
        self.profile = profile
        # Note [Profiling a step that does not fit]
        self.profile_offload = profile == "offload" or (profile == "auto" and isinstance(self.budget_spec, int))
        self.profile_stats = None                # ProfiledStepStats of the last profiled step
        self.budget_note_ = ""                   # how a fraction was resolved, when run.report() should say
        self.host_limit_note_ = ""               # the plan run instead of the planner's, for host_memory_limit
        self.prefetch_note_ = ""                 # prefetches the plan starts later than planned (prefetch_fit.py)
        # planner/simulator device model: the "cpu" preset on CPU; on CUDA the default preset
        # unless the caller passes a measured one (memsched.measure_device()).
        self.device_model = device_model if device_model is not None else ("cpu" if self.device.type == "cpu"
                                                                            else None)
        if min_offload_bytes is None:
            min_offload_bytes = _DEFAULT_MIN_BYTES_CUDA if self.device.type == "cuda" else 0
        self.min_offload_bytes = parse_bytes(min_offload_bytes, name="min_offload_bytes")
        self.max_reprofiles = max_reprofiles
        self.max_shape_plans = max_shape_plans  # See Note [One plan per input shape]
        self.grad_accumulation_steps = grad_accumulation_steps
        self.timeline = bool(timeline)
        # Note [Compiled modules run plainly]
        self.compiled_why_ = compiled_module_reason(model)
        if self.compiled_why_:
            warnings.warn(f"memsched.optimize: {self.compiled_why_}; compiled modules run plainly under "
                          "memsched (no profile, no plan, no offload, no out-of-order backward): the compiled "
                          "graph saves other tensors for backward than the eager forward a profile sees, so no "
                          "step would match the plan. Pass the module before torch.compile() to offload its "
                          "activations", RuntimeWarning, stacklevel=user_stacklevel())
        self.ooo_ = None
        _check_optimizer_owns_model(model, self.optimizer)  # Note [An optimizer over another model]
        if (ooo or fuse_optimizer) and not self.compiled_why_:
            self.ooo_ = self._make_ooo(fuse_optimizer)
        self.fuse_optimizer = bool(fuse_optimizer)
        limit, limit_text = parse_host_limit(host_memory_limit)  # See Note [Host memory limit]
        self.host = HostBuffers(pinned=self.device.type == "cuda", limit_bytes=limit, limit_text=limit_text)
        self.profile_saves_ = None   # OffloadedSaves of the profiled steps, made at the first one
        self.executor = OffloadExecutor(model, self.device, self.host, min_bytes=self.min_offload_bytes,
                                        on_mismatch=self._on_label_mismatch, timeline=self.timeline)
        # Note [optimizer.step() without run.step()] (step_hook.py)
        self.step_hook_ = (OptimizerStepHook(self.optimizer, self._framework_step, self.optimizer_wrapper_)
                           if isinstance(self.optimizer, torch.optim.Optimizer) else None)
        self.trace = None            # memsched.Trace of the last profiled step
        self.plan = None             # the plan executed now (None: keep everything)
        self.schedule = None         # OffloadSchedule of self.plan
        self.node_of_op_ = {}        # the profiled step's backward op -> autograd node offset
        self.forward_starts_ = None  # the profiled step's forwards with grad enabled: their first op ids
        self.unmodeled_bytes_ = 0    # device memory no traced tensor explains, at the profiled peak
        self.profiled_update_due_ = False  # the profiled step's update is next (Note [Where the peak went])
        self.profiled_update_peak_ = None  # its device peak (accelerator), None until read
        self.step_thread_ = None     # thread of this step's first forward (Note [One thread per step])
        self.simulation = None       # memsched.simulate() result for (trace, plan)
        # See Note [One plan per input shape] (offload/shape_plans.py)
        self.plans_ = {}             # step signature -> the fields of its plan (PLAN_FIELDS)
        self.plan_sig_ = None        # the signature of the current plan's profiled step
        self.profile_sig_ = None     # ... of the open profile's step
        self.plan_sigs_ = ()         # the signatures of each forward with gradients of the plan's step
        self.profile_sigs_ = []      # ... of the open profile's step
        self.plan_index_ = 0         # the current plan: its profile's number (StepStats.plan_index)
        self.shape_profiles = 0      # COUNT of profiles of a step with new input shapes
        self.shape_profile_from_ = None  # while one is open: the signature of the plan it left
        self.budget_bytes = None     # resolved budget, bytes (None: no budget)
        self.step_stats = collections.deque(maxlen=history)  # StepStats of the last `history` executed steps
        self.steps_planned = 0       # COUNT of executed steps that ran the plan (all of them, not just kept)
        self.plan_checked_ = False   # a step of the current plan passed its budget check (Note [A budget the guard cannot meet])
        self.steps_plain = 0         # COUNT of executed steps that ran plainly (a mismatch)
        self.compiled_steps_ = 0     # COUNT of run.step() of a compiled model (Note [Compiled modules run plainly])
        self.steps_profiled = 0      # COUNT
        self.reprofiles = 0          # COUNT of re-profiles after a mismatch
        self.reprofile_why_ = ""     # the mismatch that armed the open re-profile (named if it is refused)
        self.cast_warmup_profiles_ = 0  # COUNT of profiles dropped as ooo began deferring under autocast
        self.unused_forward_profiles_ = 0  # COUNT of profiles dropped for a forward no backward read
        self.mismatches = 0          # COUNT of steps that did not match the trace
        self.accumulation_mismatches_ = 0  # COUNT of those whose mismatch came at a later forward of other shapes
        self.steps_without_room_ = 0  # COUNT of steps of new shapes past max_shape_plans (Note [One plan per ...])
        self.mismatch_run_ = 0       # consecutive mismatching steps (Note [A lone mismatching step])
        self.reprofiles_denied_ = 0  # COUNT of re-profiles due but past max_reprofiles
        self.warned_ = False
        self.warned_not_profiled_ = False
        self.warned_not_profiled_why_ = ""
        self.not_profiled_why_ = ""  # why this step's forward could not be profiled ("" if it could)
        self.steps_not_profiled = 0  # COUNT of steps run plainly because profiling them was unsafe
        self.profile_ = None         # profiler session while profiling
        self.profile_armed_ = False  # the next forward starts a profiler session
        self.profile_iterations_ = 0  # ooo's completed backward passes when the open profile began
        self.forwards_since_boundary_ = 0  # root forwards since the last run.step() / optimizer.step()
        self.grad_forwards_ = 0            # ... of them with gradients enabled
        self.boundary_was_framework_step_ = False  # the last boundary was the loop's optimizer.step()
        self.eval_grad_forward_ = False    # this step ran a forward in eval mode with gradients enabled
        self.other_shape_forward_ = None   # (n, signature): this step's n-th forward had other input shapes than
                                           #   the plan's step (Note [One plan per input shape]); named on a mismatch
        self.forward_in_backward_ = False  # a forward of the model ran inside a backward pass (a reentrant
                                           # checkpoint around the whole model recomputes it there)
        self.profile_eval_grad_ = False    # ... and so did the step the plan was profiled from
        self.profile_forward_in_backward_ = False  # the profiled step's forward_in_backward_
        self.warned_second_update_ = False
        self.warned_other_optimizer_ = False  # Note [Another optimizer over the Run's parameters]
        self.own_hook_ids_ = []      # its global pre-hook's id in ooo.fused.OWN_GLOBAL_PRE_HOOKS
        self.in_own_step_ = 0        # > 0 inside the Run's optimizer's own step (same Note)
        self.profile_failed_ = False # the profiled forward raised: restart at the next forward
        self.profile_forwards_ = 0   # COUNT forwards recorded by the open profile (Note [A step with no end])
        self.state_at_profile_ = None  # optimizer state bytes when the open profile started
        self.state_check_ = None     # ... of the profile just planned: compared after its update
        self.optimizer_state_extra_ = 0  # bytes of optimizer state the trace lacks (Note [Optimizer state
                                         #   the profiled step did not see])
        self.in_forward_ = False     # between the root's forward pre-hook and forward hook
        self.unfinished_forwards_ = 0  # forwards of a first profile that never reached a step boundary
        self.handles_ = []           # Run's own hooks on the root module
        self.entered_ = False

    # -- context manager ---------------------------------------------------------------------------
    def __enter__(self):
        if self.entered_:
            raise RuntimeError("memsched.optimize(): this Run is already active; create a new one")
        self.entered_ = True
        if self.compiled_why_:
            return self  # Note [Compiled modules run plainly]: nothing installed; run.step() steps the optimizer
        try:
            # See Note [Copies of a model under memsched] (copy_inert.py)
            self.handles_ = [self.model.register_forward_pre_hook(inert_on_copy(self._root_pre), with_kwargs=True),
                             self.model.register_forward_hook(inert_on_copy(self._root_post), always_call=True)]
            self.executor.install()
            if self.ooo_ is not None:
                self.ooo_.install()
            # a Run entered again profiles anew: the model may have changed in between (unfrozen layers)
            self.plans_, self.plan_sig_ = {}, None  # See Note [One plan per input shape]
            if self.step_hook_ is not None:
                if self.step_hook_.on_step is None:  # entered again after __exit__, whose remove() let go of us
                    self.step_hook_ = OptimizerStepHook(self.optimizer, self._framework_step, self.optimizer_wrapper_)
                if self.optimizer_wrapper_ is None:
                    # See Note [run.step() with a framework's optimizer wrapper]: a wrapper there now is re-pointed
                    # at the routing (a GradScaler's kept step methods), never stepped by run.step()
                    around = accelerate_wrappers(self.optimizer)
                    self.wrappers_at_enter_ = {id(w) for w in around}
                    self.step_hook_.wrapper = around[-1] if around else None
                self.step_hook_.install()
                self._watch_other_optimizers()
            self._start_profiling()
        except BaseException:
            self._cleanup()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and self.profile_ is not None and self.steps_profiled == 0 and self.profile_forwards_:
            # Note [A step with no end]: the Run ends before its first step boundary; nothing was planned
            self.unfinished_forwards_ = self.profile_forwards_
            warnings.warn(f"memsched.optimize: the Run ended while its first step was still being profiled "
                          f"({counted(self.profile_forwards_, 'forward')}, no step boundary), so nothing was "
                          f"planned or offloaded. {_STEP_BOUNDARY_FIX}", RuntimeWarning, stacklevel=user_stacklevel())
        self._cleanup()
        return False

    # Note [Another optimizer over the Run's parameters]
    #   Rationale: a loop that makes a new optimizer for the same model inside the Run (a fine-tuning
    #   phase with another learning rate) steps parameters the Run's optimizer also holds. memsched's
    #   step boundary is the optimizer given to optimize(), so no boundary came any more: nothing was
    #   planned or offloaded for the rest of training, with only a mismatch warning; and with the fused
    #   update the old optimizer (its lr and state) updated the model inside every backward, while the
    #   new one found the gradients freed: 9e-3 off plain, without a word (found by a helper probing Run
    #   lifecycles).
    #   Approach: while the Run is entered, a global optimizer step pre-hook (torch.optim's own
    #   register_optimizer_step_pre_hook) looks at every other optimizer's step(): one holding a
    #   parameter the Run's optimizer holds is refused with the fused update (it would step what the
    #   fused update already stepped: say so before it does), and warned about once without it. An
    #   optimizer over other parameters (a second optimizer for the head) is the caller's business.
    #   The fused update's own steps (a view of a group, inside backward) pass.
    def _watch_other_optimizers(self):
        from memsched.ooo.fused import OWN_GLOBAL_PRE_HOOKS

        ref = weakref.ref(self)
        held = {id(p) for g in self.optimizer.param_groups for p in g["params"]}

        def pre_hook(opt, args, kwargs):
            run = ref()
            if run is None or opt is run.optimizer or (run.ooo_ is not None and run.ooo_.updating) \
                    or torch_optimizer(opt) is run.optimizer or run.in_own_step_:
                # its own step, a wrapper of it (accelerate's), or an optimizer its step steps (Lookahead's
                # inner one, ZeroRedundancyOptimizer's local one)
                return None
            if any(id(p) in held for g in opt.param_groups for p in g["params"]):
                run._other_optimizer(opt)
            return None

        from torch.optim.optimizer import register_optimizer_step_pre_hook

        handle = register_optimizer_step_pre_hook(pre_hook)
        OWN_GLOBAL_PRE_HOOKS.add(handle.id)
        self.handles_.append(handle)
        self.own_hook_ids_.append(handle.id)

    @contextlib.contextmanager
    def _own_step(self):
        """The Run's optimizer's own step: the optimizers it steps inside are not others."""
        self.in_own_step_ += 1
        try:
            yield
        finally:
            self.in_own_step_ -= 1

    def _other_optimizer(self, opt):
        what = (f"another optimizer ({type(opt).__name__}) steps parameters that the optimizer given to "
                f"memsched.optimize ({type(self.optimizer).__name__}) holds")
        if self.fuse_optimizer:
            raise _C.MemschedError(
                f"{what}: with fuse_optimizer=True memsched updated them inside backward with the optimizer it was "
                f"given (its learning rate and state) and freed their gradients, so this step would find none. "
                f"A new optimizer needs a Run of its own: leave the `with` block and enter "
                f"memsched.optimize(model, new_optimizer, ...) (the last backward pass's update stays applied)")
        if not self.warned_other_optimizer_:
            self.warned_other_optimizer_ = True
            warnings.warn(
                f"memsched.optimize: {what}: memsched's step boundary is the optimizer it was given, so from here "
                f"on it sees no step end and plans, offloads and recomputes nothing (gradients stay plain's). A "
                f"new optimizer needs a Run of its own: leave the `with` block and enter memsched.optimize(model, "
                f"new_optimizer, ...). Warned once", RuntimeWarning, stacklevel=user_stacklevel())

    def _cleanup(self):
        """Remove every hook and session; safe to call twice and after a partial __enter__."""
        self._abort_profile()
        self.profile_armed_ = False
        if self.step_hook_ is not None:
            self.step_hook_.remove()
        for h in self.handles_:
            h.remove()
        self.handles_ = []
        if self.own_hook_ids_:
            from memsched.ooo.fused import OWN_GLOBAL_PRE_HOOKS
            OWN_GLOBAL_PRE_HOOKS.difference_update(self.own_hook_ids_)
            self.own_hook_ids_ = []
        if self.ooo_ is not None:
            self.ooo_.remove()
        self.executor.remove()
        if self.profile_saves_ is not None:
            self.profile_saves_.finish()
        self.entered_ = False

    # -- the user's step ----------------------------------------------------------------------------
    def step(self):
        """End the current step: plan after a profiled step, run optimizer.step() and zero_grad()."""
        if not self.entered_:
            raise RuntimeError("run.step(): call it inside `with memsched.optimize(...) as run:`")
        if self.wrappers_at_enter_ is not None and self.step_hook_ is not None:
            self._adopt_wrapper_made_since_enter()
        if self.optimizer_wrapper_ is not None and self.step_hook_ is not None:
            # Note [run.step() with a framework's optimizer wrapper]
            #   Rationale: run.step() stepped the torch optimizer inside accelerate's AcceleratedOptimizer
            #   directly, past the wrapper's decisions: under accelerator.accumulate() it updated at every
            #   micro-batch, and with a GradScaler it updated with scaled gradients and never called
            #   scaler.update() (9.84 off plain after 4 SGD steps; found by a helper following the README in
            #   an accelerate loop).
            #   Approach: with a wrapper, run.step() is the wrapper's step() and zero_grad(), as the loop
            #   would call them; the wrapper's inner step() is routed through the Run (Note [optimizer.step()
            #   without run.step()] in step_hook.py), which ends the memsched step there -- on the
            #   micro-batch that ends an accumulation.
            #   Given the torch optimizer itself, the Run notes at __enter__ the AcceleratedOptimizers
            #   around it, and the first run.step() adopts one made since (optimize() entered before
            #   accelerator.prepare()). One that was there before -- the loop passed the optimizer inside
            #   it, or an earlier run's wrapper is still alive -- is not trusted: run.step() is the
            #   optimizer's own step, refused where that wrapper would not step as it does (a GradScaler,
            #   mid-accumulation), naming the fix (found by a helper reviewing the change: a stale fp16
            #   wrapper unscaled a later fp32 loop's gradients).
            self._warn_second_update()
            self.optimizer_wrapper_.step()
            self.optimizer_wrapper_.zero_grad()
            return
        if self.inner_of_wrapper_ is not None:
            self._check_bypassed_wrapper()
        if self.ooo_ is not None:
            self._check_run_step_accumulation()
        self._warn_second_update()
        stats = self._finish_step()
        self._check_budget_held(stats)
        profiled_update = self._measured_update(stats, self._optimizer_step)
        self._account_optimizer_state()
        if stats is not None:
            self._record_step(stats)
        if self.compiled_why_:
            self.compiled_steps_ += 1  # ran plainly: run.report() counts it so
        if profiled_update:
            self._check_update_within_budget()

    def _adopt_wrapper_made_since_enter(self):
        """See Note [run.step() with a framework's optimizer wrapper]: once, at the first run.step()."""
        before, self.wrappers_at_enter_ = self.wrappers_at_enter_, None
        now = accelerate_wrappers(self.optimizer)
        made = [w for w in now if id(w) not in before]
        if made:
            self.optimizer_wrapper_ = made[-1]
            self.step_hook_.wrapper = made[-1]
        elif now:
            self.inner_of_wrapper_ = now[-1]

    def _check_bypassed_wrapper(self):
        why = accelerate_would_not_step(self.inner_of_wrapper_)
        if why:
            raise _C.MemschedError(
                f"run.step(): memsched.optimize() was given the torch optimizer inside an accelerate "
                f"AcceleratedOptimizer that existed before the Run was entered, so run.step() steps it directly; "
                f"but {why}. Nothing was changed. Pass the optimizer accelerator.prepare() returned to "
                f"memsched.optimize() (run.step() is then its step() and zero_grad()), or call that optimizer's "
                f"step() and zero_grad() instead of run.step(); a wrapper left from a training that is over holds "
                f"on to this optimizer until it and its Accelerator are dropped")

    def _warn_second_update(self):
        """run.step() right after the loop's own optimizer.step() (no forward in between, gradients still
        there) runs optimizer.step() again: a second update with the same gradients, as plain PyTorch
        would do for `opt.step(); opt.step()`. Almost always a loop that calls both; said once."""
        forwards, self.forwards_since_boundary_ = self.forwards_since_boundary_, 0
        after_framework_step, self.boundary_was_framework_step_ = self.boundary_was_framework_step_, False
        if (forwards or self.warned_second_update_ or self.optimizer is None or self.fuse_optimizer
                or self.compiled_why_):  # a compiled model runs plainly: no hook counts its forwards
            return
        if not any(p.grad is not None for g in self.optimizer.param_groups for p in g["params"]):
            return
        self.warned_second_update_ = True
        if not after_framework_step:
            # gradients, no forward of the model and no optimizer.step() since the last boundary: the loop
            # called the model's submodules itself (found by a helper: `for layer in model: x = layer(x)`)
            warnings.warn("memsched.optimize: run.step() found gradients, but the wrapped model's forward did not "
                          "run since the last step boundary: the loop called its submodules (or its parameters) "
                          "directly, as `for layer in model: x = layer(x)` or `model.encoder(x)` do, so memsched "
                          "saw no forward pass and profiles, plans and offloads nothing; the steps run plainly. "
                          "Call the model itself, or wrap in memsched.optimize the module the loop calls. Warned "
                          "once", RuntimeWarning, stacklevel=user_stacklevel())
            return
        warnings.warn("memsched.optimize: run.step() was called with no forward pass since the last step boundary "
                      "(an optimizer.step() of the loop, which memsched routes as one): run.step() runs "
                      "optimizer.step() and zero_grad() itself, so this is a second update with the same "
                      "gradients. Call either run.step() or optimizer.step() once per step, not both",
                      RuntimeWarning, stacklevel=user_stacklevel())

    def _framework_step(self, step, args, kwargs):
        """optimizer.step(*args, **kwargs) called by the caller's loop instead of run.step(); `step`
        is the optimizer's own. See Note [optimizer.step() without run.step()] in step_hook.py."""
        if self.ooo_ is not None and self.ooo_.updating:
            return step(*args, **kwargs)  # the fused update's own call (fused.py's view path), inside backward
        closure, args, kwargs = split_closure(args, kwargs)
        check_closure_optimizer(self.optimizer, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.ooo_ is not None:
            self._check_framework_accumulation()
        self.forwards_since_boundary_ = 0
        self.boundary_was_framework_step_ = True
        stats = self._finish_step()
        self._check_budget_held(stats)

        def update():
            nonlocal loss
            if self.ooo_ is None or self.ooo_._end_micro_step(False):  # the loop zeroes itself
                with self._own_step():
                    out = step(*args, **kwargs)
                loss = out if closure is None else loss
            # else: the fused update ran during backward (as run.step() skips optimizer.step() then)

        if is_skipped_update(step):
            # a step GradScaler skipped (Note [A step GradScaler skipped] in step_hook.py): no update ran, so
            # the checks of the first update's memory and optimizer state wait for one that does (found by a
            # helper: the state check was spent here and a byte budget never counted the state)
            update()
            if stats is not None:
                self._record_step(stats)
            return loss
        profiled_update = self._measured_update(stats, update)
        self._account_optimizer_state()
        if stats is not None:
            self._record_step(stats)
        if profiled_update:
            self._check_update_within_budget()
        return loss

    def _check_run_step_accumulation(self):
        """With ooo, run.step() follows every backward pass (a micro-step) or exactly grad_accumulation_steps
        of them, ending an accumulation: the update follows that setting, and a loop that accumulated
        another number of passes got its update at the wrong pass, silently (grad_accumulation_steps=3 with
        two passes per run.step(): one update per six passes, 1.7e-2 off plain; found by a helper probing
        compositions). Refused before anything changes, as the loop's own optimizer.step() is."""
        k, n = self.grad_accumulation_steps, self.ooo_.backward_passes_since_step
        if n <= 1 or (n == k and self.ooo_.micro_steps % k == 0):
            return
        raise _C.MemschedError(
            f"run.step() was called after {n} backward passes since the last step, but "
            f"memsched.optimize(..., grad_accumulation_steps={k}) expects run.step() after every backward pass "
            f"or once per {k} (ending an accumulation): with ooo=True / fuse_optimizer=True the update follows "
            f"grad_accumulation_steps. Pass grad_accumulation_steps={n} if the loop accumulates {n} backward "
            f"passes per optimizer step")

    def _check_framework_accumulation(self):
        """With ooo, optimizer.step() from the caller's loop must come after exactly
        grad_accumulation_steps backward passes: the fused update (or ooo's step count) follows
        that setting, the caller's loop its own. Refused before anything changes."""
        k, n = self.grad_accumulation_steps, self.ooo_.backward_passes_since_step
        if n != k and n != 0 and accelerate_end_of_dataloader():
            # accelerate syncs at the end of its dataloader: a shorter last accumulation (found by a helper)
            raise _C.MemschedError(
                f"optimizer.step() was called after {n} backward pass(es) where grad_accumulation_steps={k}: "
                f"accelerate ends an accumulation at the end of its dataloader, so an epoch whose batch count is "
                f"no multiple of {k} ends with a shorter one, which the out-of-order backward (ooo=True / "
                f"fuse_optimizer=True) cannot update after: its update follows grad_accumulation_steps. Nothing "
                f"was changed by this step. Make the number of batches per epoch a multiple of {k} (the dataset's "
                f"size, the batch size or a sampler), or use ooo=False, fuse_optimizer=False")
        if n != k and n != 0:  # n == 0: gradients set by hand (torch.autograd.grad): a plain step
            raise _C.MemschedError(
                f"optimizer.step() was called after {n} backward pass(es) since the last optimizer step (or "
                f"optimizer.zero_grad() at a step boundary), but "
                f"memsched.optimize(..., grad_accumulation_steps={k}) expects {k}: with ooo=True / "
                "fuse_optimizer=True the update follows grad_accumulation_steps, so it must equal the "
                "training loop's gradient accumulation (the memsched callbacks for transformers and "
                "Lightning pass the trainer's own setting). A micro-batch the loop skipped without a backward "
                "pass (a Lightning training_step that returned None) leaves fewer passes too: with ooo/"
                "fuse_optimizer every micro-batch of an accumulation needs its backward, or use ooo=False, "
                "fuse_optimizer=False for such a loop")

    def _finish_step(self):
        """The step boundary before the update: stop the profile and plan, or end the executed step.
        Returns the executed step's StepStats (None for a profiled or not-profiled step)."""
        self._check_step_thread()
        self.step_thread_ = None
        if self.profile_ is not None:
            session, self.profile_ = self.profile_, None
            trace = session.stop()
            self.node_of_op_ = session.node_of_op
            self.forward_starts_ = getattr(session, "forward_starts", None)  # Note [Forwards that save nothing]
            self.unmodeled_bytes_ = getattr(session, "unmodeled_bytes", 0)  # Note [Memory the trace does not model]
            self.steps_profiled += 1
            if self.ooo_ is not None and (self.ooo_.cast_deferral_pending() or
                                          self.ooo_.cast_deferral_began_since(self.profile_iterations_)):
                # See Note [Deferred calls under autocast] (ooo/backward.py): from the next step on, layers this
                # step ran through autograd under autocast are deferred, and save other tensors; a plan of this
                # trace would not match them (two plain steps and a re-profile). Profile the next step instead.
                # With gradient accumulation the deferral may begin inside this step, at its second micro-batch:
                # the trace then mixes both (found by fuzzing).
                self.cast_warmup_profiles_ += 1
                self._start_profiling()
                return None
            if self.unused_forward_profiles_ < 2 and _a_forward_no_backward_read(trace, self.forward_starts_):
                # See Note [A profiled forward that no backward read]: profile the next step instead
                self.unused_forward_profiles_ += 1
                self._start_profiling()
                return None
            self.profile_eval_grad_ = self.eval_grad_forward_  # named if later steps do not match it
            self.profile_forward_in_backward_ = self.forward_in_backward_  # likewise
            # this trace holds the state that existed at its start; what the update will add is
            # predicted for the optimizers we know (Note [Optimizer state the profiled step did not see])
            self.optimizer_state_extra_ = self._predicted_state_bytes()
            self.profile_stats = self._profiled_step_stats(session)
            why, self.reprofile_why_ = self.reprofile_why_, ""
            try:
                self._adopt_trace(trace)
            except _C.MemschedError as e:
                self._refused_profile()
                back, self.shape_profile_from_ = self.shape_profile_from_, None
                if back is not None and back in self.plans_:
                    # a step of new shapes that no plan fits: the other shapes keep their plans (Note [One plan
                    # per input shape]); the next step of these shapes is profiled again, and refused again
                    self.profile_armed_ = False
                    self._load_plan(back, self.plans_.pop(back))
                    self.reprofile_why_ = ""
                    raise _C.MemschedError(
                        f"memsched: a step with new input shapes ({describe(self.profile_sig_)}) was profiled, and it "
                        f"cannot be planned within the budget: {e}. The steps of the shapes planned before keep "
                        f"their plans; give the budget it names, or keep such batches out (a shorter maximum "
                        f"length){self._distributed_caution()}") from e
                if not why:
                    raise
                self.reprofile_why_ = why  # the next profile is this one again
                # a budget accepted at the first step, refused for the step as it is now: say why it changed
                cause = ""
                if self.eval_grad_forward_:
                    # the commonest cause (found by a helper): a validation forward without no_grad, whose
                    # graph the loop keeps until its next one, so its saves count as this step's
                    cause = ("; this step ran the model in eval mode (model.eval()) with gradients enabled, a "
                             "validation forward whose saves count as the step's: run it under torch.no_grad() "
                             "(or torch.inference_mode()) and the step is the one the budget was accepted for")
                cause += self._distributed_caution()
                raise _C.MemschedError(
                    f"memsched: the training step changed after its budget was accepted ({why}), so it was "
                    f"profiled again, and the new step cannot be planned within the budget: {e}{cause}") from e
            except BaseException:
                self._refused_profile()
                raise
            # Note [Where the peak went]: its update's peak is read -- armed only once the plan stands:
            # a refused step runs no update, and a later step not profiled must not be checked as this one
            self.profiled_update_due_ = True
            self.plan_checked_ = False  # a new plan: its first planned step is checked (a re-profile too)
            self.plan_index_ = self.steps_profiled
            self.shape_profile_from_ = None
            # See Note [One plan per input shape]: a re-profile replaces the plan of its shapes; a profile
            # with no forward with gradients has no shapes to file its plan under: one plan from here on
            if self.profile_sig_ is not None:
                self.plans_.pop(self.profile_sig_, None)
            else:
                self.plans_.clear()
            if self.plan_sig_ in self.plans_:  # the plan in use until now goes last
                self.plans_[self.plan_sig_] = self.plans_.pop(self.plan_sig_)
            self.plan_sig_ = self.profile_sig_
            self.plan_sigs_ = tuple(self.profile_sigs_)
            while self.plans_ and len(set(self.plans_) | {self.plan_sig_}) > self.max_shape_plans:
                del self.plans_[next(iter(self.plans_))]  # a re-profile's new shapes at the cap: the least recent goes
            self.state_check_ = self.state_at_profile_
            return None
        if self.profile_armed_:
            # no forward since the last step, or its forward could not be profiled (foreign hooks):
            # nothing recorded, nothing executed
            if self.not_profiled_why_:
                self.steps_not_profiled += 1
                self.not_profiled_why_ = ""
            return None
        return self.executor.end_step()

    @staticmethod
    def _distributed_caution():
        """Each process plans its own steps (a batch of new shapes may come to one rank only)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            return ("; under torch.distributed the other processes may have taken this step: do not go on after "
                    "this error, whose process did not (their replicas would differ); start again with the least "
                    "budget it names")
        return ""

    def _refused_profile(self):
        """No plan for this budget: the optimizer did not step (nor did a fused update: the profiled step
        updates after backward, Note [The profiled step updates after backward]), and the step's gradients
        are dropped (set to None, as run.step() leaves them after every step), so a retry with the budget
        the error names trains as plain PyTorch would. The next step is profiled again -- and refused
        again -- rather than run plainly without a word.
        Out-of-order backward's step ends here too, or its next backward pass would count this one (an
        accumulation error)."""
        self._drop_gradients()
        if self.ooo_ is not None:
            self.ooo_.step()
        self._start_profiling()

    # Note [A budget the guard cannot meet]
    #   Rationale: a budget is a promise; the memory guard (Note [Memory guard] in
    #   csrc/torch/saved_tensor_offload.cpp) can only release copies in flight, so memory that no copy
    #   holds -- parameters, gradients, optimizer state, what the plan keeps, workspaces -- can still
    #   take a step over it. Training on silently over the budget would break the promise.
    #   Approach: where the peak is the device allocator's (CUDA), the first planned step of each plan
    #   (the first plan, and each one a re-profile makes) has its measured peak compared with the
    #   budget before its update runs; more than 2% over raises a MemschedError naming that peak as
    #   the least budget this step met. The update has not run, so parameters and optimizer state are
    #   as before the step. Later steps of a plan are only reported.
    #   Limitations: a plan's first planned step stands for its others (a longer sequence later can
    #   still go over; run.report() shows every step's peak).
    def _budget_held_note(self):
        """run.report()'s answer to "did the budget hold?" over the planned steps (Note [A budget the
        guard cannot meet]); "" without a budget or a planned step."""
        budget = self._budget_with_state()
        planned = [s for s in self.step_stats if s.mode == "planned"]
        if budget is None or not planned:
            return ""
        if not self._measures_device_peak():
            return ("budget held: not measured on this device (the allocator's peak is measured on CUDA); "
                    "the saved activations were, in 'peak saved activations' above")
        worst = max(s.peak_bytes for s in planned)
        # each step against the budget of the plan it ran (a fraction is re-resolved at a re-profile)
        held_to = [budget if s.budget_bytes is None else s.budget_bytes for s in planned]
        over = [s for s, b in zip(planned, held_to) if s.peak_bytes > b * 1.02]
        which = (f"the budget ({format_bytes(budget)})" if all(b == budget for b in held_to) else
                 f"the budget of the plan each ran (a re-profile re-resolved it; now {format_bytes(budget)})")
        if not over:
            return (f"budget held: yes, every planned step's peak (at most {format_bytes(worst)}, "
                    f"max_memory_allocated) within {which} + 2%")
        return (f"budget held: NO, {counted(len(over), 'planned step')} over {which} + 2%, "
                f"up to {format_bytes(max(s.peak_bytes for s in over))} (max_memory_allocated)")

    def _measured_update(self, stats, update):
        """Run `update` (the optimizer's step) and read the device peak it reaches (Note [Where the peak
        went] in offload/peak_gap.py): an executed step's peak then covers its update; a profiled step's
        update peak is what the plan expects of every update. Returns whether that was a profiled step's
        update, measured: the caller checks it against the budget once the step is booked
        (_check_update_within_budget)."""
        meter = self.executor.meter
        profiled, self.profiled_update_due_ = self.profiled_update_due_, False
        if self.fuse_optimizer:
            # the profiled step updates after backward (Note [The profiled step updates after backward]),
            # but every later update is fused: inside backward, its memory is the backward's
            profiled = False
        if profiled and meter is not None:
            meter.reset()  # the profiler restarted the peak at every op: the update's own from here
        update()
        if stats is not None:
            self.executor.measure_update(stats)
        elif profiled and meter is not None:
            self.profiled_update_peak_ = meter.peak()
            return True
        return False

    def _check_update_within_budget(self):
        """The profiled step's optimizer update against the budget (Note [A budget the guard cannot
        meet]): no plan moves an update's memory, so an update above the budget fails every step. A
        budget in bytes is a promise: refused, naming the least that works. A fraction or percentage is
        of the saved activations' memory, which the update is not: it warns, as out-of-order backward
        does, and run.report() shows the update as the gap."""
        if self.budget_bytes is None or not self._measures_device_peak():
            return
        budget, peak = self._budget_with_state(), self.profiled_update_peak_
        if peak <= budget * 1.02:
            return
        what = (f"budget {self._budget_as_written()!r} ({format_bytes(budget)}): the optimizer update (optimizer.step()) "
                f"of the profiled step peaked at {format_bytes(peak)} of device memory "
                f"({100.0 * (peak - budget) / budget:.1f}% over; max_memory_allocated): parameters, gradients, "
                f"optimizer state and the update's temporaries, which no plan of saved activations lowers")
        fix = ("a fused optimizer (torch.optim.AdamW(..., fused=True)) or memsched.optimize(..., "
               "fuse_optimizer=True) updates with fewer temporaries")
        if self.ooo_ is not None or not isinstance(self.budget_spec, int):
            # out-of-order backward warns (Note [A budget the guard cannot meet]); so does a budget that
            # is a share of the activations, which the update is not
            warnings.warn(f"memsched.optimize: {what}; every step will peak there, above the budget. {fix}",
                          RuntimeWarning, stacklevel=user_stacklevel())
            return
        raise _C.MemschedError(
            f"{what}. This step completed (profiled, updated as plain PyTorch would). The least budget the "
            f"update meets is {peak} bytes ({format_bytes(peak)}): raise the budget to at least that, or use {fix}")

    def _peak_gap(self):
        """PeakGap of the executed step with the highest measured peak (Note [Where the peak went]);
        None off the device or without a plan."""
        if not self._measures_device_peak():
            return None
        planned = self.planned_figures().get("peak_bytes")
        # the last `history` steps of this plan: those of a plan before a re-profile are not held to it
        steps = [s for s in self._this_plans_steps() if s.mode == "planned"]
        if not planned or not steps:
            return None
        return explain_peak_gap(planned, max(steps, key=lambda s: s.peak_bytes))

    def _gap_of(self, stats):
        """explain_peak_gap's lines for one planned step, one line; "" where there is nothing to explain."""
        planned = self.planned_figures().get("peak_bytes")
        if not planned or stats.phase_peaks is None:
            return ""
        return " ".join(line.strip() for line in str(explain_peak_gap(planned, stats)).splitlines())

    def _drop_gradients(self):
        """A refused step's gradients go (set to None, as run.step() leaves them after every step), so a
        retry with the budget the error names trains as plain PyTorch would."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)
        if self.ooo_ is not None:
            self.ooo_.forget_discarded_pass()  # memsched's drop, not the loop's (Note [Backward passes whose ...])

    def _measures_device_peak(self):
        return self.device.type == "cuda"

    def _check_budget_held(self, stats):
        """Note [A budget the guard cannot meet]."""
        if (stats is None or stats.mode != "planned" or self.plan_checked_ or self.budget_bytes is None
                or not self._measures_device_peak()):
            return
        budget = self._budget_with_state()
        if stats.peak_bytes <= budget * 1.02:
            return
        over = 100.0 * (stats.peak_bytes - budget) / budget
        what = (f"budget {self._budget_as_written()!r} ({format_bytes(budget)}): the first planned step peaked at "
                f"{format_bytes(stats.peak_bytes)} of device memory ({over:.1f}% over; max_memory_allocated) "
                + (f"although the memory guard released {counted(stats.guard_releases, 'copy', 'copies')} in flight"
                   if stats.guard_releases else "with no copy in flight for the memory guard to release")
                + "; memory that no copy holds (parameters, gradients, optimizer state, what the plan keeps, "
                f"workspaces) needs more. The least budget this step met is {stats.peak_bytes} bytes "
                f"({format_bytes(stats.peak_bytes)}): raise the budget to at least that")
        gap = self._gap_of(stats)
        if gap:  # where the peak came and what the plan did not count: the next fix starts there
            what += f". Where it went: {gap}"
        if self.ooo_ is not None:
            # out-of-order backward has updated (fused) or counts this step already: warn, train on
            warnings.warn(f"memsched.optimize: {what} (Note [A budget the guard cannot meet])", RuntimeWarning,
                          stacklevel=user_stacklevel())
            return
        self._stamp_plan(stats)
        self.step_stats.append(stats)  # run.report() shows it; plan_checked_ stays False, so the next step checks too
        # as a refused plan does: the step's gradients are dropped, so a retry trains as plain PyTorch
        self._drop_gradients()
        raise _C.MemschedError(f"{what}. The optimizer update of this step did not run and its gradients were "
                               "dropped (Note [A budget the guard cannot meet])")

    def _stamp_plan(self, stats):
        """Which plan `stats`' step ran and its budget: after a re-profile (a lasting change) run.report()
        holds each step to its own plan's figures, not the new plan's."""
        stats.plan_index, stats.budget_bytes = self.plan_index_, self._budget_with_state()

    def _record_step(self, stats):
        """Book an executed step once its update ran."""
        self._stamp_plan(stats)
        self.executor.stamp(stats)  # no host wait: See Note [No host synchronisation in a step]
        if self.profile_saves_ is not None:
            self.profile_saves_.release_done()  # host blocks the profiled step's last fetches read
        if self.step_stats:
            self.step_stats[-1].try_resolve()
        self.step_stats.append(stats)
        if stats.mode == "diverged" and self._nothing_to_match() and stats.label_mismatch:
            stats.mode, stats.mismatch = "planned", ""  # See Note [Nothing to match under budget=None]
        if stats.mode == "diverged" or self._count_mismatch(stats):
            self.mismatches += 1
            self.mismatch_run_ += 1
            if self.mismatch_run_ >= 2:  # Note [A lone mismatching step]
                self.mismatch_run_ = 0
                if self.reprofiles < self.max_reprofiles:
                    self.reprofiles += 1
                    self.reprofile_why_ = stats.mismatch or "a step ran plainly"
                    self._start_profiling()
                else:
                    self.reprofiles_denied_ += 1
                    if self.reprofiles_denied_ == 1:
                        self._warn_reprofiles_spent(stats)
        elif stats.mode == "planned":
            self.mismatch_run_ = 0
        if stats.mode == "planned":
            self.steps_planned += 1
            self.plan_checked_ = True
        else:
            self.steps_plain += 1

    def _warn_reprofiles_spent(self, stats):
        """Steps keep changing after max_reprofiles re-profiles: from here on no plan runs. The mismatch
        warning came once, long before; this was said only in run.report() (found by a helper training a
        Hugging Face model on dynamically padded batches: 3 profiled, 0 planned, 5 plain steps). Said once."""
        shapes = "this step has" in (stats.mismatch or "") and self.budget_spec is not None  # (per-shape plans)
        # the inputs kept their shapes: the forward makes its shapes from their values (found by a helper: an
        # nn.LSTM over pack_padded_sequence with lengths that change every batch never ran its plan)
        micro_batch = shapes and self.other_shape_forward_ is not None
        inside = shapes and self.max_shape_plans > 1 and self.last_sig_same_ and not micro_batch
        warnings.warn(
            f"memsched.optimize: steps keep changing after {counted(self.reprofiles, 're-profile')} (max_reprofiles="
            f"{self.max_reprofiles}; the last: {stats.mismatch or 'a step ran plainly'}), so a step that does not "
            f"match its plan is not profiled again: it runs as plain PyTorch from the mismatch on (a plan is for "
            f"one step's shapes and control flow"
            + ("; a step of new input shapes is still profiled while max_shape_plans has room). "
               if self.budget_spec is not None else "). ")
            + (f"A later micro-batch of this step had other shapes than the plan's step had there: a step's plan "
               f"is chosen by its first forward, so with gradient accumulation every micro-batch of a step should "
               f"have the shapes of the first {_ACCUMULATION_FIX}, "
               if micro_batch else
               f"This step's inputs have the profiled step's shapes, so the forward makes other shapes from their "
               f"values (pack_padded_sequence over lengths that vary, a boolean mask, nonzero()): run the RNN over "
               f"the padded batch without packing, or bucket batches by length so that each shape recurs, "
               if inside else
               f"Batches whose shapes change from step to step get a plan per shape, up to {self.max_shape_plans} "
               f"(Note [One plan per input shape]); more distinct shapes (dynamic padding) need padding to a few "
               f"lengths (a Hugging Face collator's pad_to_multiple_of=..., or padding='max_length'), "
               if shapes else "")
            + "or pass optimize(..., max_reprofiles=N) to re-profile more often. Warned once", RuntimeWarning,
            stacklevel=user_stacklevel())

    def _optimizer_step(self):
        if self.ooo_ is not None and not self.ooo_.step():
            return  # fused: updated during backward (or a micro-step of gradient accumulation)
        if self.optimizer is not None:
            with self._own_step():
                if self.step_hook_ is not None:
                    with self.step_hook_.passing():  # run.step() is the step boundary: no second one
                        self.optimizer.step()
                else:
                    self.optimizer.step()
            fused = self.ooo_ is not None and self.fuse_optimizer  # the profiled step's update: unfused
            had = [i for i, p in enumerate(self.ooo_._params) if p.grad is not None] if fused else ()
            self.optimizer.zero_grad(set_to_none=True)
            if had:  # as the other steps' fused update frees them (Note [The profiled step updates after backward])
                self.ooo_.note_step_zeroed(had)

    def _count_mismatch(self, stats):
        """Fewer activations than the trace (a shorter control-flow path): mismatch, found at step end."""
        if self.schedule is None or stats.mode != "planned":
            return False
        if not stats.hooked or self._nothing_to_match():
            return self._outgrew_device(stats)  # (hooked for a timeline: Note [Nothing to match under budget=None])
        if stats.activations != len(self.schedule.labels):
            why = f"the step saved {counted(stats.activations, 'activation')}, the trace {len(self.schedule.labels)}"
            self._on_mismatch(why)
            stats.mode = "diverged"
            stats.mismatch = stats.mismatch or why  # the warning says it once; the step's stats each time
            return True
        return False

    def _outgrew_device(self, stats):
        """A step run without hooks (Note [A plan with nothing to do]) whose peak no longer fits the share of
        the device budget=None keeps everything within (Note [Budgets]): a mismatch, so that a lasting change
        is re-profiled and planned. Counted no saves: nothing else can be compared."""
        if not self._measures_device_peak():
            return False
        limit = _DEVICE_MEMORY_FRACTION * torch.cuda.get_device_properties(self.device).total_memory
        if stats.peak_bytes <= limit:
            return False
        why = (f"the step's peak ({format_bytes(stats.peak_bytes)}, max_memory_allocated) is above "
               f"{_DEVICE_MEMORY_FRACTION:.0%} of the device's memory, within which budget=None keeps every activation")
        self._on_mismatch(why)
        stats.mode = "diverged"
        stats.mismatch = stats.mismatch or why
        return True

    # -- profiling and planning ----------------------------------------------------------------------
    def _start_profiling(self):
        """Profile the next step: the session opens at its first forward (see _root_pre)."""
        self.executor.active = False
        self.profile_armed_ = True

    def _abort_profile(self):
        if self.profile_ is not None:
            session, self.profile_ = self.profile_, None
            abort = getattr(session, "abort", None)
            try:
                abort() if abort is not None else session.stop()
            except Exception:
                pass  # a half-recorded step has no valid trace; drop it

    def _check_step_thread(self):
        """Note [One thread per step]: PyTorch's saved-tensor hooks are per thread; memsched pushes
        them at a step's first forward and pops them at its end, so both must run on one thread.
        Refused before anything changes: the step can still be ended from the forward's thread."""
        here = threading.get_ident()
        if self.step_thread_ is not None and self.step_thread_ != here:
            raise _C.MemschedError(
                "run.step() (or optimizer.step()) runs on another thread than this step's forward: "
                "memsched's saved-tensor hooks are per thread (PyTorch keeps them in thread-local state), "
                "pushed at the step's first forward and popped at its end. Run the forward, backward and "
                "run.step() of a step on one thread (the data loading may use others)")

    def _root_pre(self, module, args, kwargs):
        if self.forwards_since_boundary_ == 0:
            self.eval_grad_forward_ = self.forward_in_backward_ = False
            self.other_shape_forward_ = None
            self.grad_forwards_ = 0
        self.forwards_since_boundary_ += 1
        if torch.is_grad_enabled():
            self.grad_forwards_ += 1  # the step's forwards with gradients: plan_sigs_ lists the plan step's
        if self.grad_forwards_ > 1 and self.other_shape_forward_ is None and self.plan_sig_ is not None \
                and torch.is_grad_enabled() and self.profile_ is None:
            # a later micro-batch: the plan was chosen by the first (Note [One plan per input shape])
            n = self.grad_forwards_
            sig = step_signature(args, kwargs)
            if sig is not None and n <= len(self.plan_sigs_) and sig != self.plan_sigs_[n - 1]:
                self.other_shape_forward_ = (n, sig, self.plan_sigs_[n - 1])
        if not module.training and torch.is_grad_enabled():
            self.eval_grad_forward_ = True  # part of this step's saves: named if the step mismatches
        if torch._C._current_graph_task_id() != -1:
            self.forward_in_backward_ = True  # named if the step mismatches
        if self.step_thread_ is None:
            self.step_thread_ = threading.get_ident()
        if self.in_forward_ or (self.profile_ is not None and (
                self.profile_failed_ or getattr(self.profile_, "backward_failed", False))):
            # The profiled forward raised (or a KeyboardInterrupt skipped our forward hook), or a
            # backward pass of the profiled step raised: that step's recording is incomplete.
            # Record this one instead.
            if self.profile_ is not None:
                self._abort_profile()
                self.profile_armed_ = True
        self.in_forward_ = True
        self.profile_failed_ = False
        if self.plan_sig_ is not None and self.budget_spec is not None and self.profile_ is None \
                and not self.profile_armed_ and torch.is_grad_enabled() \
                and (not self.executor.in_step_ or self.executor.saved_nothing()):
            # the step's first forward with gradients (an evaluation under no_grad may have begun the
            # executor's step; it saved nothing): See Note [One plan per input shape]
            sig = step_signature(args, kwargs)
            self.last_sig_same_ = sig == self.plan_sig_  # (a bool: the forward keeps no GC-tracked object)
            if sig is not None and sig != self.plan_sig_:
                self._plan_for_shape(sig)
        if self.profile_ is not None and self.profile_sig_ is None and torch.is_grad_enabled():
            self.profile_sig_ = step_signature(args, kwargs)  # the profiled step's first forward with gradients
        if self.profile_armed_ and self.profile_ is None:
            foreign = foreign_hooks_reason(check_dispatch_modes=True)
            if foreign is not None:
                # The session's hooks and mode would be pushed inside the caller's context and popped
                # outside it (Note [Foreign saved-tensor hooks]): profile a later step instead.
                self._warn_not_profiled(foreign)
                return
            self.profile_armed_ = False
            self.profile_forwards_ = 0
            self.profile_sig_ = step_signature(args, kwargs) if torch.is_grad_enabled() else None  # (or below)
            self.profile_sigs_ = []
            self.profile_iterations_ = self.ooo_.completed_iterations() if self.ooo_ is not None else 0
            self.state_at_profile_ = self._optimizer_state_bytes()
            if self.executor.engine.pending_count():
                # A re-profile after planned steps: their copies still in flight hold device blocks, and
                # nothing polls them while the executor rests, so the profiled step would measure them as
                # memory no tensor explains and every later plan would count it (Note [Memory the trace
                # does not model]). Wait for them now: re-profiles are rare, and this step is timed op by op.
                self.executor.engine.release()
            if self.device.type == "cuda":
                allocator.reset_cuda_peak(self.device)  # the profiled step's peak
            if self.profile_offload:
                self.profile_ = start_profile(self.model, self.optimizer, self.device, offload=self._saves())
            else:
                self.profile_ = start_profile(self.model, self.optimizer, self.device)
        if self.profile_ is not None:
            if torch.is_grad_enabled():
                self.profile_sigs_.append(step_signature(args, kwargs))
            note_forward = getattr(self.profile_, "note_forward", None)  # a stand-in profiler may lack it
            if note_forward is not None:
                note_forward()
            self._count_profiled_forward()

    def _saves(self):
        """The OffloadedSaves of profiled steps (Note [Profiling a step that does not fit])."""
        if self.profile_saves_ is None:
            from memsched.profiler.offloaded_saves import OffloadedSaves
            self.profile_saves_ = OffloadedSaves(self.device, self.host, self.min_offload_bytes)
        return self.profile_saves_

    def _profiled_step_stats(self, session):
        from memsched.profiler.offloaded_saves import ProfiledStepStats
        saves = getattr(session, "offload", None)
        stats = saves.stats if saves is not None else ProfiledStepStats(mode="keep")
        if self.device.type == "cuda":
            stats.peak_bytes = allocator.cuda_max_memory_allocated(self.device)
            if getattr(session, "device_peak_bytes", None) is not None:
                # the profiler restarted the peak at every op (Note [Memory the trace does not model])
                stats.peak_bytes = max(stats.peak_bytes, session.device_peak_bytes)
        return stats

    def _warn_not_profiled(self, why):
        self.not_profiled_why_ = why
        if not self.warned_not_profiled_:
            self.warned_not_profiled_ = True
            self.warned_not_profiled_why_ = why
            warnings.warn(f"memsched.optimize: {why}; this step runs plainly and is not profiled (a later "
                          "step without them is; this warning is shown once)",
                          RuntimeWarning, stacklevel=user_stacklevel())

    def _root_post(self, module, args, output):
        self.in_forward_ = False
        if output is None:
            # always_call hook after an exception: the step is abandoned (Note [A step that
            # raises]). The executor's own forward hook drops its part; ooo drops the iteration.
            # WARNING: the profiler session is aborted at the next forward, run.step() or
            # __exit__, not here: its module hooks cannot be removed while torch iterates them.
            if self.profile_ is not None:
                self.profile_failed_ = True
                if not self.profile_offload:
                    _explain_profiled_oom(sys.exc_info()[1])
            if self.ooo_ is not None:
                self.ooo_.abandon_forward()
            _explain_hook_refusal(sys.exc_info()[1])
            _explain_pass_through(sys.exc_info()[1])


    def _adopt_trace(self, trace):
        trace.min_offload_bytes = self.min_offload_bytes  # See Note [The executor's size floor] (csrc/core/trace.h)
        budget_bytes, planner = self._resolve_budget(trace)
        if planner is not None and not any(op.phase == "backward" for op in trace.ops):
            if any(p.grad is not None for p in self.model.parameters()):
                raise _C.MemschedError(
                    "run.step(): the profiled step's parameters have gradients, but memsched's profiler saw no "
                    "backward op: the backward ran on another thread than the forward (the profiler, like "
                    "PyTorch's saved-tensor hooks, is per thread). Run the forward, backward and run.step() of "
                    "a step on one thread (Note [One thread per step])")
            raise _C.MemschedError(
                "run.step(): the profiled step ran no backward pass before run.step(), so there is nothing "
                "to plan (no saved activation is used by a backward op); call loss.backward() before "
                "run.step()")
        self.trace = trace
        self.budget_bytes = budget_bytes
        if planner is None:
            self.plan = None
        else:
            try:
                self.plan = make_plan(trace, self.budget_bytes, planner, self.device_model)
            except _C.MemschedError as err:
                if isinstance(self.budget_spec, float) and "least budget" in str(err):
                    raise fraction_refusal(trace, self.budget_spec, err, planner,
                                           lambda b: make_plan(trace, b, planner, self.device_model)) from None
                extra = self.optimizer_state_extra_
                spec = self.budget_spec
                if "least budget" not in str(err) or spec is None:
                    raise
                # the least budget this planner accepts, checked: never one that is refused again
                working = least_working_budget(err, trace, lambda b: make_plan(trace, b, planner, self.device_model))
                if isinstance(spec, str):  # "P%": answer in percent
                    raise percent_refusal(spec, planner, working + extra, trace.peak_bytes() + extra,
                                          budget_bytes + extra, "this step's peak",
                                          ", its optimizer state included" if extra else "") from None
                if not extra and working != planner_least_bytes(err, trace):
                    raise _C.MemschedError(
                        f"budget {self._budget_echo()}: the {planner} planner cannot reach {budget_bytes} bytes on this step; the "
                        f"least budget it accepts is {working} bytes ({format_bytes(working)}): raise the budget to "
                        f"at least {working} bytes") from None
                if extra:
                    # See Note [Optimizer state the profiled step did not see].
                    least = working + extra
                    raise _C.MemschedError(
                        f"budget {self._budget_echo()}: the steps after the first need at least {least} bytes "
                        f"({format_bytes(least)}): {format_bytes(least - extra)} for the step as profiled plus "
                        f"{format_bytes(extra)} of optimizer state that the first optimizer.step() creates and "
                        f"every later step holds; raise the budget to at least {least} bytes (the least budget with "
                        f"the optimizer state)") from None
                head = f"budget {budget_bytes} bytes"
                if self.budget_written_ and str(err).startswith(head):  # as the user wrote it, bytes beside
                    raise _C.MemschedError(f"budget {self._budget_echo()}{str(err)[len(head):]}") from None
                raise
        points = PrefetchPoints(trace, self.node_of_op_)
        moved_later = {}  # id(plan) -> (prefetches started later than planned, of them on demand)

        def fit(plan):  # See Note [Prefetches where they fire] (offload/prefetch_fit.py)
            plan, later, on_demand = fit_prefetches(trace, plan, points)
            moved_later[id(plan)] = (later, on_demand)
            return plan

        self.plan = fit(self.plan)
        schedule = OffloadSchedule.build(trace, self.plan, self.min_offload_bytes, node_of_op=self.node_of_op_,
                                         forward_starts=self.forward_starts_)
        need = schedule.offloaded_bytes
        self.host_limit_note_ = ""
        if self.host.limit is not None and need > self.host.limit:
            # See Note [Host memory limit] (offload/host_buffers.py) and Note [Plans within
            # host_memory_limit] (offload/host_limit.py): another plan that fits, or refused before any
            # planned step naming a limit that works.
            import memsched
            self.plan, schedule, chosen = plan_within_host_limit(
                trace, self.budget_bytes, planner, need, self.host.limit, self.host.limit_text,
                make_plan=lambda name, durations: fit(memsched.plan(trace, self.budget_bytes, name, self.device_model,
                                                                    durations=durations)),
                schedule_of=lambda plan: OffloadSchedule.build(trace, plan, self.min_offload_bytes,
                                                               node_of_op=self.node_of_op_,
                                                               forward_starts=self.forward_starts_),
                simulate_of=lambda plan: simulate(trace, plan, self.device_model),
                planners=[planner] + [p for p in planner_names() if p not in (planner, "keep_all")])
            self.host_limit_note_ = (f"host_memory_limit ({format_bytes(self.host.limit)}) is below the "
                                     f"{format_bytes(need)} the {planner} plan keeps in host memory: ran the {chosen} "
                                     f"plan, which keeps {format_bytes(schedule.offloaded_bytes)} there instead (Note "
                                     f"[Plans within host_memory_limit])")
            warnings.warn(f"memsched.optimize: {self.host_limit_note_}; pass a larger host_memory_limit to run the "
                          f"{planner} plan", RuntimeWarning, stacklevel=user_stacklevel())
        later, on_demand = moved_later.get(id(self.plan), (0, 0))  # of the plan that runs
        self.prefetch_note_ = (f"{counted(later, 'prefetch', 'prefetches')} of the plan "
                               f"{'starts' if later == 1 else 'start'} later than planned ({on_demand} of them on "
                               f"demand): starting {'it' if later == 1 else 'them'} where the executor can (at the "
                               f"start of a backward node) would have passed the budget or come before their "
                               f"backward pass (Note [Prefetches where they fire])") if later else ""
        self.simulation = simulate(trace, self.plan, self.device_model) if self.plan is not None else None
        self.schedule = schedule
        self.executor.set_schedule(self.schedule)
        self.executor.hookless = self._hookless()
        self._arm_memory_guard(trace)
        self.executor.active = True

    # -- Note [One plan per input shape] (offload/shape_plans.py) ------------------------------------------
    def _plan_state(self):
        return {f: getattr(self, f) for f in PLAN_FIELDS}

    def _plan_for_shape(self, sig):
        """The first forward with gradients of a step whose inputs have other shapes than the current
        plan's step: run that signature's plan, or profile this step for one while there is room."""
        state = self.plans_.get(sig)
        if state is None and len(set(self.plans_) | {self.plan_sig_}) >= self.max_shape_plans:
            # no room: matched against the current plan, as a step of other shapes always was
            self.steps_without_room_ += 1
            if self.steps_without_room_ == 1 and self.max_shape_plans > 1:
                warnings.warn(f"memsched.optimize: a step with new input shapes ({describe(sig)}) finds no room for a "
                              f"plan of its own: {_no_room(self.max_shape_plans)} Warned once", RuntimeWarning,
                              stacklevel=user_stacklevel())
            return
        self.plans_.pop(self.plan_sig_, None)  # (re-filed last: the plans left longest ago go first at the cap)
        self.plans_[self.plan_sig_] = self._plan_state()
        if state is None:
            self.shape_profiles += 1
            self.reprofile_why_ = f"a step with new input shapes ({describe(sig)})"
            self.shape_profile_from_ = self.plan_sig_  # the plan to go back to if this one is refused
            self.executor.drop_empty_step()  # (begun by an evaluation under no_grad: the profile takes it)
            self._start_profiling()
            return
        self._load_plan(sig, state)

    def _load_plan(self, sig, state):
        for f, v in state.items():
            setattr(self, f, v)
        self.plan_sig_ = sig
        self.executor.set_schedule(self.schedule)
        self.executor.hookless = self._hookless()
        self._arm_memory_guard(self.trace)
        self.executor.active = True

    def _hookless(self):
        """See Note [A plan with nothing to do] (offload/executor.py): keep all, no budget to hold ... unless
        a fused update holds a parameter its hooks saw saved without gradient (Note [A parameter read after
        its gradient is final] in ooo/backward.py): only a pack hook sees that."""
        return (self.budget_spec is None and self.plan is None and not self.timeline
                and (self.ooo_ is None or not self.ooo_.holds_seen))

    def _arm_memory_guard(self, trace):
        """The executor's memory guard at the step's budget, optimizer state included (Note [Memory guard]
        in csrc/torch/saved_tensor_offload.cpp); accelerators only, off without a plan or a budget."""
        guarded = self.plan is not None and self.budget_bytes is not None
        self.executor.set_memory_guard(self._budget_with_state() if guarded else None,
                                       guard_headroom(trace) if guarded else ())

    def _resolve_budget(self, trace):
        """(budget_bytes or None, planner name or None for keep everything). See Note [Budgets]."""
        spec = self.budget_spec
        extra = self.optimizer_state_extra_  # Note [Optimizer state the profiled step did not see]
        if spec is None:
            if self.device.type != "cuda":
                return None, None
            total = torch.cuda.get_device_properties(self.device).total_memory
            if trace.peak_bytes() + extra <= _DEVICE_MEMORY_FRACTION * total:
                return None, None
            return int(_DEVICE_MEMORY_FRACTION * total) - extra, self.planner
        if isinstance(spec, float):
            budget_bytes, op_id = fraction_budget(trace, spec)
            self.budget_note_ = self._fraction_note(trace, spec, budget_bytes, op_id)
            return budget_bytes, self.planner
        if isinstance(spec, str):  # "P%" of the step's peak, the state included
            return max(int((trace.peak_bytes() + extra) * float(spec[:-1]) / 100.0) - extra, 0), self.planner
        return max(resolve_budget(spec, trace) - extra, 0), self.planner

    def _budget_as_written(self):
        """The budget as the user wrote it ("6GiB"; the parsed form for every other one), for refusals."""
        return self.budget_written_ if self.budget_written_ else self.budget_spec

    def _budget_echo(self):
        """A refusal's "budget ..." in the user's words, the bytes beside a budget written with units
        ("'1KiB' (1024 bytes)")."""
        if self.budget_written_:
            return f"{self.budget_written_!r} ({self.budget_spec} bytes)"
        return repr(self.budget_spec)

    def _budget_with_state(self):
        """The step's budget as run.report() shows it, beside planned_figures()' peak: the planner's share
        plus the optimizer state the profiled step did not hold (Note [Optimizer state the profiled step
        did not see])."""
        return None if self.budget_bytes is None else self.budget_bytes + self.optimizer_state_extra_

    def _predicted_state_bytes(self):
        """Bytes of optimizer state the coming update will create on the Run's device, for torch.optim's
        optimizers (_STATE_OF); 0 for others -- then it is measured after the update. See Note
        [Optimizer state the profiled step did not see]."""
        opt = self.optimizer
        shape = _STATE_OF.get(type(opt)) if opt is not None else None
        if shape is None:
            return 0
        total = 0
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is None or p.device != self.device or opt.state.get(p):
                    continue  # no update (no gradient), another device, or state already there
                like_param, scalars, scalars_on_device = shape(group)
                total += p.numel() * p.element_size() * like_param
                on_device = scalars_on_device or group.get("capturable") or group.get("fused")
                if on_device or self.device.type == "cpu":  # the step count (and such): 0-dim float32 tensors
                    total += 4 * scalars
        return total

    def _optimizer_state_bytes(self):
        """Bytes of the optimizer's state tensors on the Run's device (each storage once)."""
        opt = self.optimizer
        if opt is None or not isinstance(getattr(opt, "state", None), dict):
            return 0
        seen, total = set(), 0
        for state in opt.state.values():
            if not isinstance(state, dict):
                continue
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.device == self.device:
                    for st in _storages_of(v):
                        if st.data_ptr() not in seen:
                            seen.add(st.data_ptr())
                            total += st.nbytes()
        return total

    def _account_optimizer_state(self):
        """After the update of the step just planned: plan again with the optimizer state that update
        created. See Note [Optimizer state the profiled step did not see]."""
        before, self.state_check_ = self.state_check_, None
        if before is None or self.trace is None:
            return
        extra = max(self._optimizer_state_bytes() - before, 0)
        if extra == self.optimizer_state_extra_:
            return  # as predicted before the update (the usual case)
        self.optimizer_state_extra_ = extra
        if isinstance(self.budget_spec, float):
            # a fraction's byte budget comes from the same trace: unchanged; the guard's, with the state, not
            self._arm_memory_guard(self.trace)
            return
        try:
            self._adopt_trace(self.trace)
        except BaseException:
            # The steps must not run the plan made without the state: profile the next step (its trace
            # has the state, so its run.step() refuses again, before its update) and say why now.
            self.executor.set_schedule(None)
            self._start_profiling()
            raise

    def _count_profiled_forward(self):
        """Note [A step with no end]: a profile that never closes grows without bound."""
        self.profile_forwards_ += 1
        if self.profile_forwards_ <= _MAX_PROFILED_FORWARDS:
            return
        self._abort_profile()
        self.not_profiled_why_ = ""
        self.unfinished_forwards_ = self.profile_forwards_
        warnings.warn(
            f"memsched.optimize: {_MAX_PROFILED_FORWARDS} forward passes ran without a step boundary, so "
            f"memsched stopped profiling and runs the model plainly from here on. {_STEP_BOUNDARY_FIX}",
            RuntimeWarning, stacklevel=user_stacklevel())

    @staticmethod
    def _fraction_note(trace, fraction, budget_bytes, op_id):
        """The report's line when a fraction's budget is set where activation offload cannot lower."""
        act = planned_activation_curve(trace, None)
        act_peak = max(act, default=0)
        if op_id < 0 or act_peak == 0 or act[op_id] > fraction * act_peak:
            return ""  # the budget bounds the saved activations at op_id: the fraction holds there
        op = trace.ops[op_id]
        return (f"budget {fraction:g} (the step's peak with its saved activations held to {fraction:g} of their "
                f"keep-all peak): the step's peak lies outside the saved "
                f"activations, at op {op.id} {op.name} ({op.phase}, module '{op.module_path}', "
                f"{format_bytes(budget_bytes)} live, {format_bytes(act[op_id])} of them saved activations), "
                f"which activation offload cannot lower; the planner was asked for that peak "
                f"({format_bytes(budget_bytes)}), so saved activations may stay above {fraction:g} of plain's "
                f"({format_bytes(act_peak)}) where that does not raise the step's peak")

    # Note [Nothing to match under budget=None]
    #   Rationale: budget=None without a plan keeps every activation: a step of other shapes runs exactly as
    #   the profiled one would. Its steps push no hooks (Note [A plan with nothing to do]) -- except with
    #   timeline=True, whose samples need them: there each step of another length than the first was
    #   "diverged", warned that it "runs without offloading" and had steps re-profiled, with advice to pad
    #   (found by a helper trying budget=None with dynamic padding as a new user).
    #   Approach: with nothing to hold and nothing planned, a mismatch of an activation's label or of the
    #   activation count is no mismatch: no warning, no re-profile, and the step counts as run to plan. The
    #   other causes stay (the caller's own saved-tensor hooks, another Run's open step), and a step whose
    #   peak passes the share of the device budget=None keeps everything within is still a mismatch, hooked
    #   or not (_outgrew_device), as a hooked step's label mismatch had made it.
    def _nothing_to_match(self):
        return self.budget_spec is None and self.plan is None

    def _on_label_mismatch(self, why):
        """The executor's callback at a step's first mismatch (an activation's label, or another cause)."""
        if self._nothing_to_match() and self.executor.stats.label_mismatch:
            return  # See Note [Nothing to match under budget=None]
        self._on_mismatch(why)

    def _on_mismatch(self, why):
        if self.forward_in_backward_ or self.profile_forward_in_backward_:
            why += ("; the model's forward ran inside a backward pass, as torch.utils.checkpoint(model, ..., "
                    "use_reentrant=True) around the whole model recomputes it: memsched profiles what the step "
                    "saves in its forward, and this step saves it in backward, so no plan matches it and the "
                    "steps run plainly. Checkpoint inside the model (its blocks), use use_reentrant=False (then "
                    "the steps run plainly from the start, with a warning), or drop the checkpoint and let the "
                    "budget decide what to keep")
        elif self.other_shape_forward_ is not None:
            n, sig, planned = self.other_shape_forward_
            why += (f"; forward {n} with gradients of this step had inputs {describe(sig)}, where the step its plan "
                    f"was made from "
                    f"had {describe(planned)}: a step's plan is chosen by its first forward (here "
                    f"{describe(self.plan_sig_)}), so with gradient accumulation every micro-batch of a step should "
                    f"have the shapes of the first {_ACCUMULATION_FIX}")
            self.accumulation_mismatches_ += 1
        elif self.eval_grad_forward_:
            why += ("; this step ran the model in eval mode (model.eval()) with gradients enabled, and that "
                    "forward's saves count as the step's: an evaluation forward belongs under torch.no_grad() (or "
                    "torch.inference_mode()), where it stays out of the training steps; a step that trains in "
                    "eval mode saves other activations than the profiled train-mode step, so train every step "
                    "in one mode for the plan to hold")
        elif self.profile_eval_grad_:
            why += ("; the profiled step ran the model in eval mode (model.eval()) with gradients enabled, so the "
                    "trace holds that forward's saves, which the training steps do not repeat: an evaluation "
                    "forward belongs under torch.no_grad() (or torch.inference_mode()), and then the plan matches "
                    "them; a step that trains in eval mode saves other activations than a train-mode step, so "
                    "train every step in one mode")
        if not self.warned_:
            self.warned_ = True
            again = (f"two such steps in a row get the next one profiled again (at most {self.max_reprofiles} "
                     f"times)" if self.max_reprofiles > 0 else
                     "the plan is never profiled again (max_reprofiles=0)")
            warnings.warn(f"memsched.optimize: a step does not match the profiled trace ({why}); it runs "
                          f"without offloading from there, the next step runs the plan, and {again}; this "
                          f"warning is shown once", RuntimeWarning,
                          stacklevel=user_stacklevel())

    def _make_ooo(self, fuse_optimizer):
        try:
            from memsched.ooo import OutOfOrderBackward
        except ImportError as e:
            raise _C.MemschedError("optimize(ooo=True / fuse_optimizer=True) needs memsched.ooo (the out-of-order "
                                   f"backward component), which this build does not have ({e}); pass ooo=False") from e
        ooo = OutOfOrderBackward(self.model, self.optimizer, fuse_optimizer=fuse_optimizer,
                                 grad_accumulation_steps=self.grad_accumulation_steps)
        run = weakref.ref(self)  # (no reference cycle through the owner)

        def profiling():  # See Note [The profiled step updates after backward]
            r = run()
            return r is not None and r.profile_ is not None

        ooo.fusion_paused = profiling
        return ooo

    @staticmethod
    def _check_device(device):
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"device: expected a torch device such as 'cpu', 'cuda' or 'cuda:0' (or None: the "
                             f"model's), got {device!r}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} but torch.cuda.is_available() is False; use 'cpu' or None")
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device: memsched.optimize runs on 'cpu' or 'cuda' devices, got {device!r}")
        if dev.type == "cuda" and dev.index is None:
            # 'cuda' is the current device, where torch puts the tensors: their device is 'cuda:N', and
            # torch.device('cuda:0') != torch.device('cuda'), so the hooks' device checks offloaded nothing
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    @staticmethod
    def _model_device(model):
        for t in list(model.parameters()) + list(model.buffers()):
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"model: its tensors are on {t.device}, but memsched.optimize runs models on "
                                 "'cpu' or 'cuda' devices; move it there (model.to('cuda')) first")
            return t.device
        return torch.device("cpu")

    # -- reports ------------------------------------------------------------------------------------
    def planned_figures(self):
        """What the plan predicts: simulator figures where available, plus the plan's own counts."""
        out = {}
        if self.trace is None:
            return out
        extra = self.optimizer_state_extra_  # Note [Optimizer state the profiled step did not see]
        curve = planned_activation_curve(self.trace, self.plan)
        out["activation_peak_bytes"] = max(curve) if curve else 0
        sched = self.schedule
        if sched is not None:
            out["offloaded"] = len(sched.offload)
            out["prefetched"] = len(sched.trigger_op)
            out["on_demand"] = len(sched.offload) - len(sched.trigger_op)
            out["bytes_moved"] = 2 * sched.offloaded_bytes
            out["recomputed"] = len(sched.recompute)
            out["recomputed_bytes"] = sum(sched.bytes[k] for k in sched.recompute)
        sim = self.simulation
        if sim is not None:
            out["peak_bytes"] = sim.peak_bytes + extra
            out["step_time_s"] = sim.step_time_us / 1e6
            out["stall_s"] = sim.stall_us / 1e6
            out["recompute_s"] = sim.recompute_us / 1e6
            out["bytes_moved"] = sim.bytes_to_host + sim.bytes_to_device
        elif self.plan is None:
            out["peak_bytes"] = self.trace.peak_bytes() + extra
            out["bytes_moved"] = 0
        if self.profiled_update_peak_ is not None:  # measured: no plan moves it (Note [Where the peak went])
            out["update_peak_bytes"] = self.profiled_update_peak_
        return out

    def report(self, file=None):
        """Print the planned-vs-measured table (to stdout or `file`) and return it as a RunReport."""
        shown = self._most_run_plan()
        if shown is None:
            return self._report(file)
        current = self._plan_state()
        current_sig = self.plan_sig_
        self.plans_[current_sig] = current  # (counted among the plans while the other is shown)
        try:
            for f, v in shown[1].items():
                setattr(self, f, v)
            self.plan_sig_ = shown[0]
            return self._report(file)
        finally:
            for f, v in current.items():
                setattr(self, f, v)
            self.plan_sig_ = current_sig
            del self.plans_[current_sig]

    def _most_run_plan(self):
        """(signature, plan state) of the plan with the most executed steps, where the current plan has none
        and another has some: after an epoch's shorter last batch was profiled for its shapes, the report showed
        that batch's plan with nothing measured (found by a helper probing per-shape plans); None otherwise."""
        if not self.plans_:
            return None
        ran = collections.Counter(s.plan_index for s in self.step_stats)
        if ran[self.plan_index_]:
            return None
        best = max(((sig, state) for sig, state in self.plans_.items() if ran[state["plan_index_"]]),
                   key=lambda item: ran[item[1]["plan_index_"]], default=None)
        return best

    def _report(self, file=None):
        if self.plan is not None:
            planner = self.planner
        elif self.trace is None and self.budget_spec is not None:
            planner = f"{self.planner} (no step planned yet)"
        else:
            planner = "keep_all"
        budget_text = ""
        if self.budget_bytes is None and self.budget_spec is not None:
            budget_text = f"{self.budget_spec!r} (resolved when a step is profiled)"
        elif isinstance(self.budget_spec, (float, str)):
            budget_text = f"{self.budget_spec!r} ="  # a fraction or percentage: what it came to beside it
        info = dict(device=str(self.device), planner=planner, budget_bytes=self._budget_with_state(),
                    budget_text=budget_text, steps_profiled=self.steps_profiled, host_source=self.host.source,
                    profile="offload" if self.profile_offload else "keep")
        notes = [] if self.compiled_why_ else [self._profile_note()]  # a compiled model profiles nothing
        if self.unfinished_forwards_ and self.steps_profiled == 0:
            notes.append(f"no step boundary was reached ({counted(self.unfinished_forwards_, 'forward')} profiled "
                         f"without one), so nothing was planned: {_STEP_BOUNDARY_FIX}")
        if self.optimizer_state_extra_ and self.budget_bytes is not None:
            notes.append(f"budget and planned peak include the {format_bytes(self.optimizer_state_extra_)} of "
                         f"optimizer state the first optimizer.step() created (Note [Optimizer state the "
                         f"profiled step did not see])")
        if self.mismatches:
            notes.append(f"{counted(self.mismatches, 'step')} did not match the profiled trace and ran without "
                         f"offloading from the mismatch on; {counted(self.reprofiles, 're-profile')}")
            if self.steps_without_room_:
                notes.append(f"{counted(self.steps_without_room_, 'step')} of new input shapes found no room for a "
                             f"plan of their own: {_no_room(self.max_shape_plans)}")
            if self.accumulation_mismatches_:
                notes.append(f"of those, {counted(self.accumulation_mismatches_, 'step')} had a later forward (a "
                             f"micro-batch of gradient accumulation) of other input shapes than the first: a step's "
                             f"plan is chosen by its first forward, so every micro-batch of a step should have the "
                             f"shapes of the first {_ACCUMULATION_FIX}")
            if self.reprofiles_denied_:
                notes.append(f"max_reprofiles ({self.max_reprofiles}) is reached: a step that does not match "
                             f"the plan is no longer re-profiled and runs plainly from its mismatch on. A forward "
                             f"whose saved tensors change from step to step (shapes, branches) cannot keep a "
                             f"plan; pass optimize(..., max_reprofiles=...) to re-profile more often")
        if self.steps_not_profiled:
            notes.append(f"{counted(self.steps_not_profiled, 'step')} ran plainly without being profiled: "
                         f"{self.warned_not_profiled_why_}")
        if self.compiled_why_:
            notes.append(f"{self.compiled_why_}: every step ran plainly (compiled modules are not profiled or "
                         "offloaded; pass the module before torch.compile() to offload)")
        if self.budget_note_:
            notes.append(self.budget_note_)
        if self.host_limit_note_:
            notes.append(self.host_limit_note_)
        if self.prefetch_note_:
            notes.append(self.prefetch_note_)
        limited = sum(s.host_limited for s in self.step_stats)
        if limited:
            notes.append(f"{counted(limited, 'offload')} stayed on the device: host_memory_limit "
                         f"({format_bytes(self.host.limit)}) was reached (Note [Host memory limit])")
        if self.unmodeled_bytes_:
            notes.append(f"the profiled step's allocator held {format_bytes(self.unmodeled_bytes_)} at its peak "
                         "beyond the traced tensors (workspaces, allocator rounding, buffers inside ops); the trace "
                         "and every plan count it (Note [Memory the trace does not model])")
        held = self._budget_held_note()
        if held:
            notes.append(held)
        waits = sum(s.guard_waits for s in self.step_stats)
        if waits:
            released = sum(s.guard_releases for s in self.step_stats)
            notes.append(f"memory guard: the compute stream waited {counted(waits, 'time')} for D2H copies so that "
                         f"{counted(released, 'offloaded activation')} "
                         f"({format_bytes(sum(s.guard_released_bytes for s in self.step_stats))}) left the device "
                         "before the budget was reached (Note [Memory guard]); the waits are in the stall time")
        kept = collections.Counter()
        for st in self.step_stats:
            kept.update(st.recompute_kept_reasons)
        if kept:
            why = ", ".join(f"{n} {reason}" for reason, n in kept.most_common())
            notes.append(f"{counted(sum(kept.values()), 'planned recompute')} kept their tensor instead ({why}; Note "
                         f"[Unpack-time recompute]): the step may exceed the budget by their bytes")
        if self.ooo_ is not None:
            notes.append(self._ooo_note())
        if self.device.type == "cpu":
            notes.append("CPU run: copies are synchronous host copies; times are CPU wall clock")
        mine = self._this_plans_steps()
        shapes = len(set(self.plans_) | {self.plan_sig_})
        if shapes > 1:  # See Note [One plan per input shape]
            notes.append(f"{shapes} plans, one per input shape of the step's first forward; the figures are those "
                         f"of the plan for inputs {describe(self.plan_sig_)}")
        if len(mine) < len(self.step_stats) and self.steps_profiled > 1:
            notes.append(f"measured: the {counted(len(mine), 'step')} run against the current plan (profile "
                         f"{self.plan_index_}; planned or not); other plans' steps are left out of the medians")
        r = build_report(info, self.planned_figures(), mine, notes,
                         counts=(self.steps_planned,
                                 self.steps_plain + self.steps_not_profiled + self.compiled_steps_),
                         largest=largest_planned(self.schedule if self.plan is not None else None),
                         peak_gap=self._peak_gap())
        print(r.table, file=file)
        return r

    def _ooo_note(self):
        """run.report()'s line on out-of-order backward and the fused update (OutOfOrderBackward.report())."""
        o = self.ooo_.report()
        line = (f"out-of-order backward ({o['executor']} executor): {counted(o['eligible_layers'], 'eligible layer')}, "
                f"{counted(o['deferred_items'], 'weight-gradient item')} deferred over "
                f"{counted(o['iterations'], 'backward pass', 'backward passes')}")
        if self.fuse_optimizer:
            line += (f"; {counted(o['fused_updates'], 'fused parameter update')}, gradients at most "
                     f"{format_bytes(o['peak_grad_bytes'])} (parameters {format_bytes(o['param_bytes'])})")
        if self.cast_warmup_profiles_:
            line += ("; the first profile was dropped: deferral under autocast began after it (Note [Deferred calls "
                     "under autocast])")
        return line

    def _profile_note(self):
        """run.report()'s line on how the profiled step held its saved activations."""
        st = self.profile_stats
        asked = f"profile={self.profile!r}" + ("" if self.profile != "auto" else
                                                (", budget in bytes" if self.profile_offload else
                                                 ", budget not in bytes" if self.budget_spec is not None
                                                 else ", no budget"))
        plain = ""
        if self.trace is not None:
            plain = format_bytes(max(planned_activation_curve(self.trace, None), default=0))
        if not self.profile_offload:
            line = (f"profiled step: every saved activation kept on the device as plain PyTorch does ({asked}"
                    f"{'; ' + plain + ' at their peak' if plain else ''}), so the first step needs plain's memory; "
                    f"pass the budget in bytes (or profile='offload') to profile a step that does not fit")
        elif st is None or st.mode != "offload":
            line = f"profiled step: saved activations offloaded to host memory ({asked}); no step profiled yet"
        else:
            line = (f"profiled step: saved activations offloaded to host memory ({asked}): "
                    f"{counted(st.offloaded, 'storage')} ({format_bytes(st.offloaded_bytes)}) copied out, "
                    f"{st.fetched} fetched back in backward, {st.kept} kept on the device; measured saved-activation peak "
                    f"{format_bytes(st.activation_peak_bytes)}{' (plain PyTorch: ' + plain + ')' if plain else ''}")
            if st.host_limited:
                line += f"; {st.host_limited} stayed on the device: host_memory_limit reached"
        if st is not None and st.peak_bytes is not None:
            line += f"; device peak of the profiled step (max_memory_allocated): {format_bytes(st.peak_bytes)}"
            # the user's budget: the planner's share plus the optimizer state the profiled step did not
            # hold yet (Note [Optimizer state the profiled step did not see])
            budget = self._budget_with_state()
            if budget is not None and st.peak_bytes > budget:
                line += (f", above the budget ({format_bytes(budget)})" +
                         (": what it kept on the device (parameters, gradients, optimizer state, each op's "
                          "inputs and outputs) needs more; later steps follow the plan" if self.profile_offload
                          else ": pass the budget in bytes (or profile='offload') to keep the profiled step's "
                               "saved activations in host memory"))
        if self.unused_forward_profiles_:
            line += (f"; {counted(self.unused_forward_profiles_, 'profile')} dropped: its step had a forward no "
                     f"backward read (a skipped batch), so the next step was profiled instead (Note [A profiled "
                     f"forward that no backward read])")
        return line

    def save_timeline(self, path, torch_trace=None, offset_us=None):
        """The last executed step: memory planned and measured, copy streams. Returns path.

        A path ending in ".json" gets a Chrome trace event file (Perfetto): simulated ops, copies,
        stalls and memory, plus the measured step with timeline=True; torch_trace= merges it into
        torch.profiler's exported trace (Note [Timeline as a Chrome trace] in
        offload/chrome_trace.py). Any other path gets an image (PNG by default; needs timeline=True).
        Missing folders on the way to `path` are created, as the command line does."""
        import os
        for name, value in (("path", path), ("torch_trace", torch_trace)):
            if not isinstance(value, (str, os.PathLike)) and not (name == "torch_trace" and value is None):
                raise TypeError(f"run.save_timeline: {name}: expected a file path (a str or os.PathLike), got "
                                f"{type(value).__name__}")
        is_json = os.fspath(path).lower().endswith(".json")
        if not is_json:  # the path's form first: a wrong one is wrong at any time
            from memsched._images import image_format
            image_format(path, "run.save_timeline: path", other="or .json for a Chrome trace (Perfetto)")
            if torch_trace is not None or offset_us is not None:
                raise ValueError(f"torch_trace / offset_us: merging with a torch.profiler trace needs a '.json' "
                                 f"path (a Chrome trace), got {str(path)!r}")
        if self.trace is None:
            raise RuntimeError("run.save_timeline(): no step has been profiled yet; call it after a few run.step()")
        from memsched.commands.args import output_file
        error = output_file(path, "run.save_timeline: path", "step.json" if is_json else "step.png")
        if error is not None:  # a file in place of a folder on the way, an unwritable folder
            raise ValueError(error)
        if is_json:
            return self._save_timeline_json(path, torch_trace, offset_us)
        if not self.timeline:
            raise RuntimeError("run.save_timeline(): this Run recorded no timeline; pass "
                               "memsched.optimize(..., timeline=True) to record memory samples and copies per "
                               "step (off by default: it costs a sample per saved tensor); a '.json' path "
                               "writes the planned step as a Chrome trace without it")
        executed = self._steps_of_this_plan()
        last = executed[-1] if executed else None
        planned, planned_copies = self._planned_timeline()
        title = (f"memsched {self.planner if self.plan is not None else 'keep_all'} on {self.device}: "
                 f"planned vs measured ({last.memory_source if last else 'no executed step'})")
        return save_timeline(path, title, planned, last.samples if last else [], last.copies if last else [],
                             planned_copies)

    def _this_plans_steps(self):
        """The executed steps of the current plan: a re-profile makes a new plan, and a step of the one
        before it is no measurement of this one (found by a helper: after a smaller batch's re-profile, the
        report and the timeline set the new plan beside the old plan's steps, with a note of a gap that was
        not there)."""
        return [s for s in self.step_stats if s.plan_index == self.plan_index_]

    def _steps_of_this_plan(self):
        """The timeline's measured step comes from these: the current plan's planned steps, else any of its."""
        mine = self._this_plans_steps()
        return [s for s in mine if s.mode == "planned"] or mine

    def _save_timeline_json(self, path, torch_trace, offset_us):
        from memsched.offload import chrome_trace
        executed = self._steps_of_this_plan()
        last = executed[-1] if executed and self.timeline else None
        planned, _ = self._planned_timeline()
        memory_name = "device memory" if self.device.type == "cuda" else "saved activations"
        summary = dict(device=str(self.device), planner=self.planner if self.plan is not None else "keep_all",
                       budget_bytes=self._budget_with_state(), planned=self.planned_figures(),
                       measured_step=last.mode if last is not None else None,
                       measured_memory=last.memory_source if last is not None else None)
        obj = chrome_trace.timeline_trace(self.trace, self.simulation, planned, memory_name, last, summary)
        if torch_trace is not None:
            obj = chrome_trace.merge_with_torch_trace(obj, torch_trace, offset_us)
        elif offset_us is not None:
            raise ValueError("offset_us: applies with torch_trace= (where our step starts on its clock)")
        return chrome_trace.write_json(path, obj)

    def _planned_timeline(self):
        """[(t_s, bytes)] of the plan (simulator timeline when given, else the op-level model) + copies."""
        sim = self.simulation
        copies = []
        if sim is not None:
            streams = sim.timeline
            copies = [(kind, e["start_us"] / 1e6, e["end_us"] / 1e6, e["bytes"])
                      for kind in ("d2h", "h2d") for e in streams.get(kind, [])]
            if self.device.type == "cuda":  # measured: memory_allocated, i.e. everything -- as simulated
                return [(t_us / 1e6, b) for t_us, b in sim.memory], copies
        # CPU measures saved activations only: plot the plan's activation curve, on the simulator's
        # op start times when there is a simulation, else on the measured op durations.
        curve = planned_activation_curve(self.trace, self.plan)
        if sim is not None:
            return [(t_us / 1e6, b) for t_us, b in zip(sim.op_start_us, curve)], copies
        ops = self.trace.ops
        # Place ops on a time axis by their measured durations.
        t, pts = 0.0, []
        for op, b in zip(ops, curve):
            pts.append((t, b))
            t += max(op.duration_us, 0.0) / 1e6
        return pts, []


_OPTIONS = ("min_offload_bytes", "max_reprofiles", "device_model", "grad_accumulation_steps", "timeline", "history",
            "host_memory_limit", "profile", "max_shape_plans")
PROFILE_MODES = ("auto", "offload", "keep")


# Note [A profiled forward that no backward read]
#   Rationale: a loop that skips a batch after its forward (a non-finite loss: no backward, no step) in
#   the first step had that forward recorded into the profile with the next one, which the backward
#   followed. The trace then held two forwards' activations at once (the skipped graph dies only when
#   the loop rebinds its loss) for every later step's one, and a fraction budget those steps meet was
#   refused at the step boundary ("the least fraction that works is 0.58" for 0.5) and that step's
#   update dropped (found by a helper injecting failures mid-step; 4.6e-3 off plain after four steps).
#   Approach: at the profiled step's boundary, a forward (Note [Forwards that save nothing] in
#   offload/recompute.py: where each forward with grad enabled began) that saved activations of which no
#   backward op read one was dropped by the loop: the step's update runs as usual and the next step is
#   profiled instead, at most twice per Run -- a loop that does this at every step (a forward whose graph
#   it drops, each step) is then planned as it is.
#   Limitations: a forward whose graph the loop keeps for a later step's backward looks the same here.


# Note [One plan per input shape] (offload/shape_plans.py), Limitations
def _no_room(max_shape_plans):
    return (f"max_shape_plans={max_shape_plans} plans are kept, one per input shape, so such a step runs against the "
            f"current plan, and plainly from where it does not match; pad to fewer lengths (a collator's "
            f"pad_to_multiple_of=...) or pass optimize(..., max_shape_plans=N).")


_ACCUMULATION_FIX = ("(pad them to one length: the Hugging Face Trainer collates each micro-batch on its own, so "
                     "pad to a fixed length there, padding='max_length')")


def _a_forward_no_backward_read(trace, forward_starts):
    """Whether one of the step's forwards (beginning at the op ids forward_starts) saved activations none of
    which a backward op of the step read (See Note [A profiled forward that no backward read])."""
    if not forward_starts or len(forward_starts) < 2:
        return False  # one forward: the step's backward followed it (or there was none: refused elsewhere)
    ops = trace.ops
    starts = sorted(forward_starts)
    saved = [False] * len(starts)
    read = [False] * len(starts)
    for t in trace.tensors:
        if t.kind != "activation" or t.producer_op < 0 or not t.uses or ops[t.uses[0]].phase != "forward":
            continue
        # the forward of its first use: the loop's next batch, made before that forward began, is that one's
        i = bisect.bisect_right(starts, t.uses[0]) - 1
        if i < 0:
            continue
        saved[i] = True
        if not read[i] and any(ops[u].phase == "backward" for u in t.uses):
            read[i] = True
    return any(s and not r for s, r in zip(saved, read))


def _explain_profiled_oom(exc):
    """A profiled forward that kept every saved activation on the device ran out of memory: say how
    to profile a step that does not fit (Note [Profiling a step that does not fit])."""
    if exc is None or getattr(exc, "_memsched_noted", False) or not hasattr(exc, "add_note"):
        return
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        exc._memsched_noted = True
        exc.add_note("memsched: this is the first, profiled step, which kept every saved activation on the device "
                     "as plain PyTorch does (optimize(..., profile='keep'), or profile='auto' with a budget that is "
                     "a fraction or a percentage, which is only resolved to bytes by this profile). Pass the "
                     "budget in bytes (budget='6GiB') or profile='offload' so that the profiled step keeps its "
                     "saved activations in host memory")


_HOOK_REFUSALS = ("don't yet support saved tensor hooks", "saved tensors default hooks are disabled")


def _explain_hook_refusal(exc):
    """Note [Forwards that refuse saved-tensor hooks]: torch.func transforms (grad, vjp, jacrev, ...)
    and disable_saved_tensors_hooks inside the model's forward refuse any saved-tensor hooks, and
    memsched's cover the whole forward. The error is PyTorch's; say why it happens under memsched."""
    if exc is None or getattr(exc, "_memsched_noted", False) or not hasattr(exc, "add_note"):
        return
    if any(s in str(exc) for s in _HOOK_REFUSALS):
        exc._memsched_noted = True
        exc.add_note("memsched: this forward runs under memsched.optimize(), whose saved-tensor hooks cover the "
                     "whole step, and torch.func transforms (or disable_saved_tensors_hooks) inside a forward "
                     "refuse any saved-tensor hooks. Apply the transform outside the module memsched wraps, or "
                     "train this model without memsched.optimize()")


def _explain_pass_through(exc):
    """An error of the model's forward (a dtype mismatch, a wrong shape) raised through memsched's dispatch
    mode or hooks has memsched's files near the end of its traceback, which read as memsched's failure
    (found by a helper trying the README as a new user): a note says those frames pass the op on unchanged."""
    if exc is None or getattr(exc, "_memsched_noted", False) or not hasattr(exc, "add_note") \
            or isinstance(exc, _C.MemschedError):
        return
    import os
    ours = os.path.dirname(os.path.abspath(__file__)) + os.sep
    tb, through, last_ours = exc.__traceback__, False, False
    while tb is not None:
        last_ours = os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(ours)
        through = through or last_ours
        tb = tb.tb_next
    if not through or last_ours:
        # raised in memsched's own code (its innermost frame is ours: a call into _C), not by an op it
        # passed on: plain PyTorch need not raise it, and the note would say it does
        return
    exc._memsched_noted = True
    exc.add_note("memsched: raised by an op of the model's forward; the memsched frames in this traceback "
                 "are its profiler or executor passing that op on to PyTorch unchanged. The same "
                 "forward without memsched.optimize() raises it too")


def _check_optimizer_owns_model(model, optimizer):
    """Note [An optimizer over another model]
      Rationale: optimize(model, optimizer) with an optimizer built over another module's parameters
      (a copy made before the optimizer, the teacher of a distillation loop, a stale object from a
      notebook cell) ran without a word: memsched profiled and planned `model` while every
      optimizer.step() updated the other module, so `model` never trained.
      Approach: refused here, before any work, when `model` has trainable parameters and none of them
      is in the optimizer. Parameters outside `model` beside some of its own (a learned temperature
      or loss weight used in the loss) are what plain PyTorch trains too, and are accepted: memsched
      plans the model's activations and the optimizer steps them all. An optimizer over part of the
      model (fine-tuning a head) is accepted as well.
    """
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        return
    stepped = {id(p) for g in groups if isinstance(g, dict) for p in g.get("params", ())}
    own = [p for p in model.parameters() if p.requires_grad]
    if not stepped or not own or any(id(p) in stepped for p in own):
        return
    raise ValueError(
        f"optimizer: none of its {counted(len(stepped), 'parameter')} belongs to `model` "
        f"({type(model).__name__}, {counted(len(own), 'trainable parameter')}), so "
        f"optimizer.step() would never update the model memsched runs; build the optimizer from this model, "
        f"e.g. torch.optim.AdamW(model.parameters(), ...) (extra parameters outside the model, such as a "
        f"learned temperature, may be added beside them)")


def compiled_module_reason(model):
    """Why `model` runs plainly because it (or a submodule) is compiled, or None. See Note [Compiled
    modules run plainly]."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without dynamo compiles nothing
        OptimizedModule = ()
    for name, m in model.named_modules():
        where = "the model" if not name else f"submodule '{name}'"
        if isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None:
            how = "torch.compile(module)" if isinstance(m, OptimizedModule) else "module.compile()"
            return f"{where} is compiled ({how})"
        if getattr(m.__dict__.get("forward"), "_torchdynamo_orig_callable", None) is not None:
            # module.forward = torch.compile(module.forward); Lightning's fit(torch.compile(module)) does so
            return f"{where} is compiled (its forward is torch.compile(module.forward))"
    return None


def optimize(model, optimizer=None, budget=None, planner="dp", device=None, ooo=False, fuse_optimizer=False,
             **options):
    """Train `model` under a memory budget: see the module docstring and Note [Budgets].

    Options: min_offload_bytes (size floor; default 1 MiB on CUDA, 0 on CPU),
    max_reprofiles (default 2), max_shape_plans (plans kept, one per input shape of a step's first forward,
    default 8; 1: one plan -- See Note [One plan per input shape] in offload/shape_plans.py), device_model (the memsched.DeviceModel the plan and its simulation use; memsched.plan and memsched.simulate take it as device=), grad_accumulation_steps
    (with ooo/fuse_optimizer: backward passes per optimizer step, default 1; run.step() may follow
    each of them or only the last -- See Note [Fused update and gradient accumulation] in
    ooo/backward.py), timeline (record per-step memory samples and copies for run.save_timeline(),
    default False), history (executed steps whose StepStats run.step_stats keeps, default 100;
    run.report() counts every step), host_memory_limit (most bytes of host copies alive at once:
    bytes, '64GiB' or a fraction of RAM; default half of the machine's RAM -- See Note [Host memory
    limit] in offload/host_buffers.py), profile ('auto', the default: 'offload' when the budget is in
    bytes, else 'keep'; 'offload': the first, profiled step keeps its saved activations in host
    memory, so a step that does not fit the device can be profiled -- the only way for a budget
    that is a fraction or a percentage, which is resolved from the profile; 'keep': on the device,
    as plain PyTorch -- See Note [Profiling a step that does not fit]).
    Every argument is checked here, before any step: a ValueError (TypeError for an unknown option)
    names the argument and what it accepts.
    """
    unknown = [k for k in options if k not in _OPTIONS]
    if unknown:
        raise TypeError(f"optimize(): unknown option {unknown[0]!r}; known options: {', '.join(_OPTIONS)} "
                        "(and model, optimizer, budget, planner, device, ooo, fuse_optimizer)")
    return Run(model, optimizer=optimizer, budget=budget, planner=planner, device=device, ooo=ooo,
               fuse_optimizer=fuse_optimizer, **options)
