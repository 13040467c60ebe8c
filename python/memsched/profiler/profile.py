"""profile.py -- memsched.profile(step_fn, model=..., optimizer=...) -> Trace.

Runs one training step under instrumentation (See Note [Free detection] in
recorder.py, Note [Backward module path] in backward_modules.py and Note
[Activation identity] in docs/) and returns the validated memsched.Trace.

Note [What profile() records]
  - Before the step: every parameter and buffer of `model` (kind parameter),
    existing .grad tensors (gradient) and the optimizer's existing state
    (optimizer_state), live from op 0 and past the step unless freed.
  - During the step: one Op per aten op reaching the dispatcher, forward,
    backward and optimizer, with module path, phase, duration (CUDA events for
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
  Everything installed (module hooks, saved-tensor hooks, the dispatch mode,
  optimizer hooks) is removed before profile() returns or raises.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from memsched.profiler.recorder import Recorder, RecordingMode


def _device_of(model: Optional[torch.nn.Module]) -> str:
    if model is not None:
        for p in model.parameters():
            return str(p.device)
    return "cpu"


def profile(step_fn: Callable[[], Any], model: Optional[torch.nn.Module] = None,
            optimizer: Optional[torch.optim.Optimizer] = None, device: Optional[str] = None):
    """Run `step_fn()` once under instrumentation and return its memsched.Trace.

    step_fn runs forward and backward (and may call optimizer.step()); `model`
    names modules and identifies parameters; `optimizer`, when given, is
    stepped once if step_fn did not. See Note [What profile() records].
    """
    if not callable(step_fn):
        raise TypeError(f"memsched.profile: step_fn must be callable, got {type(step_fn).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"memsched.profile: model must be a torch.nn.Module, got {type(model).__name__}")
    rec = Recorder(model, device or _device_of(model))
    steps = {"n": 0}
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(rec.close)
        # Pre-existing state, registered before any op.
        if model is not None:
            for p in model.parameters():
                rec.register_existing(p, "parameter")
                if p.grad is not None:
                    rec.register_existing(p.grad, "gradient")
            for buf in model.buffers():
                rec.register_existing(buf, "parameter")
        if optimizer is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    rec.register_existing(p, "parameter")
                    if p.grad is not None:
                        rec.register_existing(p.grad, "gradient")
            _register_optimizer_state(rec, optimizer, upgrade_only=False)

            def pre(opt, args, kwargs):
                rec.in_optimizer = True

            def post(opt, args, kwargs):
                rec.in_optimizer = False
                steps["n"] += 1

            cleanup.callback(optimizer.register_step_pre_hook(pre).remove)
            cleanup.callback(optimizer.register_step_post_hook(post).remove)
        if rec.stack is not None:
            rec.stack.install()
            cleanup.callback(rec.stack.remove)
        cleanup.enter_context(torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack))
        with RecordingMode(rec):
            step_fn()
            if optimizer is not None and steps["n"] == 0:
                optimizer.step()
        rec.in_optimizer = False
        # Kinds known only after the step.
        if model is not None:
            for p in model.parameters():
                if p.grad is not None:
                    rec.register_existing(p.grad, "gradient")
        if optimizer is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        rec.register_existing(p.grad, "gradient")
            _register_optimizer_state(rec, optimizer, upgrade_only=True)
        rec.timer.resolve(rec.builder)
        rec.close()
        return rec.builder.finish()


def _register_optimizer_state(rec: Recorder, optimizer, upgrade_only: bool) -> None:
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                if upgrade_only and not _is_live(rec, v):
                    continue
                rec.register_existing(v, "optimizer_state")


def _is_live(rec: Recorder, t: torch.Tensor) -> bool:
    try:
        return rec.builder.is_live(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
