"""optimizer.step() as a step boundary of memsched.optimize(), for loops that never call run.step().

Entry point: OptimizerStepHook(optimizer, on_step).install() / .remove(); used by optimize.py's Run.

Note [optimizer.step() without run.step()]
  Rationale: Hugging Face Trainer, accelerate and Lightning own the training loop: they call
  optimizer.step() (after their gradient accumulation, clipping and unscaling) and
  optimizer.zero_grad() themselves, so run.step() cannot be put in their loop. The Run must still
  close the profiled step and plan it, or end an executed step (pop the saved-tensor hooks, wait
  for copies, collect its StepStats), after the last backward pass and before the parameters
  change -- exactly where run.step() did it.
  Approach: while a Run is active its optimizer's `step` is routed through the Run: a bound method
  set on the optimizer instance (as torch's LR schedulers do) calls Run._framework_step(step,
  args, kwargs), which (1) runs the caller's closure first, if one was passed (Lightning runs
  training_step and backward inside optimizer.step(closure); torch's SGD/Adam/AdamW call the
  closure once, first, under enable_grad, so calling it ourselves is the same), (2) ends the
  step as run.step() does before its update (the same Run._finish_step()), (3) runs the real
  update, with the arguments given, unless the fused out-of-order update already ran during
  backward (as run.step() skips optimizer.step() then), (4) records the step. zero_grad and
  gradient accumulation stay the framework's: the memsched step spans every forward and backward
  pass between two optimizer.step() calls, as with run.step() called once per K backward passes.
  run.step() keeps working: its own optimizer.step() call passes straight through.
  Why not Optimizer.register_step_pre_hook: torch iterates the hook dictionaries while calling
  them, and closing the profiled step removes the profiler session's own optimizer step hooks
  from those dictionaries (RuntimeError: OrderedDict mutated during iteration); a pre-hook also
  runs before a closure's forward and backward, and cannot skip the update. A bound method set on
  the instance keeps every hook of torch's step working, and stays compatible with LR schedulers,
  which wrap the same attribute (before or after us; their `_wrapped_by_lr_sched` mark is kept).
  The fused update's ParamStepper looks through this routing (fused.py: _stock_step), and its
  fallback path's own optimizer.step() calls during backward pass straight through.
  accelerate's AcceleratedOptimizer with a GradScaler (mixed_precision="fp16") keeps the optimizer's
  step method from when it was built, sets a patched copy of it on the optimizer for each step and
  then that kept method: it overwrote the routing of a Run entered after accelerator.prepare(), so
  no step boundary was ever seen and nothing planned (found by a helper training with accelerate).
  install() given that wrapper re-points both (_optimizer_original_step_method and the patched one,
  through accelerate's own patch_optimizer_step) at the routing, and remove() puts them back.
  A step that GradScaler skips (inf/NaN gradients under fp16, common in its first steps) never
  reaches optimizer.step(): the memsched step ran on into the next iteration, so a profile covered
  two (a byte budget the loop met was refused mid-training, and executed steps mismatched; found by a
  helper). While a hook is active, GradScaler.step (and a subclass's own) is wrapped: when it returns
  without having called the routed optimizer.step(), the routing gets the step boundary with no update
  (Note [A step GradScaler skipped]).
  Limitations: an optimizer whose step evaluates the closure more than once (LBFGS) is refused
  when a closure is passed; a step skipped another way (the loop catching an error before its step)
  still runs on into the next one (it mismatches the plan, runs plainly and is re-profiled: never a
  wrong gradient). remove() restores the attribute, unless
  something wrapped it after us: then our layer stays, passing every call through.
"""
import contextlib
import sys
import types
import weakref

import torch

from memsched._C import MemschedError

__all__ = ["OptimizerStepHook", "accelerate_end_of_dataloader", "accelerate_wrappers", "accelerate_would_not_step",
           "is_skipped_update", "is_step_hook", "torch_optimizer"]


def torch_optimizer(optimizer):
    """The torch.optim.Optimizer a framework's wrapper steps: accelerate's AcceleratedOptimizer (a
    torch.optim.Optimizer subclass holding the real one in .optimizer, whose step() it calls only
    on the micro-batch that ends an accumulation) or Lightning's LightningOptimizer (._optimizer).
    Routing the real optimizer's step makes the memsched step span the whole accumulation. Anything
    else is returned as it is."""
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            inner = getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer or not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer


