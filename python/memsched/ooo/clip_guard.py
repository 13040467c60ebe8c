"""Refuses gradient clipping of parameters a fused optimizer update owns where it would clip nothing.

Note [Clipping and fused updates]
  Rationale: torch.nn.utils.clip_grad_norm_ scales every gradient by one factor computed from
  all of them, before optimizer.step(). With fuse_optimizer=True each parameter is stepped
  during backward, with its unclipped gradient, and its gradient is then freed: a
  clip_grad_norm_ after backward finds no gradients and silently clips nothing, so training
  runs unclipped (found by trying a plain clip-then-step loop under the fused update).
  Approach: while an OutOfOrderBackward with fuse_optimizer=True is installed,
  torch.nn.utils.clip_grad_norm_ (also reached as torch.nn.utils.clip_grad.clip_grad_norm_)
  raises memsched.MemschedError, before anything is clipped, when any parameter it is given
  belongs to such an object and max_norm is finite (max_norm=inf only measures, as
  transformers' Trainer does to log grad_norm); other parameters are clipped as usual. OutOfOrderBackward's own
  max_grad_norm is refused with fuse_optimizer=True at construction (clip-then-step works
  without fusion: step() clips before returning True), as are the integrations' clipping
  settings (Trainer's max_grad_norm, Lightning's gradient_clip_val). The per-parameter clipping
  the refusal recommends (clip_grad_value_ in a post-accumulate-grad hook) clips the whole
  gradient before the fused update: a parameter with a caller's hook runs its layer plainly and
  memsched's hook runs last (See Note [Parameters with gradient hooks] in backward.py; tested in
  tests/python/ooo/test_backward_param_hooks.py).
  The two halves of clip_grad_norm_ that torch also exports, torch.nn.utils.get_total_norm and
  torch.nn.utils.clip_grads_with_norm_, were not guarded: get_total_norm over the freed
  gradients returned 0 and clip_grads_with_norm_ then clipped nothing, so the parameters
  trained unclipped without a word. clip_grads_with_norm_ with a finite max_norm on fused
  parameters is refused as clip_grad_norm_ is. So is torch.nn.utils.clip_grad_value_ on a fused
  parameter the fused update of this step already stepped (after that backward pass, before
  step(), the boundary): its gradient is gone, so it clipped only the gradients of parameters
  the update does not step (one outside the optimizer), or raised torch's "Expected !nested_tensorlist[0].empty()" when
  none was left. Inside backward, before the update (the per-parameter clipping in a
  post-accumulate-grad hook that the refusal recommends), and on the micro-steps of gradient
  accumulation before the last, clip_grad_value_ clips as usual.
  clip_grad_norm_ bound by name before install (``from torch.nn.utils import clip_grad_norm_``,
  the common import) is torch's own function, which memsched's patch of the module attribute
  does not reach: it clipped nothing, silently (7.6e-2 off plain after 5 SGD steps). It calls
  its second half through the module global torch.nn.utils.clip_grad._clip_grads_with_norm_
  (torch >= 2.6) at every call, so that global is guarded too and the refusal comes from there.
  Limitations: clip_grads_with_norm_ and clip_grad_value_ bound by name before install, and
  hand-written norms, are invisible (clip_grad_value_ over freed gradients alone raises torch's
  own "Expected !nested_tensorlist[0].empty()"); the patch is process-wide while installed,
  restored after the last fused owner is removed.
"""
import math
import weakref

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from memsched._C import MemschedError

_fused_owners = weakref.WeakSet()  # installed OutOfOrderBackward objects with fuse_optimizer=True
_original = None
_original_with_norm = None  # torch.nn.utils.clip_grads_with_norm_ before guard()
_original_value = None      # torch.nn.utils.clip_grad_value_ before guard()

_FIX = ("For global-norm clipping use fuse_optimizer=False: memsched.optimize(..., ooo=True) keeps the gradients "
        "until the step, so clip_grad_norm_ between backward and step clips as usual (a bare OutOfOrderBackward "
        "also takes max_grad_norm=...: its step() clips, then you call optimizer.step()); or clip per parameter "
        "(torch.nn.utils.clip_grad_value_ in a register_post_accumulate_grad_hook).")


def _norm_clip_refused(name, freed_note=""):
    """The refusal of torch.nn.utils.<name> on parameters the fused update steps."""
    return MemschedError(
        f"torch.nn.utils.{name} on parameters of a model under OutOfOrderBackward(fuse_optimizer=True) "
        "(memsched.optimize(..., fuse_optimizer=True)): each parameter was already stepped during backward with "
        f"its unclipped gradient, which was then freed{freed_note}, so clipping now would silently clip nothing. "
        + _FIX)


