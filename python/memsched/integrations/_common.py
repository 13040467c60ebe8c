"""What the framework callbacks share: argument checks made when the callback is built, the
torch optimizer behind a framework's wrapper, and the figures they log.

Entry points: check_callback_args(budget, planner, ooo, fuse_optimizer, options),
torch_optimizer(optimizer, where), step_figures(run), enter_run(run), leave_run(run, raised, exception),
leave_stale_runs(),
quiet_root_hooks(module), short_accumulation_refusal(...).

Note [A Run a raised training left behind]
  Rationale: a training that raised (a refused budget, an error of the caller's) never reaches the
  callback's end-of-training event in the Hugging Face Trainer, so its Run stayed entered with its
  hooks on the old model; a new Trainer with a new MemschedCallback in the same process (a notebook's
  retry at the budget the refusal named) then ran every step plainly, saying only "call the first
  Run's run.step()", which a Trainer user cannot (found by a helper probing as a new user).
  Approach: the callbacks enter their Runs through enter_run, which remembers them weakly; at the
  start of a training, leave_stale_runs leaves every one still entered, with a warning: trainings run
  one at a time, so one still entered at the start of another belongs to a training that raised.
"""
import warnings
import weakref

import torch

from memsched import step_hook
from memsched.copy_inert import _InertOnCopy
from memsched.optimize import _OPTIONS, check_options
from memsched.user_frame import user_stacklevel  # See Note [Warnings point at the caller's code]

# options the trainer decides (the callbacks pass its own value)
_FROM_TRAINER = ("grad_accumulation_steps",)


def check_callback_args(budget, planner, ooo, fuse_optimizer, options):
    """The checks optimize() makes before any step (optimize.check_options, the same function), made
    when the callback is built, so a typo or a bad value fails before the trainer loads data or builds
    its optimizer."""
    for k in options:
        if k in _FROM_TRAINER:
            raise TypeError(f"MemschedCallback: {k} comes from the trainer (its gradient accumulation); "
                            "leave it out")
        if k not in _OPTIONS:
            raise TypeError(f"MemschedCallback: unknown option {k!r}; known options: "
                            f"{', '.join(o for o in _OPTIONS if o not in _FROM_TRAINER)} (and budget, planner, "
                            "ooo, fuse_optimizer)")
    check_options(budget=budget, planner=planner, ooo=ooo, fuse_optimizer=fuse_optimizer, **options)


def torch_optimizer(optimizer, where):
    """The torch.optim.Optimizer behind accelerate's AcceleratedOptimizer or Lightning's
    LightningOptimizer (their step() ends in its step(), which memsched routes)."""
    optimizer = step_hook.torch_optimizer(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{where}: memsched needs the trainer's optimizer to be a torch.optim.Optimizer (or a "
                        f"framework wrapper of one), got {type(optimizer).__name__}")
    return optimizer


def step_figures(run):
    """Numbers to log after a step: the latest executed step whose timing is known, as measured, and
    the plan's figures. A measured key pairs with its planned_ key: on an accelerator the step's peak
    is the allocator's (memsched/peak_bytes, beside memsched/planned_peak_bytes); on CPU the executor
    counts saved activations (memsched/activation_peak_bytes, beside planned_activation_peak_bytes), except
    in a keep-all plan's steps, which run without its hooks and log no such figure.
    Never waits for the GPU: a step whose CUDA events have not completed yet is logged next time."""
    out = {}
    planned = run.planned_figures()
    for key in ("peak_bytes", "activation_peak_bytes", "update_peak_bytes", "step_time_s", "stall_s", "bytes_moved",
                "offloaded"):
        if planned.get(key) is not None:
            out[f"memsched/planned_{key}"] = float(planned[key])
    s = next((x for x in reversed(run.step_stats) if x.ready), None)
    if s is not None:
        if run._measures_device_peak():
            out["memsched/peak_bytes"] = float(s.peak_bytes)
        elif s.hooked:  # a keep-all step without hooks counts nothing (Note [A plan with nothing to do])
            out["memsched/activation_peak_bytes"] = float(s.peak_bytes)
        out.update({"memsched/step_time_s": float(s.duration_s),
                    "memsched/stall_s": float(s.stall_s), "memsched/offloaded": float(s.offloaded),
                    "memsched/bytes_moved": float(s.d2h_bytes + s.h2d_bytes),
                    "memsched/planned_step": 1.0 if s.mode == "planned" else 0.0})
    out["memsched/steps_profiled"] = float(run.steps_profiled)
    return out


