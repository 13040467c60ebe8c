"""Refuses global gradient-norm clipping of parameters a fused optimizer update owns.

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
  Limitations: a function bound before install (``from torch.nn.utils import
  clip_grad_norm_``) and hand-written norms are invisible; the patch is process-wide while
  installed, restored after the last fused owner is removed.
"""
import math
import weakref

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from memsched._C import MemschedError

_fused_owners = weakref.WeakSet()  # installed OutOfOrderBackward objects with fuse_optimizer=True
_original = None


def _guarded_clip_grad_norm_(parameters, max_norm, *args, **kwargs):
    params = [parameters] if torch.is_tensor(parameters) else list(parameters)
    if not math.isfinite(float(max_norm)):
        # max_norm=inf only measures the norm (transformers' Trainer logs grad_norm that way): it
        # changes nothing, so it is not refused; it sees only the gradients not yet freed.
        return _original(params, max_norm, *args, **kwargs)
    for owner in list(_fused_owners):
        if any(owner.owns_parameter(p) for p in params):
            raise MemschedError(
                "torch.nn.utils.clip_grad_norm_ on parameters of a model under "
                "OutOfOrderBackward(fuse_optimizer=True) (memsched.optimize(..., fuse_optimizer=True)): each "
                "parameter was already stepped during backward with its unclipped gradient, which was then "
                "freed, so clipping now would silently clip nothing. For global-norm clipping use "
                "fuse_optimizer=False with max_grad_norm=... (step() clips, then you call optimizer.step()), "
                "or clip per parameter (torch.nn.utils.clip_grad_value_ in a register_post_accumulate_grad_hook).")
    return _original(params, max_norm, *args, **kwargs)


def guard(owner) -> None:
    """Called when a fused OutOfOrderBackward is installed."""
    global _original
    _fused_owners.add(owner)
    if _original is None:
        _original = torch.nn.utils.clip_grad.clip_grad_norm_
        torch.nn.utils.clip_grad.clip_grad_norm_ = _guarded_clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = _guarded_clip_grad_norm_


def unguard(owner) -> None:
    """Called on remove(); restores clip_grad_norm_ after the last fused owner."""
    global _original
    _fused_owners.discard(owner)
    if len(_fused_owners) == 0 and _original is not None:
        torch.nn.utils.clip_grad.clip_grad_norm_ = _original
        torch.nn.utils.clip_grad_norm_ = _original
        _original = None
