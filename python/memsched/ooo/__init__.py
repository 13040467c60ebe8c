"""memsched.ooo: out-of-order backward -- deferred weight gradients, fused
optimizer update, DDP-aware ordering. See backward.py for the contract.

    with memsched.ooo.OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True) as ooo:
        for batch in loader:
            model(batch).sum().backward()   # parameters are updated during backward
            ooo.step()
"""
from memsched.ooo.backward import DEFAULT_MAX_DEFERRED_BYTES, OutOfOrderBackward
from memsched.ooo.fused import SUPPORTED_OPTIMIZERS, ParamStepper

__all__ = ["OutOfOrderBackward", "ParamStepper", "SUPPORTED_OPTIMIZERS", "DEFAULT_MAX_DEFERRED_BYTES"]