_ENTERED = weakref.WeakSet()  # Runs the callbacks entered (See Note [A Run a raised training left behind])


def enter_run(run):
    run.__enter__()
    _ENTERED.add(run)


# Note [Leaving the Run of a training that raised]
#   Rationale: Run.__exit__ with no exception warns when the Run ends inside its first, profiled step,
#   advising "call run.step() where the optimizer steps, or pass the optimizer" -- advice for a `with`
#   block. The callbacks left the Run of a training that raised that way too (Lightning's on_exception,
#   the Trainer's next train(), callback.close()), and a callback user, who has no run.step() and whose
#   trainer's optimizer was passed, got that advice for an error already raised to them (found by a helper
#   probing the integrations).
#   Approach: leave_run passes the exception to __exit__ where the framework hands it over (Lightning),
#   as a `with` block would; where it is gone (the Hugging Face Trainer has no exception event) it hides
#   that one warning: the cause was raised to the user, and the callbacks say themselves when they leave
#   a Run of an unfinished training.
def leave_run(run, raised=False, exception=None):
    """Leave an entered Run. raised: the training raised or was interrupted before its end; exception: what
    it raised, when known (See Note [Leaving the Run of a training that raised])."""
    if not run.entered_:
        return
    if exception is not None:
        run.__exit__(type(exception), exception, exception.__traceback__)
    elif raised:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="memsched.optimize: the Run ended while its first step")
            run.__exit__(None, None, None)
    else:
        run.__exit__(None, None, None)


def leave_stale_runs():
    """Leave every Run a callback entered that is still entered (See Note [A Run a raised training left
    behind]); called at the start of a training."""
    for run in list(_ENTERED):
        if run.entered_:
            warnings.warn("memsched: left the Run of an earlier training that raised before its end (its "
                          "MemschedCallback never saw the training end); this training gets a Run of its own",
                          RuntimeWarning, stacklevel=user_stacklevel())
            leave_run(run, raised=True)
        _ENTERED.discard(run)


def quiet_root_hooks(module):
    """Make memsched's forward hooks on `module` do nothing, for a Run left inside one of its forward
    pre-hooks: torch calls the hooks it listed when the forward began, removed or not (See Note [A
    forward after an unfinished train()] in transformers.py). Every memsched module hook is an
    _InertOnCopy (copy_inert.py); leaving the Run removes them."""
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for hook in hooks.values():
            if isinstance(hook, _InertOnCopy):
                hook.fn = _nothing


def _nothing(*args, **kwargs):
    return None


def short_accumulation_refusal(batches, k, global_step, max_steps, setting, which, fixes):
    """With ooo/fuse_optimizer an optimizer step must follow k backward passes (the update follows
    grad_accumulation_steps); an epoch of `batches` batches, no multiple of k, ends with a step after
    fewer. The MemschedError to raise before the first step when training reaches that end, else None.
    max_steps <= 0: no step limit."""
    if k <= 1 or batches is None or batches % k == 0:
        return None
    per_epoch = batches // k + 1
    epoch_end = (global_step // per_epoch + 1) * per_epoch  # the step that ends the current epoch
    if 0 < max_steps < epoch_end:
        return None
    from memsched._C import MemschedError

    # a step limit before the epoch's last step, where there is one (an epoch of fewer than k batches has none)
    stop = f", stop within the epoch (max_steps < {epoch_end})" if epoch_end > 1 else ""
    return MemschedError(
        f"{setting}={k}: an epoch has {batches} batches, not a multiple of {k}, so its last optimizer step follows "
        f"{batches % k} backward pass(es); with {which} memsched's update follows exactly {k}. Make the batches per "
        f"epoch a multiple of {k} ({fixes}){stop}, or use "
        f"MemschedCallback(ooo=False, fuse_optimizer=False), which handles a short accumulation")
