"""session.py -- the profiler's instrumentation as start() / stop(), for callers
that drive the step themselves (memsched.optimize profiles the user's own
first step). memsched.profile(step_fn, ...) is start(); step_fn(); stop().

Entry point: ProfilerSession(model, optimizer=None, device=None).start() ...
.stop() -> Trace (or .abort() when the step failed). See Note [What profile()
records] in profile.py.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from memsched.profiler.recorder import Recorder, RecordingMode
from memsched.profiler.unmodeled import DeviceCounters, add_unmodeled


def _device_of(model: Optional[torch.nn.Module]) -> str:
    if model is not None:
        for p in model.parameters():
            return str(p.device)
    return "cpu"


def _walk(model: torch.nn.Module):
    """(named modules, named parameters, buffers) of `model` from one walk of its
    module tree: the same items, in the same order, as model.named_modules(),
    model.named_parameters() and model.buffers() (each de-duplicated by
    identity), which walk the tree once each (Note [Profiler overhead])."""
    modules = list(model.named_modules())
    named_params, buffers = [], []
    seen_params, seen_buffers = set(), set()
    for prefix, module in modules:
        for name, p in module._parameters.items():
            if p is not None and id(p) not in seen_params:
                seen_params.add(id(p))
                named_params.append((prefix + "." + name if prefix else name, p))
        for b in module._buffers.values():
            if b is not None and id(b) not in seen_buffers:
                seen_buffers.add(id(b))
                buffers.append(b)
    return modules, named_params, buffers


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


class ProfilerSession:
    """One step of instrumentation, opened and closed by the caller.

    start() registers the pre-existing state (parameters, buffers, gradients,
    optimizer state), then installs the ModuleStack, the saved-tensor hooks,
    the optimizer's step pre/post hooks (ops inside optimizer.step() get phase
    optimizer) and the dispatch mode. stop() removes them in reverse order,
    marks gradients and optimizer state, and returns the validated Trace;
    abort() removes them and drops the recording. Both are safe after a failed
    step and leave nothing installed.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer=None, device: Optional[str] = None,
                 offload=None):
        """offload: an OffloadedSaves (profiler/offloaded_saves.py) to keep the step's saved
        activations in host memory while only autograd holds them (Note [Profiling with saved
        activations offloaded]); None keeps them on the device. The Trace is the same."""
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"memsched.profile: model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "state")
                                          and hasattr(optimizer, "register_step_pre_hook")):
            raise TypeError(f"memsched.profile: optimizer must be a torch.optim.Optimizer (or None), got "
                            f"{type(optimizer).__name__}")
        if device is not None:
            try:
                kind = torch.device(device).type
            except (RuntimeError, TypeError, ValueError):
                raise ValueError(f"memsched.profile: device must be a torch device such as 'cpu', 'cuda' or "
                                 f"'cuda:0' (or None: the model's), got {device!r}") from None
            if kind == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"memsched.profile: device {device!r}, but torch.cuda.is_available() is False; "
                                 f"the trace's device decides which op times a GPU preset uses -- pass 'cpu' or None")
        self.model = model
        self.optimizer = optimizer
        self.offload = offload
        self.device = str(device) if device is not None else _device_of(model)
        self.optimizer_steps = 0   # optimizer.step() calls seen while recording
        self.node_of_op = {}       # backward op id -> autograd node sequence offset, after stop()
        # op id where each forward of the model that ran with grad enabled began (note_forward());
        # a forward under no_grad (an evaluation) saves nothing: Note [Forwards that save nothing]
        self.forward_starts = []
        self.unmodeled_bytes = 0   # after stop(): Note [Memory the trace does not model] (profiler/unmodeled.py)
        self.device_peak_bytes = None  # after stop(), when the allocator's peak was read around each op
        self._rec: Optional[Recorder] = None
        self._mode: Optional[RecordingMode] = None
        self._exits: Optional[contextlib.ExitStack] = None

    @property
    def recording(self) -> bool:
        return self._exits is not None

    @property
    def backward_failed(self) -> bool:
        """A backward pass of the recorded step started and never ended: it raised."""
        return self._rec is not None and self._rec.backward_open

    def _params(self, named_params) -> list:
        """The model's parameters, then the optimizer's others; each once."""
        params = [p for _, p in named_params]
        if self.optimizer is not None:
            seen = {id(p) for p in params}
            for g in self.optimizer.param_groups:
                for p in g["params"]:
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
        return params

    def start(self) -> "ProfilerSession":
        if self._exits is not None:
            raise RuntimeError("ProfilerSession.start(): already recording; call stop() or abort() first")
        modules, named_params, buffers = _walk(self.model) if self.model is not None else ([], [], [])
        if self.offload is None:
            rec = Recorder(self.model, self.device, named_params, modules)
            rec.counters = DeviceCounters.for_device(self.device)  # Note [Memory the trace does not model]
        else:
            from memsched.profiler.offloaded_saves import OffloadingRecorder
            self.offload.begin_step()
            rec = OffloadingRecorder(self.model, self.device, named_params, modules, saves=self.offload)
            rec.counters = DeviceCounters.for_device(self.device)  # Note [Memory the trace does not model]
        params = self._params(named_params)
        exits = contextlib.ExitStack()
        try:
            exits.callback(rec.close)
            for p in params:
                rec.register_existing(p, "parameter")
                if p.grad is not None:
                    rec.register_existing(p.grad, "gradient")
            for buf in buffers:
                rec.register_existing(buf, "parameter")
            if self.optimizer is not None:
                _register_optimizer_state(rec, self.optimizer, upgrade_only=False)

                def pre(opt, args, kwargs):
                    rec.in_optimizer = True

                def post(opt, args, kwargs):
                    rec.in_optimizer = False
                    self.optimizer_steps += 1

                exits.callback(self.optimizer.register_step_pre_hook(pre).remove)
                exits.callback(self.optimizer.register_step_post_hook(post).remove)
            if rec.stack is not None:
                rec.stack.install()
                exits.callback(rec.stack.remove)
            exits.enter_context(torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack))
            mode = RecordingMode(rec)
            mode.__enter__()
            exits.callback(mode.__exit__, None, None, None)
        except BaseException:
            exits.close()
            raise
        self._rec, self._mode, self._exits = rec, mode, exits
        return self

    def note_forward(self) -> None:
        """The model's forward begins now (its root's forward pre-hook): with grad enabled, its first
        op is the next one recorded. See Note [Forwards that save nothing] in offload/recompute.py."""
        if self._rec is not None and torch.is_grad_enabled():
            self.forward_starts.append(self._rec.builder.num_ops)

    def abort(self) -> None:
        """Stop recording and drop what was recorded. Safe to call twice."""
        exits, self._exits = self._exits, None
        self._rec = self._mode = None
        if exits is not None:
            exits.close()
            if self.offload is not None:
                self.offload.end_step()

    def stop(self):
        """Stop recording; return the validated memsched.Trace of what ran since start()."""
        if self._exits is None:
            raise RuntimeError("ProfilerSession.stop(): not recording; call start() first")
        rec, exits = self._rec, self._exits
        self._exits = self._rec = self._mode = None
        # Uninstall everything first (the dispatch mode leaves first), so the
        # bookkeeping below records no ops; frees after this point are past the step.
        exits.close()
        rec.in_optimizer = False
        if self.offload is not None:
            self.offload.end_step()
        # Walk again: the step may have added parameters (their .grad is a gradient too).
        named_params = list(self.model.named_parameters()) if self.model is not None else []
        for p in self._params(named_params):
            if p.grad is not None:
                rec.register_existing(p.grad, "gradient")
        if self.optimizer is not None:
            _register_optimizer_state(rec, self.optimizer, upgrade_only=True)
        rec.timer.resolve(rec.builder)
        self.node_of_op = rec.node_of_op  # Note [Backward node triggers] (csrc/torch/saved_tensor_path.cpp)
        trace = rec.builder.finish()
        self.unmodeled_bytes = add_unmodeled(trace, rec.op_peaks, rec.op_off_device)  # Note [Memory the trace does not model]
        # the allocator's peak was restarted at every op: the step's is the largest of the ops'
        self.device_peak_bytes = max(rec.op_peaks.values()) if rec.op_peaks else None
        return trace
