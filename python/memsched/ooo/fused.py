"""Optimizer steps for the fused update, with torch's own optimizer implementations.

Entry point: ``ParamStepper(optimizer).step_params(params)`` (``step(param)`` for one).

Note [Per-parameter step through a one-parameter group view]
  Rationale: the fused update must apply exactly torch.optim's math (SGD with
  momentum, Adam, AdamW -- including their options: weight decay, nesterov,
  amsgrad, maximize, foreach/fused kernels) to the parameters whose gradients
  are final, the moment they are, without keeping the other gradients around.
  Approach: for the call, ``optimizer.param_groups`` is replaced by one group
  that is a shallow copy of the parameters' real group with ``params`` set to
  them; ``optimizer.step()`` then runs torch's implementation on them with
  their state ``optimizer.state[p]`` (keyed by the parameter, so shared with the
  real optimizer: momentum buffers, exp_avg, step counts persist as usual). The
  hyper-parameters (lr, betas, weight_decay, ...) are read from the real group
  at every call, so learning-rate schedulers keep working. On CPU torch's
  default is the single-tensor path, which already loops parameter by
  parameter: the result is bitwise what a full ``optimizer.step()`` gives.
  This path is now the fallback of Note [Grouped step through torch's
  functional optimizer]: it runs when step hooks are registered, when step()
  was replaced on the instance or class, or for a differentiable group.
  Limitations: optimizer step hooks run once per call (a ready group of
  parameters) and see the view (OutOfOrderBackward warns once: a hook that edits
  hyper-parameters edits the view); ``step()``'s closure argument is not
  supported; optimizers whose update couples parameters (LBFGS, or anything
  with a global norm) cannot be fused and are rejected. On CUDA the default
  foreach path runs on the group's lists: same elementwise math.

Note [Grouped step through torch's functional optimizer]
  Rationale: ``Optimizer.step()`` per parameter cost about 51 us on CPU against
  14 us per parameter for one step over all of them: the profiler's
  record_function, the hook chains, the grad-mode wrapper and the param-group
  loop are paid per call.
  Approach: ``step_params`` takes the parameters that became ready together
  (a module's own parameters, a DDP bucket), splits them by param group and
  per group does what ``Adam.step`` / ``SGD.step`` does for that group, minus
  the wrapper: the optimizer's own ``_init_group`` on a view of the group
  (lazy state init is torch's: step tensor, exp_avg, exp_avg_sq,
  max_exp_avg_sq, momentum_buffer), then the functional ``adam(...)`` /
  ``sgd(...)`` with every hyper-parameter read from the real group at this
  call (lr schedulers), ``grad_scale``/``found_inf`` from the optimizer, and
  foreach decided as plain torch.optim decides it for the whole group
  (``_default_to_fused_or_foreach`` over the group's parameters, then Adam's
  tensor-lr rule), so a subset takes the kernel path the full step would take
  and the result is bitwise the same. Grad mode is off for the call (as
  ``_use_grad_for_differentiable`` does for differentiable=False); on an
  accelerator Adam's graph-capture check runs first; ``_opt_called`` is set as
  the LR scheduler's step wrapper would (no "scheduler before optimizer"
  warning).
  Limitations: no "Optimizer.step#..." record_function range appears in
  profiler traces for fused updates; a class-level replacement of step() or a
  registered hook switches to the slower view path.

Note [Adam plan for the C++ update]
  Rationale: even the grouped functional call cost about 50 us per layer on
  CPU (the fused update ran at 1.37-1.41x a plain step of a 6-layer decoder);
  csrc/torch/adam_update.h runs Adam/AdamW's update in C++ (See Note [Adam
  update in C++]) with no Python per ready group.
  Approach: ``native_plan(params)`` runs once per backward pass (the owner's
  _backward_started, last micro-step) and says, per parameter, whether C++
  may step it: Adam or AdamW with torch's own step(), no step hooks, no
  GradScaler attributes, no CUDA graph capture under way, and a group that is
  neither differentiable nor capturable, with float lr and betas (the grouped
  path's rules otherwise);
  the kernel is the one this path would pick (explicit foreach/fused, else
  plain torch.optim's default for the group). The parameter's state tensors
  (step, exp_avg, exp_avg_sq, max_exp_avg_sq) are handed over as they are in
  ``optimizer.state[p]``, so C++ updates torch's own state in place. A
  parameter whose state torch has not created yet (its first step), a complex
  parameter or a missing state entry stays on the grouped Python path, which
  creates the state as torch does. The hyper-parameters are read at the start
  of each backward pass, so LR schedulers stepping between iterations work.
  The plan is built once and kept by the runtime from one backward pass to the next
  (``install_native_plan``): building it walked every parameter's state in Python (~350 us a
  backward pass for a 76-parameter decoder on a loaded 2-core machine). Each pass recomputes only
  the per-group hyper-parameters (``set_adam_hypers`` when an LR scheduler changed one) and
  compares, by identity, what the per-parameter part was built from (``_plan_current``): the
  group membership (``sync_groups``: every group's parameters, so a parameter moved from one
  existing group to another, two swapped, a ``params`` list replaced or a parameter removed are
  seen although the group count stays; the grouped Python path, SGD included, steps with the
  membership read there too), ``param_groups`` and each group object, which groups C++ may step
  and their amsgrad; the ``optimizer.state`` object, its parameters and their dict objects
  (``state[p] = {}``, ``del state[p]``); each C++ parameter's dict values in order
  (``state[p].clear()`` as warm restarts do, a replaced step, exp_avg, exp_avg_sq or
  max_exp_avg_sq tensor); and whether a parameter left to Python for want of state now has it.
  That is a few identity checks per parameter and state entry, nothing per element. A change
  there builds a fresh plan from the state as it is now (a cleared state goes to the Python path,
  which re-creates it as torch does, and back to C++ the pass after); ``optimizer.load_state_dict``
  drops the plan at once (a post-hook), so the old state tensors are not kept alive.
  Limitations: a change of lr, of the param groups or of the state made during a backward pass
  (from a hook) is not seen by that pass's updates; a state tensor changed in place
  (``exp_avg.zero_()``) needs nothing, C++ updates that very tensor; state tensors shared between
  parameters are not detected (the fused update's per-layer order then differs from plain's).
"""
from __future__ import annotations

