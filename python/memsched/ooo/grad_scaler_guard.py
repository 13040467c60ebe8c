"""Refuses torch.amp.GradScaler while a fused optimizer update is installed.

Note [GradScaler and fused updates]
  Rationale: GradScaler multiplies the loss by a scale S before backward and
  divides the gradients by S later, in scaler.step(optimizer) -- after backward.
  A fused update steps each parameter during backward, with its gradient still
  multiplied by S: a wrong update that scaler.step can no longer undo (found in
  review; it went unnoticed until scaler.step failed after the first step).
  Approach: while any OutOfOrderBackward with fuse_optimizer=True is installed,
  an enabled GradScaler's scale() -- which the recipe calls on the loss before
  backward -- raises memsched.MemschedError, so nothing has been scaled or
  stepped. The class method is patched only while such an object is installed
  and restored when the last one is removed.
  Limitations: a loss scaled by hand (loss * S) is invisible; the guard is
  process-wide, so a GradScaler used by unrelated code in the same process
  while a fused update is installed raises too.
"""
import weakref

import torch

from memsched._C import MemschedError

_fused_owners = weakref.WeakSet()  # installed OutOfOrderBackward objects with fuse_optimizer=True
_original_scale = None


def _guarded_scale(self, outputs):
    if self._enabled and len(_fused_owners) > 0:
        raise MemschedError(
            "GradScaler.scale() while memsched.OutOfOrderBackward(fuse_optimizer=True) is installed: a fused "
            "update steps each parameter during backward, before GradScaler could unscale its gradient, so it "
            "would apply a gradient multiplied by the loss scale. Use fuse_optimizer=False with a GradScaler "
            "(scaler.step(optimizer) after backward), or train in bfloat16, which needs no loss scaling.")
    return _original_scale(self, outputs)


def guard(owner) -> None:
    """Called when a fused OutOfOrderBackward is installed."""
    global _original_scale
    _fused_owners.add(owner)
    if _original_scale is None:
        _original_scale = torch.amp.GradScaler.scale
        torch.amp.GradScaler.scale = _guarded_scale


def unguard(owner) -> None:
    """Called on remove(); restores GradScaler.scale after the last fused owner."""
    global _original_scale
    _fused_owners.discard(owner)
    if len(_fused_owners) == 0 and _original_scale is not None:
        torch.amp.GradScaler.scale = _original_scale
        _original_scale = None