def accelerate_wrappers(optimizer):
    """accelerate's AcceleratedOptimizer objects alive around `optimizer`, among its referrers; none when
    accelerate's optimizer module is not loaded (Note [run.step() with a framework's optimizer wrapper] in
    optimize.py)."""
    module = sys.modules.get("accelerate.optimizer")
    cls = getattr(module, "AcceleratedOptimizer", None)
    if cls is None:
        return []
    import gc
    found = []
    for ref in gc.get_referrers(optimizer):
        if type(ref) is dict:  # the wrapper's __dict__ holds the optimizer
            found.extend(owner for owner in gc.get_referrers(ref) if isinstance(owner, cls)
                         and getattr(owner, "__dict__", None) is ref and owner.optimizer is optimizer)
        elif isinstance(ref, cls) and ref.optimizer is optimizer:
            found.append(ref)
    return found


def accelerate_end_of_dataloader():
    """Whether an accelerate loop is at the end of its prepared dataloader (False without accelerate)."""
    gradients = getattr(sys.modules.get("accelerate.state"), "GradientState", None)
    if gradients is None or not getattr(gradients, "_shared_state", None):
        return False
    try:
        return bool(gradients().end_of_dataloader)
    except Exception:  # another accelerate version's internals
        return False


def accelerate_would_not_step(wrapper):
    """Why accelerate's wrapper would not step its optimizer as a bare optimizer.step() does now: mid-
    accumulation, or with a GradScaler (gradients still scaled); '' when it would."""
    if getattr(wrapper, "scaler", None) is not None:
        return "accelerate scales the loss (a GradScaler: fp16), so the gradients are still scaled"
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None) or {}
    if not shared.get("sync_gradients", True):
        return "accelerate is inside accumulate() on a micro-batch that does not end the accumulation"
    return ""


# Note [A step GradScaler skipped]: the active hooks by optimizer, and GradScaler's own step methods while
# wrapped (see Note [optimizer.step() without run.step()])
_hooks = weakref.WeakValueDictionary()  # id(optimizer) -> its active OptimizerStepHook
_scaler_steps = []  # (class, its own step, our wrapper of it)


def _no_update(*args, **kwargs):
    return None


def is_skipped_update(step):
    """True for the update a step GradScaler skipped passes to the routing (Note [A step GradScaler skipped])."""
    return step is _no_update


def _scaler_step_wrapper(original):
    def step(self, optimizer, *args, **kwargs):
        hook = _hooks.get(id(torch_optimizer(optimizer)))
        if hook is None or not hook.active or hook.passing_:
            return original(self, optimizer, *args, **kwargs)
        routed = hook.routed_
        try:
            out = original(self, optimizer, *args, **kwargs)
            if hook.routed_ == routed and hook.active:
                hook.routed_ += 1  # (a subclass's step calling this one's books the skip once)
                hook.on_step(_no_update, (), {})  # skipped on inf/NaN: the step boundary, without its update
        except MemschedError:
            # a refusal at the step boundary inside scaler.step(): the scaler's record of this optimizer
            # (unscaled, or stepped) would make a retry with the same scaler update with scaled gradients or
            # raise; it starts over, as the refused step's gradients do (found by a helper: 14.8 off plain)
            states = getattr(self, "_per_optimizer_states", None)
            if states is not None and id(optimizer) in states:
                from torch.amp.grad_scaler import _refresh_per_optimizer_state
                states[id(optimizer)] = _refresh_per_optimizer_state()
            raise
        return out
    step.__wrapped__ = original
    return step


def _wrap_scaler_steps():
    if _scaler_steps:
        return
    todo = [torch.amp.GradScaler]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        own = cls.__dict__.get("step")
        if own is not None:
            wrapper = _scaler_step_wrapper(own)
            _scaler_steps.append((cls, own, wrapper))
            cls.step = wrapper


def _unwrap_scaler_steps():
    if len(_hooks) == 0:
        while _scaler_steps:
            cls, own, wrapper = _scaler_steps.pop()
            if cls.__dict__.get("step") is wrapper:  # else wrapped again after us: that layer stays, ours passes
                cls.step = own


def is_step_hook(fn):
    """True for the bound method OptimizerStepHook puts on an optimizer."""
    return bool(getattr(fn, "_memsched_step_hook", False))