import inspect
from itertools import chain
from operator import is_
from typing import Dict, List, Sequence

import torch
from torch.optim import adam as _adam_mod
from torch.optim import optimizer as _opt_mod
from torch.optim import sgd as _sgd_mod

from memsched._C import MemschedError

SUPPORTED_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def _noop():
    pass


# Note [C++ Adam checked against torch's]
#   Rationale: the C++ update (Note [Adam update in C++]) repeats, op by op, what torch.optim's Adam
#   does in the torch it was written against; another torch version may compute otherwise (a new
#   op order, another scalar rounding), and a fused update must stay bitwise plain's.
#   Approach: before a configuration (optimizer class, kernel, amsgrad, maximize, decoupled weight
#   decay, the betas, eps and weight decay, foreach/fused flags, device type, dtype) is first stepped in C++
#   in this process, torch's own optimizer of that class steps two small random parameters three
#   times, and the C++ update repeats steps 2 and 3 from a copy of the state after step 1 (torch
#   creates it). Only a bitwise match of parameters and state lets the configuration use C++;
#   otherwise it stays on the Python path, which calls torch's own functions. Cached per process.
_NATIVE_CHECKED: Dict[tuple, bool] = {}


def _native_agrees(opt_type, hyper, group, device, dtype) -> bool:
    # the values of betas, eps and weight decay too (constant in practice): one dtype's rounding of a scalar
    # can agree at one value and not at another (bf16 betas (0.9, 0.999) and (0.9, 0.95), an overload that
    # rounded the scalar first); lr is left out, as LR schedulers change it every step
    key = (opt_type, hyper[1:5], hyper[5:], group["foreach"], group["fused"], device.type, dtype)
    ok = _NATIVE_CHECKED.get(key)
    if ok is None:
        try:
            ok = _check_native(opt_type, hyper, group, device, dtype)
        except Exception:  # noqa: BLE001 -- any failure means: not proven equal, use torch's own path
            ok = False
        _NATIVE_CHECKED[key] = ok
    return ok


