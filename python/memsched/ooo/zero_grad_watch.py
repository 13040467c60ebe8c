"""Tells the fused out-of-order update when the caller zeroes gradients, through an optimizer or a
module.

Entry point: ZeroGradWatch(optimizer, modules, on_zero_grad).install() / .remove(); used by
OutOfOrderBackward. See Note [Gradients the fused update did not see] in backward.py: after
``optimizer.zero_grad(set_to_none=False)`` or ``model.zero_grad(set_to_none=False)``, plain PyTorch
holds a zero gradient for every parameter that had one -- including those whose gradient the fused
update freed -- and its next optimizer.step() steps them even when no backward pass reaches them.

Note [Watching zero_grad]
  Rationale: a watch set on the optimizer instance saw ``opt.zero_grad(...)`` but neither
  ``model.zero_grad(...)``, a submodule's, nor ``torch.optim.Optimizer.zero_grad(opt, ...)``: the
  parameters those zeroed were then not stepped where plain PyTorch steps them (AdamW's weight
  decay, SGD's momentum). An instance attribute on the model would also be copied by
  ``copy.deepcopy(model)`` and zero the original's gradients from the copy.
  Approach: while at least one watch is installed, ``torch.optim.Optimizer.zero_grad`` and
  ``torch.nn.Module.zero_grad`` are wrapped once, process-wide. The wrapper runs torch's own
  method, then tells each watch whose optimizer (or one of whose modules' parameters) was zeroed:
  ``on_zero_grad(set_to_none, params)`` with the parameters the call covered (an optimizer's, or
  ``module.parameters()``). With no watch installed the wrapper only passes the call through. The
  last remove() restores torch's methods unless something wrapped them after us (then our layer
  stays, passing calls through).
  Limitations: a subclass overriding zero_grad without calling torch's is not seen; neither is
  zeroing by hand (``p.grad.zero_()``): OutOfOrderBackward refuses a step that follows such zeroing
  (Note [Gradients the fused update did not see]).
"""
from __future__ import annotations

import functools
import threading
from typing import Callable, Iterable, List, Optional

import torch

_lock = threading.Lock()
_watches: List["ZeroGradWatch"] = []
_originals = {}  # class -> torch's zero_grad it wrapped


def _set_to_none(args, kwargs) -> bool:
    return bool(kwargs.get("set_to_none", args[0] if args else True))


def _had_gradients(watching, params):
    """The parameters among `params` (an iterable, or a callable giving one) holding a gradient before the
    zero_grad, for watches that ask (wants_gradients()); None when none asks (the common case)."""
    if not any(w.wants_gradients() for w in watching):
        return None
    return [p for p in (params() if callable(params) else params) if p.grad is not None]


def _optimizer_zero_grad(orig):
    @functools.wraps(orig)
    def zero_grad(self, *args, **kwargs):
        watching = [w for w in list(_watches) if w.optimizer is self] if _watches else ()
        had = _had_gradients(watching, lambda: [p for g in self.param_groups for p in g["params"]]) \
            if watching else None
        out = orig(self, *args, **kwargs)
        for w in watching:
            w.notify(_set_to_none(args, kwargs), None, had)
        return out

    zero_grad._memsched_zero_grad_watch = True
    return zero_grad


def _module_zero_grad(orig):
    @functools.wraps(orig)
    def zero_grad(self, *args, **kwargs):
        watching = [w for w in list(_watches) if w.covers(self)] if _watches else ()
        params = list(self.parameters()) if watching else ()
        had = _had_gradients(watching, params) if watching else None
        out = orig(self, *args, **kwargs)
        for w in watching:
            w.notify(_set_to_none(args, kwargs), params, had)
        return out

    zero_grad._memsched_zero_grad_watch = True
    return zero_grad


def _patch() -> None:
    for cls, wrap in ((torch.optim.Optimizer, _optimizer_zero_grad), (torch.nn.Module, _module_zero_grad)):
        current = cls.__dict__["zero_grad"]
        if not getattr(current, "_memsched_zero_grad_watch", False):
            _originals[cls] = current
            cls.zero_grad = wrap(current)


def _unpatch() -> None:
    for cls, orig in list(_originals.items()):
        if getattr(cls.__dict__.get("zero_grad"), "_memsched_zero_grad_watch", False):
            cls.zero_grad = orig
            del _originals[cls]
        # else: wrapped again after us; our layer stays and passes calls through


class ZeroGradWatch:
    """on_zero_grad(set_to_none, params, had) after optimizer.zero_grad(...) (params None: all of the
    optimizer's) and after zero_grad(...) of any module whose parameters include one of `params`; `had`:
    the zeroed parameters that held a gradient before the call when wants_gradients() said so, else None."""

    def __init__(self, optimizer, params: Iterable[torch.Tensor],
                 on_zero_grad: Callable[[bool, Optional[list], Optional[list]], None],
                 wants_gradients: Optional[Callable[[], bool]] = None):
        self.optimizer = optimizer
        self._param_ids = {id(p) for p in params}
        self.on_zero_grad = on_zero_grad
        self.wants_gradients = wants_gradients or (lambda: False)
        self._installed = False

    def covers(self, module: torch.nn.Module) -> bool:
        ids = self._param_ids
        return any(id(p) in ids for p in module.parameters())

    def notify(self, set_to_none: bool, params, had=None) -> None:
        if self.on_zero_grad is not None:
            self.on_zero_grad(set_to_none, params, had)

    def install(self) -> None:
        with _lock:
            if not self._installed:
                _watches.append(self)
                self._installed = True
                _patch()

    def remove(self) -> None:
        with _lock:
            if self._installed:
                _watches.remove(self)
                self._installed = False
                if not _watches:
                    _unpatch()
