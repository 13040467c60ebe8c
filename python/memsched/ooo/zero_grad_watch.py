"""Tells the fused out-of-order update when the caller zeroes gradients through the optimizer.

Entry point: ZeroGradWatch(optimizer, on_zero_grad).install() / .remove(); used by
OutOfOrderBackward with fuse_optimizer=True. See Note [Gradients the fused update did not see] in
backward.py: after optimizer.zero_grad(set_to_none=False), plain PyTorch holds a zero gradient for
every parameter that had one -- including those whose gradient the fused update freed -- and its
next optimizer.step() steps them even when no backward pass reaches them.

A bound method set on the optimizer instance (as step_hook.py does for step, and torch's LR
schedulers for step): it calls the optimizer's own zero_grad with the caller's arguments, then
on_zero_grad(set_to_none). remove() restores the attribute, unless something replaced it after
us: then our layer stays and, once removed, only passes calls through.
"""
import types


class ZeroGradWatch:
    def __init__(self, optimizer, on_zero_grad):
        self.optimizer = optimizer
        self.on_zero_grad = on_zero_grad
        self._wrapper = None
        self._had = False
        self._old = None

    def install(self) -> None:
        opt = self.optimizer
        self._had = "zero_grad" in opt.__dict__
        self._old = opt.__dict__.get("zero_grad")
        inner = opt.zero_grad  # bound: the class's, or whatever the instance already had
        watch = self

        def zero_grad(_opt, *args, **kwargs):
            out = inner(*args, **kwargs)
            set_to_none = kwargs.get("set_to_none", args[0] if args else True)
            if watch.on_zero_grad is not None:
                watch.on_zero_grad(bool(set_to_none))
            return out

        self._wrapper = types.MethodType(zero_grad, opt)
        opt.zero_grad = self._wrapper

    def remove(self) -> None:
        opt = self.optimizer
        if self._wrapper is None:
            return
        if opt.__dict__.get("zero_grad") is self._wrapper:
            if self._had:
                opt.zero_grad = self._old
            else:
                del opt.zero_grad
        self.on_zero_grad = None  # a layer left under someone else's wrapper passes calls through
        self._wrapper = None