def _check_native(opt_type, hyper, group, device, dtype) -> bool:
    from memsched import _C

    lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled, _ = hyper
    gen = torch.Generator().manual_seed(0)
    shapes = ((5,), (3, 4))
    rand = lambda shape: torch.randn(shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    ref = [torch.nn.Parameter(rand(s)) for s in shapes]
    grads = [[rand(s) for s in shapes] for _ in range(3)]
    kw = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
              foreach=group["foreach"], fused=group["fused"])
    if opt_type is torch.optim.Adam and "decoupled_weight_decay" in group:
        kw["decoupled_weight_decay"] = decoupled
    opt = opt_type(ref, **kw)
    native = None
    for k in range(3):
        for p, g in zip(ref, grads[k]):
            p.grad = g.clone()
        if k >= 1:
            with torch.no_grad():
                _C.adam_update(hyper, native[0], [g.clone() for g in grads[k]], *native[1:])
        opt.step()
        if k == 0:
            st = [opt.state[p] for p in ref]
            native = ([p.detach().clone() for p in ref], [s["step"].clone() for s in st],
                      [s["exp_avg"].clone() for s in st], [s["exp_avg_sq"].clone() for s in st],
                      [s["max_exp_avg_sq"].clone() if amsgrad else None for s in st])
    st = [opt.state[p] for p in ref]
    pairs = list(zip(ref, native[0]))
    for name, mine in (("step", native[1]), ("exp_avg", native[2]), ("exp_avg_sq", native[3])) + \
            ((("max_exp_avg_sq", native[4]),) if amsgrad else ()):
        pairs += list(zip((s[name] for s in st), mine))
    return all(torch.equal(a.detach(), b) for a, b in pairs)


# Code objects of torch's own layers of Optimizer.step: the profiler/hook wrapper
# Optimizer._patch_step_function puts on the class, the grad-mode wrapper and the step itself.
_STOCK_CODES = {torch.optim.Optimizer.profile_hook_step(_noop).__code__,
                _opt_mod._use_grad_for_differentiable(_noop).__code__}
_STOCK_CODES.update(inspect.unwrap(cls.step).__code__ for cls in SUPPORTED_OPTIMIZERS)


def _stock_step(opt: torch.optim.Optimizer) -> bool:
    """True when opt.step is torch's own (with its profiler/hook wrapper), possibly wrapped by an LR
    scheduler's step tracker: nothing else would run when step() is called."""
    fn = opt.__dict__.get("step")
    while getattr(fn, "_memsched_step_hook", False):
        # memsched.optimize's step routing (step_hook.py) adds nothing to a fused update: look through it
        fn = fn.__wrapped__
        if getattr(fn, "__self__", None) is opt:
            fn = None  # it wraps the class's step itself
    if fn is not None:
        if not getattr(fn, "_wrapped_by_lr_sched", False):
            return False
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    else:
        fn = type(opt).step
    while fn is not None:
        if getattr(fn, "__code__", None) not in _STOCK_CODES:
            return False
        fn = getattr(fn, "__wrapped__", None)
    return True


# ids of the global optimizer step pre-hooks memsched.optimize registers (Note [Another optimizer over
# the Run's parameters] in optimize.py): not the caller's, so they do not count as step hooks here
OWN_GLOBAL_PRE_HOOKS: set = set()


def has_step_hooks(opt: torch.optim.Optimizer) -> bool:
    return bool(opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                or any(k not in OWN_GLOBAL_PRE_HOOKS for k in _opt_mod._global_optimizer_pre_hooks)
                or _opt_mod._global_optimizer_post_hooks)


