"""profile.py -- memsched.profile(step_fn, model=..., optimizer=...) -> Trace.

Runs one training step under instrumentation (See Note [Free detection] in
recorder.py, Note [Backward module path] in backward_modules.py and Note
[Activation identity] in docs/) and returns the validated memsched.Trace.

Note [What profile() records]
  - Before the step: every parameter and buffer of `model` (kind parameter),
    existing .grad tensors (gradient) and the optimizer's existing state
    (optimizer_state), live from op 0 and past the step unless freed.
  - During the step: one Op per aten op reaching the dispatcher, forward,
    backward and optimizer -- except view ops (func.is_view: view, t,
    transpose, expand, detach, ...), which allocate, read and compute nothing
    (Note [Profiler overhead]) -- with module path (Note [Backward module
    path] for backward ops), phase, duration (CUDA events for
    ops on CUDA tensors, wall clock otherwise), FLOPs (torch.utils.flop_counter
    formulas; 0 where none exists) and bytes read/written (bytes of the tensor
    arguments / of newly allocated or mutated outputs). Every output storage
    is a TensorRecord (a view or in-place result is the same storage, so not
    a new record); storages saved for backward become activations.
  - After the step: each parameter's .grad is kind gradient and each tensor in
    optimizer.state is optimizer_state.
  - The optimizer step: if `optimizer` is given and step_fn did not call
    optimizer.step() itself, profile() calls it once after step_fn. Ops inside
    optimizer.step() have phase optimizer and module path "".
  - Storages first seen as an op input (the input batch, tensors made outside
    the dispatcher) count as existing before the step.
  - Limitations: saved tensors inside a region that installs its own
    saved_tensors_hooks (torch.utils.checkpoint, save_on_cpu) are not seen as
    activations (the innermost hooks win); the seed gradient of backward()
    (ones_like) is a forward-phase op.
  Everything installed (module hooks, saved-tensor hooks, the dispatch mode,
  optimizer hooks) is removed before profile() returns or raises.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from memsched.profiler.session import ProfilerSession, _register_optimizer_state  # noqa: F401 (re-export)


def profile(step_fn: Callable[[], Any], model: Optional[torch.nn.Module] = None,
            optimizer: Optional[torch.optim.Optimizer] = None, device: Optional[str] = None):
    """Run `step_fn()` once under instrumentation and return its memsched.Trace.

    step_fn runs forward and backward (and may call optimizer.step()); `model`
    names modules and identifies parameters; `optimizer`, when given, is
    stepped once if step_fn did not. See Note [What profile() records].
    """
    if not callable(step_fn):
        raise TypeError(f"memsched.profile: step_fn must be callable, got {type(step_fn).__name__}")
    if isinstance(step_fn, torch.nn.Module):  # called with no input, the model's own error would say little
        raise TypeError(f"memsched.profile: step_fn is a module ({type(step_fn).__name__}); pass a function that "
                        f"runs one training step on a batch, e.g. lambda: loss_fn(model(batch)).backward(), and the "
                        f"module as model=")
    session = ProfilerSession(model, optimizer, device).start()
    try:
        step_fn()
        if optimizer is not None and session.optimizer_steps == 0:
            optimizer.step()
    except BaseException:
        session.abort()
        raise
    return session.stop()