class OptimizerStepHook:
    """Routes optimizer.step(*args, **kwargs) to on_step(step, args, kwargs) while active; `step` is
    the callable that was optimizer.step before install() (torch's, or an LR scheduler's wrapper)."""

    def __init__(self, optimizer, on_step, wrapper=None):
        self.optimizer = optimizer
        self.on_step = on_step
        self.wrapper = wrapper  # the framework's wrapper the caller passed (accelerate's), or None
        self.wrapper_methods_ = None  # accelerate's kept step methods, while re-pointed at us
        self.active = False
        self.passing_ = 0       # > 0: inside passing(): calls go straight to the optimizer's own step
        self.method_ = None     # the bound method set on the instance
        self.had_own_ = False   # the instance had its own `step` before us
        self.prev_ = None       # that attribute
        self.routed_ = 0        # calls routed to on_step (Note [A step GradScaler skipped])

    def install(self):
        opt = self.optimizer
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(opt).__name__}")
        current = opt.__dict__.get("step")
        if is_step_hook(current) and current._memsched_owner().active:
            raise MemschedError("optimizer: its step() is already routed through another memsched.optimize() "
                                "Run that is still active; leave that Run's `with` block first (one Run per "
                                "optimizer)")
        self.had_own_ = "step" in opt.__dict__
        self.prev_ = opt.__dict__.get("step")
        inner = opt.step
        me = self

        def step(opt_self, *args, **kwargs):
            if not me.active or me.passing_:
                return inner(*args, **kwargs)
            me.routed_ += 1
            return me.on_step(inner, args, kwargs)

        step.__wrapped__ = inner
        step._memsched_step_hook = True
        step._memsched_owner = lambda: me
        if getattr(inner, "_wrapped_by_lr_sched", False):
            step._wrapped_by_lr_sched = True  # the LR scheduler's wrapper is still called (lr_scheduler.py)
        self.method_ = types.MethodType(step, opt)
        opt.step = self.method_
        self._repoint_wrapper()
        self.active = True
        _hooks[id(opt)] = self
        _wrap_scaler_steps()
        return self

    def _repoint_wrapper(self):
        """accelerate's AcceleratedOptimizer with a GradScaler sets its kept step methods on the optimizer at
        each step: they call the routing from now on (Note [optimizer.step() without run.step()])."""
        w = self.wrapper
        kept = getattr(w, "_optimizer_original_step_method", None) if w is not None else None
        if kept is None or getattr(w, "optimizer", None) is not self.optimizer:
            return
        try:
            from accelerate.optimizer import patch_optimizer_step
        except ImportError:
            return
        self.wrapper_methods_ = (kept, getattr(w, "_optimizer_patched_step_method", None))
        w._optimizer_original_step_method = self.method_
        w._optimizer_patched_step_method = patch_optimizer_step(w, self.method_)

    @contextlib.contextmanager
    def passing(self):
        """optimizer.step() calls inside go straight to the optimizer's own step (run.step()'s)."""
        self.passing_ += 1
        try:
            yield
        finally:
            self.passing_ -= 1

    def remove(self):
        """Restore optimizer.step; safe to call twice."""
        if not self.active:
            return
        self.active = False
        if _hooks.get(id(self.optimizer)) is self:
            del _hooks[id(self.optimizer)]
        _unwrap_scaler_steps()
        opt = self.optimizer
        if opt.__dict__.get("step") is self.method_:
            if self.had_own_:
                opt.step = self.prev_
            else:
                del opt.__dict__["step"]
        # else: wrapped after us (an LR scheduler made inside the Run): our layer passes calls through
        if self.wrapper_methods_ is not None:
            if self.wrapper._optimizer_original_step_method is self.method_:
                self.wrapper._optimizer_original_step_method, self.wrapper._optimizer_patched_step_method = \
                    self.wrapper_methods_
            self.wrapper_methods_ = None
        self.method_ = self.prev_ = None
        self.on_step = None  # a layer left in place must not keep the Run (model, trace, buffers) alive


def split_closure(args, kwargs):
    """(closure or None, args, kwargs without it) of an Optimizer.step(closure=None) call."""
    kwargs = dict(kwargs)
    if "closure" in kwargs:
        return kwargs.pop("closure"), tuple(args), kwargs
    if args:
        return args[0], tuple(args[1:]), kwargs
    return None, tuple(args), kwargs


def check_closure_optimizer(optimizer, closure):
    """Refuse a closure for an optimizer that evaluates it more than once (Note [optimizer.step()
    without run.step()])."""
    if closure is not None and isinstance(optimizer, torch.optim.LBFGS):
        raise MemschedError("optimizer: LBFGS evaluates its closure several times per step (a forward and "
                            "backward pass each), so the step has no single end where memsched could close "
                            "it; use an optimizer that calls the closure once (SGD, Adam, AdamW, ...) or "
                            "train LBFGS outside memsched.optimize()")