def _adam_state_ready(st) -> bool:
    return bool(st) and torch.is_tensor(st.get("step"))


class _PlanSource:
    """What an installed native plan was built from (See Note [Adam plan for the C++ update]); a backward
    pass keeps the plan only while all of it is unchanged."""

    __slots__ = ("state", "keys", "dicts", "native_dicts", "values", "param_groups", "groups", "generation",
                 "native_of", "amsgrad", "waiting")

    def __init__(self, state, param_groups, generation, native_of, amsgrad, native_dicts, waiting):
        self.state = state  # the optimizer.state object
        self.keys = tuple(state.keys())  # its parameters, in order
        self.dicts = tuple(state.values())  # and their state dict objects (state[p] = {} replaces one)
        self.native_dicts = native_dicts  # the state dicts (dict objects) of the parameters C++ steps
        self.values = tuple(chain.from_iterable(map(dict.values, native_dicts)))  # and their values, in order
        self.param_groups = param_groups
        self.groups = tuple(param_groups)
        self.generation = generation  # ParamStepper.refresh() count: group membership
        self.native_of = native_of
        self.amsgrad = amsgrad  # per hyper: amsgrad (the plan has max_exp_avg_sq or not)
        self.waiting = waiting  # parameters of a C++ group left to Python for want of state


