"""recorder.py -- the observer that turns one step into TraceBuilder events.

Entry point: Recorder (used by memsched.profiler.profile). It owns a
memsched._C.TraceBuilder and is driven by three sources:
  - RecordingMode, a TorchDispatchMode: every aten op, forward, backward and
    optimizer alike (the mode stack is part of the thread-local state the
    autograd engine carries into its worker threads);
  - the saved-tensor pack hook: marks saved storages as activations, labelled
    by Note [Activation identity];
  - weakref callbacks on storages: frees. See Note [Free detection].

Note [Free detection]
  Rationale: the memory curve needs the op after which each storage dies.
  torch.distributed._tools.mem_tracker learns it from weak references to the
  Python UntypedStorage objects; torch preserves a storage's Python object for
  as long as the StorageImpl lives, so the weakref callback fires exactly when
  the storage is freed (tested in test_profiler.py).
  Approach: every storage the recorder learns of gets such a weakref; the
  callback tells the builder `tensor_freed(key)`, which stamps
  freed_after_op = the last op begun. The callback runs before the allocator
  can hand the address to anyone else, so the key is free for reuse at once.
  Limitations: a storage freed while no op has begun yet is dropped (it was
  never live during an op).
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from memsched import _C
from memsched.profiler.backward_modules import BackwardModuleMap
from memsched.profiler.op_timer import OpTimer
from memsched.saved_tensors import ActivationNumbering, ModuleStack, dtype_name

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"


def _tensors(args, kwargs) -> List[torch.Tensor]:
    """Tensor leaves of aten op arguments (tensors, and lists/tuples of them)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _outputs(out) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [x for x in out if isinstance(x, torch.Tensor)]
    return []


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # sparse, nested, or a subclass without storage: not counted


class Recorder:
    """State of one profiling pass. Not reusable: make a new one per step."""

    def __init__(self, model: Optional[torch.nn.Module], device: str):
        self.builder = _C.TraceBuilder(device)
        self.stack = ModuleStack(model) if model is not None else None
        self.numbering = ActivationNumbering(model)
        self.backward_map = BackwardModuleMap(model)
        self.timer = OpTimer()
        self.in_optimizer = False
        self.closed = False
        self._watch: Dict[int, weakref.ref] = {}  # storage key -> weakref with free callback
        self._on_free: Callable = self._make_free_callback()

    # ---- storages ---------------------------------------------------------
    def _make_free_callback(self):
        builder = self.builder
        watch = self._watch
        this = weakref.ref(self)

        def make(key):
            def freed(_ref):
                rec = this()
                if rec is None or rec.closed:
                    return
                if watch.pop(key, None) is not None and builder.is_live(key):
                    builder.tensor_freed(key)

            return freed

        return make

    def register_existing(self, t: torch.Tensor, kind: str) -> Optional[int]:
        """A storage that exists before the step (or was never seen made): live from op 0."""
        st = _storage(t)
        if st is None:
            return None
        key = st._cdata
        if self.builder.is_live(key):
            self.builder.upgrade_kind(key, kind)
        else:
            self.builder.tensor_existing(key, st.nbytes(), dtype_name(t.dtype), kind)
            self._watch[key] = weakref.ref(st, self._on_free(key))
        return key

    # ---- saved tensors ----------------------------------------------------
    def pack(self, t: torch.Tensor):
        path = self.stack.current if self.stack is not None else ""
        act = self.numbering.number(t, path)
        if act is not None and act.is_first_pack:
            key = self.register_existing(t, "activation")
            if key is not None:
                self.builder.upgrade_kind(key, "activation", act.label)
        return t

    @staticmethod
    def unpack(t):
        return t

    # ---- ops ----------------------------------------------------------------
    def phase(self) -> str:
        if self.in_optimizer:
            return OPTIMIZER
        if torch._C._current_graph_task_id() != -1:
            return BACKWARD
        return FORWARD

    def on_op(self, func, args, kwargs):
        b = self.builder
        phase = self.phase()
        self.backward_map.tag_pending()
        if phase == FORWARD:
            path = self.stack.current if self.stack is not None else ""
        elif phase == BACKWARD:
            path = self.backward_map.module_of_current_node()
        else:
            path = ""
        op_id = b.begin_op(func._schema.name, path, phase)
        inputs = _tensors(args, kwargs)
        bytes_read = 0
        is_cuda = False
        for t in inputs:
            st = _storage(t)
            if st is None:
                continue
            key = st._cdata
            if not b.is_live(key):
                self.register_existing(t, "temporary")
            b.tensor_used(key)
            bytes_read += t.numel() * t.element_size()
            is_cuda = is_cuda or t.is_cuda
        token = self.timer.start(is_cuda)
        out = func(*args, **kwargs)
        outputs = _outputs(out)
        if not is_cuda:
            is_cuda = any(t.is_cuda for t in outputs)
        duration_us = self.timer.stop(op_id, token, is_cuda)
        mutable = func._schema.is_mutable
        bytes_written = 0
        for t in outputs:
            st = _storage(t)
            if st is None:
                continue
            key = st._cdata
            if b.tensor_allocated(key, st.nbytes(), dtype_name(t.dtype), "temporary"):
                self._watch[key] = weakref.ref(st, self._on_free(key))
                bytes_written += t.numel() * t.element_size()
            elif mutable:
                bytes_written += t.numel() * t.element_size()
        flops = 0
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            try:
                flops = formula(*args, **kwargs, out_val=out)
            except Exception:  # a formula that does not cover this overload: unknown FLOPs
                flops = 0
        b.end_op(duration_us or 0.0, float(flops), bytes_read, bytes_written)
        if phase == FORWARD and torch.is_grad_enabled():
            self.backward_map.note_outputs(outputs, path)
        return out

    # ---- end of step --------------------------------------------------------
    def close(self):
        """Stop observing: later frees are ignored; drop every weakref."""
        self.closed = True
        self._watch.clear()
        self.backward_map.clear()


class RecordingMode(TorchDispatchMode):
    """Forwards every aten op to Recorder.on_op."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "profiler":  # record_function markers: no compute, no memory
            return func(*args, **(kwargs or {}))
        return self.recorder.on_op(func, args, kwargs or {})
