"""Module hooks and patched forwards that a copy of the model does not inherit.

Entry points: inert_on_copy(fn) wraps a hook; PatchedForward(fn, module, old)
is an instance `forward` that a copy replaces by the plain one.

Note [Copies of a model under memsched]
  Rationale: users copy the model they train -- an EMA or eval copy
  (copy.deepcopy), a checkpoint (pickle, torch.save). Module hooks live in the
  module's __dict__, and so did our patched forwards; copying the module
  copied them, and their closures still pointed at the original Run or
  OutOfOrderBackward: training the copy fed the original's accounting (its
  fused update stepped the ORIGINAL parameters with the copy's gradients),
  and a pickle tried to serialise the Run's host buffers ("cannot pickle
  HostTensorPool").
  Approach: every hook memsched registers on a module, and every forward it
  patches, is an object whose __deepcopy__ and __reduce__ give the copy a
  harmless stand-in: an inert hook (returns None: no change), or the class's
  own forward bound to the copy (deepcopy's memo maps the original module to
  its copy before the copy's __dict__ is filled). The copy is an independent
  plain model. Tensor hooks need nothing: deepcopy does not copy them.
  Limitations: the copy keeps the inert hooks in its hook dicts (they cost a
  call each) and a `forward` instance attribute equal to the class's forward.
"""
import copy
import types

__all__ = ["inert_on_copy", "PatchedForward"]


def _inert(*args, **kwargs):
    """What a copy of the model gets in place of a memsched hook: no change to anything."""
    return None


def _inert_hook():
    return _inert


def _plain_forward(module):
    return types.MethodType(type(module).forward, module)


def _same(obj):
    return obj


class _InertOnCopy:
    """A hook that calls `fn`, and whose copies (deepcopy, pickle) are _inert."""

    __slots__ = ("fn", "__weakref__")

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo):
        return _inert

    def __reduce__(self):
        return (_inert_hook, ())


def inert_on_copy(fn):
    """Wrap a module hook so that copies of the module do not call it. See Note [Copies of a model under memsched]."""
    return _InertOnCopy(fn)


class PatchedForward:
    """An instance `forward` calling fn(module, *args); a copy of the module gets its plain forward
    (the instance forward it had before the patch, or its class's)."""

    __slots__ = ("fn", "module", "had", "old", "__weakref__")

    def __init__(self, fn, module, had=False, old=None):
        self.fn = fn
        self.module = module
        self.had = had        # the module had an instance `forward` before the patch
        self.old = old        # that forward

    def __call__(self, *args, **kwargs):
        return self.fn(self.module, *args, **kwargs)

    def __deepcopy__(self, memo):
        if self.had:
            return copy.deepcopy(self.old, memo)
        return _plain_forward(memo.get(id(self.module), self.module))

    def __reduce__(self):
        if self.had:
            return (_same, (self.old,))
        return (_plain_forward, (self.module,))
