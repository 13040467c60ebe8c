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
  stepped. The method is patched on GradScaler and on every subclass that defines
  its own (torch.distributed.fsdp's ShardedGradScaler: the fused update stepped
  with scaled gradients under it, found by a helper) only while such an object is
  installed, and restored when the last one is removed. A scale() bound before
  install (`scale = scaler.scale`) escapes that; its unscale_() -- which
  scaler.step() calls -- raises then, naming the update that already ran, where
  torch's own assertion said "No inf checks were recorded".
  Limitations: a loss scaled by hand (loss * S) is invisible; the guard is
  process-wide, so a GradScaler used by unrelated code in the same process
  while a fused update is installed raises too; a subclass defined after install
  is patched at the next install.
"""
import weakref

import torch

from memsched._C import MemschedError

_fused_owners = weakref.WeakSet()  # installed OutOfOrderBackward objects with fuse_optimizer=True
_patched = []  # (class, attribute name, its own original function, our guard of it)

_WHERE = ("while out-of-order backward's fused update is installed (memsched.optimize(..., fuse_optimizer=True) "
          "or memsched.OutOfOrderBackward(fuse_optimizer=True))")
_FIX = ("Use fuse_optimizer=False with a GradScaler (fp16: torch.amp.GradScaler, or accelerate's "
        "mixed_precision='fp16'), or train in bfloat16, which needs no loss scaling (torch.autocast(dtype="
        "torch.bfloat16), mixed_precision='bf16').")


def _guarded_scale(original):
    def scale(self, outputs):
        if self._enabled and len(_fused_owners) > 0:
            raise MemschedError(
                f"GradScaler.scale() {_WHERE}: a fused update steps each parameter during backward, before "
                f"GradScaler could unscale its gradient, so it would apply a gradient multiplied by the loss scale. "
                f"Nothing was scaled or stepped. {_FIX}")
        return original(self, outputs)
    return scale


def _guarded_unscale(original):
    def unscale_(self, optimizer):
        if self._enabled and len(_fused_owners) > 0:
            stepped = any(getattr(o, "_updated_since_step", False) for o in list(_fused_owners))
            raise MemschedError(
                f"GradScaler.unscale_() (or step(), which calls it) {_WHERE}: the loss was scaled by a scale() "
                f"bound before the update was installed"
                + (", so the fused update already stepped the parameters with gradients multiplied by the loss "
                   "scale during backward, and they hold that wrong update. " if stepped else
                   "; no fused update has run since the last step (memsched.optimize's first step updates after "
                   "backward), so nothing was stepped. ") + _FIX)
        return original(self, optimizer)
    return unscale_


def _scaler_classes():
    out, todo = [], [torch.amp.GradScaler]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def guard(owner) -> None:
    """Called when a fused OutOfOrderBackward is installed."""
    _fused_owners.add(owner)
    if _patched:
        return
    for cls in _scaler_classes():
        for name, wrap in (("scale", _guarded_scale), ("unscale_", _guarded_unscale)):
            own = cls.__dict__.get(name)
            if own is not None:
                guarded = wrap(own)
                _patched.append((cls, name, own, guarded))
                setattr(cls, name, guarded)


def unguard(owner) -> None:
    """Called on remove(); restores the scalers' methods after the last fused owner."""
    _fused_owners.discard(owner)
    if len(_fused_owners) == 0:
        while _patched:
            cls, name, own, guarded = _patched.pop()
            if cls.__dict__.get(name) is guarded:  # else patched again after us: that layer stays
                setattr(cls, name, own)
