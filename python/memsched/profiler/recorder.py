"""recorder.py -- the observer that turns one step into TraceBuilder events.

Entry point: Recorder (used by memsched.profiler.profile). It owns a
memsched._C.TraceBuilder and is driven by three sources:
  - RecordingMode, a TorchDispatchMode: every aten op, forward, backward and
    optimizer alike (the mode stack is part of the thread-local state the
    autograd engine carries into its worker threads);
  - the saved-tensor pack hook: marks saved storages as activations, labelled
    by Note [Activation identity];
  - weakref callbacks on storages: frees. See Note [Free detection].
  What the mode changes in backward: Note [Backward formulas under the recording mode].

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

Note [Inputs an op lets go of]
  Rationale: an op can free the storage of one of its own inputs while it runs: set_ swaps a
  tensor's storage (unpickling builds every tensor as torch.empty(0).set_(storage): a DataLoader
  worker's batch, torch.load, deepcopy of a module's buffers), so the empty storage died inside
  the op, its free was recorded before the op itself, and the op's use of it failed in the
  builder ("storage ... is not live"): the profiled step raised where plain PyTorch trains
  (found by a helper checkpointing inside the first step; 4 of 6 runs of a two-worker DataLoader
  with two micro-batches a step).
  Approach: on_op holds its inputs' storage objects until the op is recorded, so such a storage
  dies after it: used by the op, freed after it.

Note [Backward formulas under the recording mode]
  With any TorchDispatchMode active, ATen's isTensorSubclassLike() is true for every tensor, and a
  few backward formulas then take their subclass-safe branch: prod and cumprod compute without
  dividing by the input (prod_safe_zeros_backward), which rounds differently in the last bits. The
  profiled step's backward runs under RecordingMode, so such a model's profiled step gets gradients
  one or two ulps from plain PyTorch's (1.8e-14 in float64 after three SGD steps, tanh + prod +
  cumprod); its executed steps run no mode and are bitwise plain's. Forward-mode AD inside the
  profiled step (a torch.autograd.forward_ad dual through LayerNorm) likewise gets tangents 1-2 ulps
  off (an empty pass-through TorchDispatchMode does the same without memsched; found by fuzzing).
  Ops outside those formulas are unaffected (every model of tests/python/test_module_zoo.py is
  bitwise after its profiled step).
  What would remove it -- observing backward ops without a dispatch mode (RecordFunction callbacks)
  -- is not built.

Note [Held outside the graph]
  Rationale: an offloaded or recomputed activation leaves the device only when
  nothing but the autograd graph references it; a caller's frame (the outer
  nn.Sequential's `input`, a residual's x) may hold it well past its last use
  (Note [Held by the caller] in csrc/core/trace.h). The plan must release it
  then, not at its last use, or the executor's measured peak exceeds the plan.
  Approach: the profiled step's pack hook keeps every activation through a
  detached alias of its own (one TensorImpl, so one reference to the storage,
  per save), and counts the saves of each storage. Before each forward op the
  recorder compares, for every saved storage not yet found released, the
  StorageImpl's use count with those saves (+1: the Python storage object that
  free detection made; torch keeps it while the storage lives and it holds one
  reference): more references mean something else holds it during the last op
  begun (TraceBuilder.tensor_held -> held_until_op; a storage found released
  was still held at the previous check, so during the op begun since: frames
  let go after an op returns, not during it). Once only the saves hold it, it
  leaves the set; the set is checked once more after the first backward
  op, so a storage still held there is marked held into the backward pass.
  Cost: one C call per held storage per forward op, in the profiled step only;
  the set is the storages a frame holds (the batch, residuals), not all saves.
  Limitations: a save dropped during the forward (a discarded branch) lowers
  the count the same as a released frame reference would.
"""
from __future__ import annotations

import time
import weakref
from typing import Callable, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memsched import _C
from memsched.profiler.backward_modules import BackwardModuleMap
from memsched.profiler.flops import flop_fn
from memsched.profiler.op_timer import OpTimer
from memsched.profiler.module_paths import ModulePathStack
from memsched.saved_tensors import ActivationNumbering, dtype_name, storage_key

