"""user_stacklevel(): where a memsched warning points, the caller's first frame outside memsched and torch.

Note [Warnings point at the caller's code]
  Rationale: most of memsched's warnings are raised from hooks -- a module's forward pre-hook, a
  saved-tensor hook, an autograd hook, an optimizer step hook -- that torch calls several frames below
  the caller's line. A fixed stacklevel pointed into torch's Module.__call__ or autograd, or into
  memsched itself when the same warning was reached through another path (the fused update's
  forward-after-update warning used stacklevel=7, right for one call path only).
  Approach: warnings.warn(..., stacklevel=user_stacklevel()) walks up from the function that warns to
  the first frame whose file is in neither memsched's package nor torch's, nor in a training framework
  that calls the step for the caller (accelerate, transformers, lightning, when loaded: a warning of
  the step's pointed into accelerate/optimizer.py) -- Python 3.12's skip_file_prefixes does the same,
  but 3.11 lacks it.
"""
import os
import sys

import torch

_SKIP = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
         os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


_FRAMEWORKS = ("accelerate", "transformers", "lightning", "pytorch_lightning", "lightning_fabric")


def _skipped():
    out = list(_SKIP)
    for name in _FRAMEWORKS:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            out.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(out)


def user_stacklevel():
    """warnings.warn's stacklevel for the caller's first frame outside memsched, torch and the training
    frameworks (Note [Warnings point at the caller's code]); 2 (the warning function's caller) when every
    frame is inside them."""
    skip = _skipped()
    level, frame = 2, sys._getframe(2)  # 1 is the function calling warnings.warn, 2 its caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2