class ParamStepper:
    """Applies ``optimizer``'s update to the given parameters only."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        if type(optimizer) not in SUPPORTED_OPTIMIZERS:
            raise MemschedError(
                f"fuse_optimizer=True supports torch.optim.SGD, Adam and AdamW (per-parameter updates); "
                f"got {type(optimizer).__module__}.{type(optimizer).__qualname__}. Use fuse_optimizer=False "
                f"and call optimizer.step() after backward.")
        self.optimizer = optimizer
        self._is_sgd = type(optimizer) is torch.optim.SGD
        self.stepping = 0  # > 0 inside step_params (memsched.optimize's step routing passes its calls through)
        self.steps = 0  # COUNT: per-parameter updates applied
        self.calls = 0  # COUNT: grouped step calls (one per param group per step_params)
        self._group_of: Dict[int, int] = {}
        self._default_foreach: List[bool] = []
        self._on_accelerator: List[bool] = []
        self._kinds: List[set] = []  # per group, the (device, dtype) of its trainable parameters
        self._checked_step = None  # (class step, instance step) that _stock was computed for
        self._stock = False
        self._generation = 0  # refresh() count: group membership and kinds changed
        self._members = ()  # per group, its parameters at the last refresh()
        # See Note [Adam plan for the C++ update]: the plan installed in a DwRuntime, and what it was made from
        self.plans_built = 0  # COUNT: per-parameter plans built (install_native_plan)
        self._rt = None
        self._plan_from = None  # _PlanSource
        self._plan_hypers = None
        self._load_hook = optimizer.register_load_state_dict_post_hook(self._on_state_loaded)
        self.refresh()

    def refresh(self) -> None:
        """Re-reads which group each parameter belongs to (after add_param_group, or a group's params
        edited in place)."""
        self._group_of = {}
        self._members = tuple(tuple(g["params"]) for g in self.optimizer.param_groups)
        self._default_foreach = []
        self._on_accelerator = []
        self._kinds = []
        self._generation += 1
        for gi, group in enumerate(self.optimizer.param_groups):
            params = [p for p in group["params"] if p.requires_grad]
            for p in group["params"]:
                self._group_of[id(p)] = gi
            # what plain torch.optim picks for the whole group when foreach and fused are None
            self._default_foreach.append(_opt_mod._default_to_fused_or_foreach(params, False, use_fused=False)[1])
            self._on_accelerator.append(any(p.device.type != "cpu" for p in params))
            self._kinds.append({(p.device, p.dtype) for p in params})

    def sync_groups(self) -> None:
        """refresh() if a param group was added, or a group's parameters changed since the last refresh:
        a parameter moved from one group to another (or two swapped: the sizes stay), a ``params`` list
        replaced. Once per backward pass (install_native_plan): one identity check per parameter."""
        pg = self.optimizer.param_groups
        members = self._members
        if len(pg) != len(members) or not all(
                len(g["params"]) == len(m) and all(map(is_, g["params"], m)) for g, m in zip(pg, members)):
            self.refresh()

    def owns(self, param: torch.Tensor) -> bool:
        return id(param) in self._group_of

    def close(self) -> None:
        """Removes the optimizer hook and drops the installed plan's reference (safe to call twice)."""
        if self._load_hook is not None:
            self._load_hook.remove()
            self._load_hook = None
        self.forget_native_plan()

    def forget_native_plan(self) -> None:
        """The runtime dropped its plan (abandon): the next backward pass installs a fresh one."""
        self._rt = None
        self._plan_from = None
        self._plan_hypers = None

    def _on_state_loaded(self, optimizer) -> None:
        # optimizer.load_state_dict(): the plan's state tensors are the old ones; release them now
        if self._rt is not None:
            self._rt.clear_adam()
        self.forget_native_plan()

    def install_native_plan(self, rt, params: Sequence[torch.Tensor]) -> None:
        """See Note [Adam plan for the C++ update]: hands rt (a DwRuntime) the plan for this backward
        pass. The per-parameter plan is built again only when what it was built from changed;
        otherwise rt keeps it, with new hyper-parameters if a group's changed. Also the start of the
        pass for the grouped Python path: the group membership step_params uses is read again."""
        self.sync_groups()  # for SGD too: step_params steps each parameter with its group's hypers
        groups = self._native_groups()
        if groups is None:
            if self._rt is not None:
                rt.clear_adam()
                self.forget_native_plan()
            return
        hypers, native_of = groups
        opt = self.optimizer
        pg = opt.param_groups
        made = self._plan_from
        if made is not None and self._rt is rt and self._plan_current(made, hypers, native_of):
            if hypers != self._plan_hypers:
                rt.set_adam_hypers(hypers)  # an LR scheduler stepped
                self._plan_hypers = hypers
            return
        self.plans_built += 1
        plan = self._param_plan(params, hypers, native_of)
        if plan is None:
            rt.clear_adam()
            self.forget_native_plan()
            return
        rt.set_adam(*plan)
        self._rt = rt
        # parameters of a C++ group left to Python for want of state: once torch made it, plan again
        waiting = [p for p, g in zip(params, plan[1])
                   if g < 0 and native_of.get(self._group_of.get(id(p)), -1) >= 0 and not p.is_complex()]
        state_of = opt.state.get
        native_dicts = tuple(state_of(p) for p, g in zip(params, plan[1]) if g >= 0)
        self._plan_from = _PlanSource(opt.state, pg, self._generation, native_of, tuple(h[5] for h in hypers),
                                      native_dicts, waiting)
        self._plan_hypers = hypers

    def _plan_current(self, made: _PlanSource, hypers, native_of) -> bool:
        """Whether the installed plan still holds what _param_plan would gather now: the same group
        membership and C++ groups, and in ``optimizer.state`` the same parameters with the same dict
        objects, each of the C++ parameters' dicts with the same values in the same order (clear(), a
        replaced exp_avg or step change that), no parameter waiting for state got it. A few identity
        checks per parameter and state entry, none per element."""
        opt = self.optimizer
        state, pg = opt.state, opt.param_groups
        if made.state is not state or made.generation != self._generation or made.native_of != native_of or \
                made.param_groups is not pg or len(made.groups) != len(pg) or not all(map(is_, made.groups, pg)) or \
                made.amsgrad != tuple(h[5] for h in hypers):
            return False
        if len(state) != len(made.keys) or not all(map(is_, state.keys(), made.keys)) or \
                not all(map(is_, state.values(), made.dicts)):
            return False  # a state entry added, deleted or replaced (state[p] = {})
        if sum(map(len, made.native_dicts)) != len(made.values) or \
                not all(map(is_, chain.from_iterable(map(dict.values, made.native_dicts)), made.values)):
            return False  # a C++ parameter's state cleared, or a tensor of it replaced
        state_of = state.get
        return not any(_adam_state_ready(state_of(p)) for p in made.waiting)

    def native_plan(self, params: Sequence[torch.Tensor]):
        """See Note [Adam plan for the C++ update]: the arguments of DwRuntime.set_adam for these
        parameters (in the runtime's order), or None when no parameter can be stepped in C++."""
        self.sync_groups()
        groups = self._native_groups()
        return None if groups is None else self._param_plan(params, *groups)

    def _native_groups(self):
        """Per param group that C++ may step: (hypers, native_of: group index -> index in hypers), or
        None when no group qualifies."""
        opt = self.optimizer
        if self._is_sgd or has_step_hooks(opt):
            return None
        key = (type(opt).step, opt.__dict__.get("step"))
        if key != self._checked_step:
            self._stock = _stock_step(opt)
            self._checked_step = key
        if not self._stock or getattr(opt, "grad_scale", None) is not None or \
                getattr(opt, "found_inf", None) is not None:
            return None
        hypers, native_of = [], {}  # the caller ran sync_groups(): _kinds and _default_foreach are current
        for gi, group in enumerate(opt.param_groups):
            lr, (beta1, beta2) = group["lr"], group["betas"]
            if group["differentiable"] or group["capturable"] or any(
                    torch.is_tensor(v) for v in (lr, beta1, beta2, group["eps"], group["weight_decay"])):
                continue
            if self._on_accelerator[gi] and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                continue  # the Python path runs Adam's graph-capture health check (it raises)
            foreach, fused = group["foreach"], group["fused"]
            if foreach is None and fused is None:
                foreach = self._default_foreach[gi]
            kernel = 2 if fused else (1 if foreach else 0)
            hyper = (float(lr), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                     bool(group["amsgrad"]), bool(group["maximize"]), bool(group.get("decoupled_weight_decay", False)),
                     kernel)
            if not all(_native_agrees(type(opt), hyper, group, dev, dt) for dev, dt in self._kinds[gi]):
                continue  # See Note [C++ Adam checked against torch's]: this torch computes otherwise
            native_of[gi] = len(hypers)
            hypers.append(hyper)
        if not hypers:
            return None
        return hypers, native_of

    def _param_plan(self, params, hypers, native_of):
        """The per-parameter part of native_plan: each parameter's group and state tensors."""
        state = self.optimizer.state
        group_of, steps, exp_avgs, exp_avg_sqs, maxes = [], [], [], [], []
        for p in params:
            g = native_of.get(self._group_of.get(id(p)), -1)
            st = state.get(p) if g >= 0 else None  # .get: opt.state is a defaultdict
            if not isinstance(st, dict):
                st = None  # (a mapping of another kind put there by hand: torch's own code reads it)
            step = st.get("step") if st else None
            amsgrad = g >= 0 and hypers[g][5]
            if not torch.is_tensor(step) or not torch.is_tensor(st.get("exp_avg")) or \
                    not torch.is_tensor(st.get("exp_avg_sq")) or \
                    (amsgrad and not torch.is_tensor(st.get("max_exp_avg_sq"))) or p.is_complex():
                g, st = -1, None
            group_of.append(g)
            steps.append(step if st else None)
            exp_avgs.append(st["exp_avg"] if st else None)
            exp_avg_sqs.append(st["exp_avg_sq"] if st else None)
            maxes.append(st["max_exp_avg_sq"] if st and amsgrad else None)
        if all(g < 0 for g in group_of):
            return None
        return hypers, group_of, steps, exp_avgs, exp_avg_sqs, maxes

    def step(self, param: torch.Tensor) -> None:
        """One optimizer update of ``param`` from ``param.grad``; the gradient is then freed."""
        self.step_params([param])

    def step_params(self, params: Sequence[torch.Tensor]) -> None:
        """One optimizer update of each of ``params`` (each with a final .grad), grouped by param
        group; the gradients are then freed. Parameters this optimizer does not own are left alone."""
        by_group: Dict[int, List[torch.Tensor]] = {}
        for p in params:
            gi = self._group_of.get(id(p))
            if gi is None:
                self.refresh()
                gi = self._group_of.get(id(p))
                if gi is None:
                    continue  # not optimized by this optimizer: leave the gradient alone
            if p.grad is None:
                continue
            by_group.setdefault(gi, []).append(p)
        if not by_group:
            return
        self.stepping += 1
        try:
            self._step_groups(by_group)
        finally:
            self.stepping -= 1

    def _step_groups(self, by_group: Dict[int, List[torch.Tensor]]) -> None:
        opt = self.optimizer
        key = (type(opt).step, opt.__dict__.get("step"))
        if key != self._checked_step:
            self._stock = _stock_step(opt)
            self._checked_step = key
        direct = self._stock and not has_step_hooks(opt)
        for gi, ps in by_group.items():
            group = opt.param_groups[gi]
            if direct and not group["differentiable"]:
                self._functional_step(gi, group, ps)
            else:
                self._view_step(group, ps)
            for p in ps:
                p.grad = None
            self.steps += len(ps)
            self.calls += 1

    def _view_step(self, group: dict, ps: List[torch.Tensor]) -> None:
        # See Note [Per-parameter step through a one-parameter group view]
        opt = self.optimizer
        view = dict(group)
        view["params"] = ps
        saved = opt.param_groups
        opt.param_groups = [view]
        try:
            opt.step()
        finally:
            opt.param_groups = saved

    def _functional_step(self, gi: int, group: dict, ps: List[torch.Tensor]) -> None:
        # See Note [Grouped step through torch's functional optimizer]
        opt = self.optimizer
        view = dict(group)
        view["params"] = ps
        prev_grad = torch.is_grad_enabled()
        if prev_grad:
            torch.set_grad_enabled(False)
        try:
            foreach, fused = group["foreach"], group["fused"]
            if foreach is None and fused is None:
                foreach = self._default_foreach[gi]
            if self._is_sgd:
                params: List[torch.Tensor] = []
                grads: List[torch.Tensor] = []
                bufs: List = []
                has_sparse_grad = opt._init_group(view, params, grads, bufs)
                _sgd_mod.sgd(params, grads, bufs, weight_decay=group["weight_decay"], momentum=group["momentum"],
                             lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"],
                             maximize=group["maximize"], has_sparse_grad=has_sparse_grad, foreach=foreach,
                             fused=fused, grad_scale=getattr(opt, "grad_scale", None),
                             found_inf=getattr(opt, "found_inf", None))
                if group["momentum"] != 0:
                    state = opt.state
                    for p, buf in zip(params, bufs):
                        state[p]["momentum_buffer"] = buf
            else:
                if self._on_accelerator[gi]:
                    opt._accelerator_graph_capture_health_check()
                lr = group["lr"]
                if foreach and group["foreach"] is None and torch.is_tensor(lr) and not group["capturable"]:
                    foreach = False  # Adam's rule: no foreach for a tensor lr without capturable
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps = [], [], [], [], [], []
                has_complex = opt._init_group(view, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                              state_steps)
                beta1, beta2 = group["betas"]
                _adam_mod.adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                               amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2,
                               lr=lr, weight_decay=group["weight_decay"], eps=group["eps"],
                               maximize=group["maximize"], foreach=foreach, capturable=group["capturable"],
                               differentiable=False, fused=fused, grad_scale=getattr(opt, "grad_scale", None),
                               found_inf=getattr(opt, "found_inf", None),
                               decoupled_weight_decay=group["decoupled_weight_decay"])
        finally:
            if prev_grad:
                torch.set_grad_enabled(True)
        opt._opt_called = True  # what the LR scheduler's step wrapper records