_storage_use_count = torch._C._storage_Use_Count  # StorageImpl references (Note [Held outside the graph])
_version_counter_key = _C.version_counter_key  # Note [Saves through several counters] in csrc/core/trace.h
_current_node = torch._C._current_autograd_node  # the node the engine runs now, or None
_kept_pack = _C.kept_pack
_NO_SEQUENCE = 2**64 - 1                          # sequence_nr of nodes outside the count (AccumulateGrad)

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
_graph_task_id = torch._C._current_graph_task_id  # != -1 inside the autograd engine
_grad_enabled = torch.is_grad_enabled
_clock_ns = time.perf_counter_ns
_DTYPE_NAMES = {d: dtype_name(d) for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                           torch.int64, torch.int32, torch.bool, torch.uint8, torch.int8)}


def _tensors(args, kwargs) -> List[torch.Tensor]:
    """Tensor leaves of aten op arguments (tensors, and lists/tuples of them), in argument order."""
    out = [a for a in args if isinstance(a, torch.Tensor)]
    if len(out) == len(args) and not kwargs:
        return out  # the common case: every argument is a Tensor
    out = []
    for a in (args, kwargs.values()) if kwargs else (args,):
        for x in a:
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple)):  # plain loops: a generator costs more than these lists
                for y in x:
                    if isinstance(y, torch.Tensor):
                        out.append(y)
    return out


def _outputs(out) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [x for x in out if isinstance(x, torch.Tensor)]
    return []


# Note [Profiler overhead]
#   Rationale: a Python dispatch mode sees every aten op; on a small CPU model
#   ops take a few microseconds, so every microsecond of recording shows.
#   Budget (small transformer, batch 8, CPU, one thread; plain step ~1.4 ms,
#   320 dispatched ops of which 133 recorded, 187 views passed through):
#     dispatch mode alone, nothing done per op   ~1.2 ms  (~3.8 us per op)
#     module hooks + saved-tensor hooks           ~0.25 ms (each first pack
#       also dispatches one extra `detach` through the mode: autograd's doing)
#     session start + stop                        ~0.25 ms (ActivationNumbering
#       setup ~50 us of it)
#     on_op's own work                            ~3.3 us per recorded op
#       (record_op ~0.7 us, storages/bytes of inputs and outputs, module path,
#       timing, FLOPs, backward-path bookkeeping)
#     packs (ActivationNumbering.number ~2.5 us per first pack), frees (~0.5 us
#       per storage) and backward-path tags (~1 us per forward op)
#   Approach: everything per OpOverload is computed once per process
#   (_OP_INFO: pass-through, name, mutability, FLOP formula); view ops
#   (func.is_view: view, t, transpose, expand, detach, ...) pass straight
#   through and are not Op records -- they allocate, read and compute nothing,
#   and their outputs share a storage we already track (their backward nodes
#   get a module path by the fallback of Note [Backward module path]);
#   liveness is a dict lookup in Python (the keys in `_watch` are exactly the
#   live storages); one storage weakref class carries its key and one shared
#   callback serves them all; the one-Tensor output case is unrolled (no
#   lists, no pytree); record_op takes flat lists read with the C API; FLOPs
#   of the matmul family skip flop_counter's tree-mapping wrapper; module
#   paths come from two global module hooks (module_paths.py), and the
#   module tree is walked once per session (session._walk).
#   Limitations: the dispatch mode itself (arguments converted to Python and
#   back, ~3.8 us per op including pass-through views) and the hooks cost
#   ~2.2x a plain step here before anything is recorded; no recording
#   change removes that.


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # sparse, nested, or a subclass without storage: not counted


class _StorageRef(weakref.ref):
    """A weak reference to a storage's Python object that carries its key."""
    __slots__ = ("key",)


# Per-OpOverload facts, for the whole process (OpOverloads live as long as
# torch.ops does; the entry also holds `func`, so its id cannot be reused):
# id(func) -> (pass through unrecorded, name, is_mutable, flop fn or None, func).
# Keyed by id: an OpOverload's __hash__ is Python code. See Note [Profiler overhead].
_OP_INFO: Dict[int, tuple] = {}


def _op_info(func) -> tuple:
    # Pass through: a view or a record_function marker allocates, reads and computes nothing.
    passthrough = func.is_view or func.namespace == "profiler"
    info = (passthrough, func._schema.name, func._schema.is_mutable, flop_fn(func), func)
    _OP_INFO[id(func)] = info
    return info