def _guarded_clip_grad_norm_(parameters, max_norm, *args, **kwargs):
    params = [parameters] if torch.is_tensor(parameters) else list(parameters)
    if not math.isfinite(float(max_norm)):
        # max_norm=inf only measures the norm (transformers' Trainer logs grad_norm that way): it
        # changes nothing, so it is not refused; it sees only the gradients not yet freed.
        return _original(params, max_norm, *args, **kwargs)
    for owner in list(_fused_owners):
        if any(owner.owns_parameter(p) for p in params):
            raise _norm_clip_refused("clip_grad_norm_")
    return _original(params, max_norm, *args, **kwargs)


def _guarded_clip_grads_with_norm_(parameters, max_norm, *args, **kwargs):
    params = [parameters] if torch.is_tensor(parameters) else list(parameters)
    if math.isfinite(float(max_norm)) and any(o.owns_parameter(p) for o in list(_fused_owners) for p in params):
        raise _norm_clip_refused("clip_grads_with_norm_",
                                 " (torch.nn.utils.get_total_norm of the gradients left finds none of them)")
    return _original_with_norm(params, max_norm, *args, **kwargs)


def _guarded_clip_grad_norm_second_half(parameters, max_norm, *args, **kwargs):
    """torch.nn.utils.clip_grad._clip_grads_with_norm_, which torch's clip_grad_norm_ calls: reached here
    from a clip_grad_norm_ bound by name before install (the guarded one refuses before calling it)."""
    params = [parameters] if torch.is_tensor(parameters) else list(parameters)
    if math.isfinite(float(max_norm)) and any(o.owns_parameter(p) for o in list(_fused_owners) for p in params):
        raise _norm_clip_refused("clip_grad_norm_")
    return _original_with_norm(params, max_norm, *args, **kwargs)


def _guarded_clip_grad_value_(parameters, clip_value, *args, **kwargs):
    params = [parameters] if torch.is_tensor(parameters) else list(parameters)
    for owner in list(_fused_owners):
        if any(owner.stepped_since_step(p) for p in params):
            raise MemschedError(
                "torch.nn.utils.clip_grad_value_ after the backward pass on parameters of a model under "
                "OutOfOrderBackward(fuse_optimizer=True) (memsched.optimize(..., fuse_optimizer=True)): the fused "
                "update already stepped them during backward with their unclipped gradients, which were then "
                "freed, so clipping now would clip nothing of theirs. Clip each gradient before its update: call "
                "torch.nn.utils.clip_grad_value_(p, ...) in p.register_post_accumulate_grad_hook (registered "
                "before the forward), or use fuse_optimizer=False.")
    return _original_value(params, clip_value, *args, **kwargs)


def guard(owner) -> None:
    """Called when a fused OutOfOrderBackward is installed."""
    global _original, _original_with_norm, _original_value
    _fused_owners.add(owner)
    if _original is None:
        _original = torch.nn.utils.clip_grad.clip_grad_norm_
        torch.nn.utils.clip_grad.clip_grad_norm_ = _guarded_clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = _guarded_clip_grad_norm_
        _original_value = torch.nn.utils.clip_grad.clip_grad_value_
        torch.nn.utils.clip_grad.clip_grad_value_ = _guarded_clip_grad_value_
        torch.nn.utils.clip_grad_value_ = _guarded_clip_grad_value_
        _original_with_norm = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
        if _original_with_norm is not None:  # torch >= 2.6
            torch.nn.utils.clip_grads_with_norm_ = _guarded_clip_grads_with_norm_
            # the module global torch's own clip_grad_norm_ calls, also when bound by name before install
            torch.nn.utils.clip_grad._clip_grads_with_norm_ = _guarded_clip_grad_norm_second_half


def unguard(owner) -> None:
    """Called on remove(); restores clip_grad_norm_ after the last fused owner."""
    global _original, _original_with_norm, _original_value
    _fused_owners.discard(owner)
    if len(_fused_owners) == 0 and _original is not None:
        torch.nn.utils.clip_grad.clip_grad_norm_ = _original
        torch.nn.utils.clip_grad_norm_ = _original
        _original = None
        torch.nn.utils.clip_grad.clip_grad_value_ = _original_value
        torch.nn.utils.clip_grad_value_ = _original_value
        _original_value = None
        if _original_with_norm is not None:
            torch.nn.utils.clip_grads_with_norm_ = _original_with_norm
            torch.nn.utils.clip_grad._clip_grads_with_norm_ = _original_with_norm
            _original_with_norm = None