class Recorder:
    """State of one profiling pass. Not reusable: make a new one per step."""

    def __init__(self, model: Optional[torch.nn.Module], device: str, named_params: Optional[list] = None,
                 named_modules: Optional[list] = None):
        """named_params / named_modules: model.named_parameters() / named_modules() already listed, or None."""
        self.builder = _C.TraceBuilder(device)
        self.stack = ModulePathStack(model, named_modules) if model is not None else None
        self.numbering = ActivationNumbering(model)
        self.backward_map = BackwardModuleMap(model, named_params)
        self.timer = OpTimer()
        self.in_optimizer = False
        self.closed = False
        # backward op id -> sequence offset of the autograd node running it (Note [Backward node
        # triggers] in csrc/torch/saved_tensor_path.cpp); offsets count from the step's start
        self.seq_base = _C.autograd_sequence_peek()
        self.node_of_op: Dict[int, int] = {}
        self.backward_open = False  # a backward pass has run ops and not ended (it may have raised)
        self._watch: Dict[int, _StorageRef] = {}  # storage key -> weakref with free callback; == builder's live keys
        # Note [A parameter read after its gradient is final] (ooo/backward.py): the storage keys of the
        # parameters, while a fused update is installed; a forward op reading one through an alias
        # without gradient holds that parameter's update to the end of backward, at every step
        self._param_keys = frozenset()
        if _C.fused_update_installed() and (named_params is not None or model is not None):
            params = named_params if named_params is not None else list(model.named_parameters())
            self._param_keys = frozenset(p.untyped_storage()._cdata for _, p in params)
        # Note [Held outside the graph]: saved storage key -> saves of it (each holds one alias), and
        # the keys that something besides those saves still held at the last check.
        self._saves: Dict[int, int] = {}
        self._counters: Dict[int, set] = {}  # storage key -> version counters of its saves
        self._held: Dict[int, None] = {}
        self._on_free: Callable = self._make_free_callback()
        self._stack_list = self.stack.stack if self.stack is not None else []
        # Note [Memory the trace does not model] (unmodeled.py): the device allocator's peak around each
        # op (op id -> bytes), when the session measures it (an accelerator, saves kept on the device).
        self.counters = None
        self.op_peaks: Dict[int, int] = {}
        # the traced bytes the step held off the device during each op (op id -> bytes; a profile with
        # its saves offloaded sets off_device, which tells them)
        self.off_device: Optional[Callable[[], int]] = None
        self.op_off_device: Dict[int, int] = {}

    # ---- storages ---------------------------------------------------------
    def _make_free_callback(self):
        # One callback for every storage (no closure per storage); it holds
        # the dict and the builder, not the Recorder. close() empties `watch`
        # and nothing is watched after it, so later frees are ignored.
        watch = self._watch
        tensor_freed = self.builder.tensor_freed

        def freed(ref):
            key = ref.key
            if watch.get(key) is ref:
                del watch[key]
                tensor_freed(key)

        return freed

    def _watch_storage(self, st, key: int) -> None:
        if self.closed:
            return  # past the step: frees are not recorded
        ref = _StorageRef(st, self._on_free)
        ref.key = key
        self._watch[key] = ref

    def register_existing(self, t: torch.Tensor, kind: str) -> Optional[int]:
        """A storage that exists before the step (or was never seen made): live from op 0."""
        st = _storage(t)
        if st is None:
            return None
        key = st._cdata
        if key in self._watch or self.builder.is_live(key):  # _watch mirrors the live keys until close()
            self.builder.upgrade_kind(key, kind)
        else:
            self.builder.tensor_existing(key, st.nbytes(), _DTYPE_NAMES.get(t.dtype) or dtype_name(t.dtype), kind)
            self._watch_storage(st, key)
        return key

    # ---- saved tensors ----------------------------------------------------
    def note_save(self, t: torch.Tensor):
        """Number a saved tensor and mark its storage an activation at its first pack; returns the
        Activation, or None for a parameter or buffer (Note [Activation identity])."""
        stack = self._stack_list
        act = self.numbering.number(t, stack[-1] if stack else "")
        if act is not None:
            key = storage_key(t)
            if key is not None:
                if act.is_first_pack:
                    if key not in self._watch:  # never seen made: it existed before the step
                        self.register_existing(t, "activation")
                    self.builder.upgrade_kind(key, "activation", act.label)
                # See Note [Saves through several counters] in csrc/core/trace.h
                counters = self._counters.get(key)
                if counters is None or act.is_first_pack:  # (a key names a new storage after a free)
                    counters = self._counters[key] = set()
                n = len(counters)
                counters.add(_version_counter_key(t))
                if len(counters) > max(n, 1):
                    self.builder.tensor_save_counters(key, len(counters))
        return act

    def pack(self, t: torch.Tensor):
        return self.keep(t, self.note_save(t))

    def keep(self, t: torch.Tensor, act):
        """The packed object of a save kept on the device; `act`: note_save(t)."""
        key = storage_key(t) if act is not None else None
        if key is not None and key in self._watch and not self.closed:
            # See Note [Held outside the graph]: one alias per save, counted.
            self._saves[key] = self._saves.get(key, 0) + 1
            self._held[key] = None
            return _kept_pack(t.detach())
        # kept_pack holds the op's own outputs detached (no cycle through C++ that gc cannot see:
        # See Note [Packing without reference cycles] in offload/executor.py) and kept_unpack redoes
        # PyTorch's in-place-modification check, which saved-tensor hooks switch off -- the
        # profiled step must raise where plain PyTorch raises (Note [Version checks]).
        return _kept_pack(t)

    unpack = staticmethod(_C.kept_unpack)

    # ---- ops ----------------------------------------------------------------
    def on_op(self, func, info, args, kwargs):
        # Hot path (every recorded aten op of the step): See Note [Profiler overhead].
        # `info` is _OP_INFO[id(func)] for a func that is not passed through.
        _, name, mutable, flops_of, _ = info
        watch = self._watch
        bmap = self.backward_map
        if self.in_optimizer:
            phase, path = OPTIMIZER, ""
        elif _graph_task_id() != -1:
            phase = BACKWARD
            if not self.backward_open:
                self._open_backward()
            if bmap._pending:
                bmap.tag_pending()
            path = bmap.module_of_current_node()
            node = _current_node()
            if node is not None:
                seq = node._sequence_nr()
                if self.seq_base <= seq < _NO_SEQUENCE:
                    self.node_of_op[self.builder.num_ops] = seq - self.seq_base
        else:
            phase = FORWARD
            if self._held:
                self._check_held()
            if bmap._pending:
                bmap.tag_pending()
            stack = self._stack_list
            path = stack[-1] if stack else ""
        used = []
        inputs = []  # their storages, held until the op is recorded (See Note [Inputs an op lets go of])
        bytes_read = 0
        is_cuda = False
        param_keys = self._param_keys
        for t in _tensors(args, kwargs):
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue  # no storage: not counted
            key = st._cdata
            inputs.append(st)
            if key in param_keys and phase is BACKWARD:  # See Note [A parameter read after its gradient is final]
                _C.note_backward_parameter_read(t)  # (ooo/backward.py; Note [The profiled step updates after backward])
            if key not in watch:
                self.register_existing(t, "temporary")
            used.append(key)
            bytes_read += t.nbytes
            is_cuda = is_cuda or t.is_cuda
        counters = self.counters  # Note [Memory the trace does not model] (unmodeled.py); None on CPU
        if counters is not None:
            counters.reset()
            if self.off_device is not None:
                self.op_off_device[self.builder.num_ops] = self.off_device()
        if is_cuda:
            op_id = self.builder.num_ops
            token = self.timer.start(True)
            out = func(*args, **kwargs)
            duration_us = self.timer.stop(op_id, token, True) or 0.0  # resolved after the step
        else:
            t0 = _clock_ns()
            out = func(*args, **kwargs)
            duration_us = (_clock_ns() - t0) / 1000.0
        if counters is not None:
            self.op_peaks[self.builder.num_ops] = counters.peak()
        builder = self.builder
        if isinstance(out, torch.Tensor):
            # The common case, one Tensor out: the loop below, unrolled.
            if not is_cuda and out.is_cuda:  # a CPU-argument op that made CUDA tensors (factories)
                duration_us = 0.0
            try:
                st = out.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                st = None
            if st is None:
                made = []
                bytes_written = 0
            else:
                key = st._cdata
                made = [key, st.nbytes(), _DTYPE_NAMES.get(out.dtype) or dtype_name(out.dtype)]
                if key not in watch:  # a new storage: watch it (_watch_storage, inlined)
                    ref = _StorageRef(st, self._on_free)
                    ref.key = key
                    watch[key] = ref
                    bytes_written = out.nbytes
                else:
                    bytes_written = out.nbytes if mutable else 0
            flops = flops_of(args, kwargs, out) if flops_of is not None else 0
            builder.record_op(name, path, phase, used, made, duration_us, flops, bytes_read, bytes_written)
            if self._held and phase is BACKWARD:
                self._check_held()  # Note [Held outside the graph]: still held at the first backward op
            if phase is FORWARD and _grad_enabled():
                bmap._pending.append((weakref.ref(out), path))  # bmap.note_outputs((out,), path), inlined
            return out
        outputs = _outputs(out)
        if not is_cuda and outputs and outputs[0].is_cuda:  # a CPU-argument op that made CUDA tensors
            duration_us = 0.0
        made = []  # flat: key, bytes, dtype, key, bytes, dtype, ...
        on_free = self._on_free
        bytes_written = 0
        for t in outputs:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            key = st._cdata
            made += (key, st.nbytes(), _DTYPE_NAMES.get(t.dtype) or dtype_name(t.dtype))
            if key not in watch:  # a new storage: watch it (_watch_storage, inlined)
                ref = _StorageRef(st, on_free)
                ref.key = key
                watch[key] = ref
                bytes_written += t.nbytes
            elif mutable:
                bytes_written += t.nbytes
        flops = flops_of(args, kwargs, out) if flops_of is not None else 0
        builder.record_op(name, path, phase, used, made, duration_us, flops, bytes_read, bytes_written)
        if self._held and phase is BACKWARD:
            self._check_held()  # Note [Held outside the graph]: still held at the first backward op
        if phase is FORWARD and outputs and _grad_enabled():
            bmap.note_outputs(outputs, path)
        return out

    def _check_held(self):
        """Note [Held outside the graph]: stamp held_until_op = the last op begun on every saved
        storage that something besides its saves still references; forget the others."""
        watch, saves, held = self._watch, self._saves, self._held
        tensor_held = self.builder.tensor_held
        backward = self.backward_open
        for key in list(held):
            if key not in watch:  # died: freed_after_op says when
                del held[key]
                continue
            still = _storage_use_count(key) - 1 > saves[key]
            if still or not backward:
                # Held at the last check, so during the op begun since (a frame lets go after an op
                # returns, not during it); in backward only what is still held counts.
                tensor_held(key)
            if backward or not still:
                del held[key]  # released, or held into the backward pass (checked once, at its first op)

    def _open_backward(self):
        # The engine runs this pass's final callbacks only when it completes: a backward_open
        # still set when the next forward starts means the pass raised (memsched.optimize then
        # records a fresh step; See Note [A step that raises] in optimize.py).
        self.backward_open = True

        def closed():
            self.backward_open = False

        torch.autograd.Variable._execution_engine.queue_callback(closed)

    # ---- end of step --------------------------------------------------------
    def close(self):
        """Stop observing: later frees are ignored; drop every weakref."""
        self.closed = True
        self._watch.clear()
        self._held.clear()
        self._saves.clear()
        self._counters.clear()
        self.backward_map.clear()


class RecordingMode(TorchDispatchMode):
    """Forwards every aten op to Recorder.on_op.

    WARNING: __torch_dispatch__ is assigned after the class body on purpose:
    TorchDispatchMode.__init_subclass__ would wrap it in torch._disable_dynamo,
    which costs more per op than a small CPU op itself (Note [Profiler
    overhead]). The profiler never runs under torch.compile tracing, so the
    wrapper buys nothing here.
    """

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder


def _recording_dispatch(self, func, types, args=(), kwargs=None):
    info = _OP_INFO.get(id(func)) or _op_info(func)
    if info[0]:  # a view or marker: straight through (Note [Profiler overhead])
        return func(*args, **kwargs) if kwargs else func(*args)
    return self.recorder.on_op(func, info, args, kwargs or {})


RecordingMode.__torch_dispatch__ = _recording_dispatch
