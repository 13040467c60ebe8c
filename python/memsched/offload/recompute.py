"""Unpack-time recompute: the executor's side of a plan's recompute decisions (planner="hybrid").

Entry points: ForwardOpLog (a dispatch mode over one forward that records the ops of the plan's
recompute chains), Recipe (what recreates one activation) and RecomputeStats.

Note [Unpack-time recompute]
  Rationale: a recomputed activation is released after the forward and recreated just before its
  first backward use by replaying the forward ops that made it (Note [Recompute model] in
  csrc/core/recompute.h). torch.utils.checkpoint replays whole regions under hooks of its own,
  which would hide the region's saves from the executor's numbering (and its offloads); here
  the replay is per activation, exactly the chain the planner priced.
  Approach:
    Recording. While a step's forward runs, a TorchDispatchMode counts the aten ops the profiler
    counted (views and profiler markers pass through uncounted, as in RecordingMode), starting at
    the trace op where this forward began. An op whose trace id is in some recomputed
    activation's chain is run and recorded: its function, its arguments with every tensor either
    *produced in this step by a recorded op* (kept only as storage key + view geometry: no
    reference, so the storage can die) or *external* (held, with its version), and the RNG state
    before it when its schema takes a Generator. Every other op runs untouched; only its writes
    (schema alias_info.is_write) are looked at.
    Packing. When the saved-tensor hook sees the first save of an activation the plan recomputes,
    the recipe is the slice of recorded ops that writes its storage, followed backwards through
    their recorded inputs. The save then holds the recipe and not the tensor. A later save of the
    same storage shares the recipe only while no op wrote the storage since its slice was taken
    (ForwardOpLog.serves_a_later_save): torch.unsafe_chunk pieces (ATen's GRU cell) have version
    counters of their own, so a piece written after the slice was taken came at an equal version and
    replayed without that write (1e-3 off); such a save keeps its tensor.
    Geometry. A recorded input made by a recorded op is seen again on the replayed storage with its
    dtype, size, stride, offset and its lazy conjugate and negative bits (c.conj(), conj().imag):
    without the bits, c * c.conj() replayed as c * c (2.55 off).
    The executor's own ops (packing, and an unpack inside the forward: torch.autograd.grad there)
    run with the log paused: neither counted nor recorded (a recorded set_ of memsched's raised a
    KeyError at replay).
    Replay. At the first unpack the recipe runs under no_grad with autocast off, each recorded op
    on fresh tensors rebuilt from the replayed storages, the RNG state restored around random
    ops; the result is a view with the saved tensor's dtype, size, stride and offset. An
    activation the plan recreates inside another's replay (a shared replay) takes its value
    from that replay and holds it until its own unpack.
  Exactness: the replay runs the very ops and arguments of this forward, so it does not depend
  on the profile being right: a wrong or stale plan costs memory or time, never values. What
  could change a value is refused at pack time (the save keeps its tensor, counted as
  `kept_instead` in StepStats):
    - a storage of the slice written by an op that was not recorded (an in-place writer the chain
      does not list): "tainted";
    - an activation not written by any recorded op (the profile's op numbering does not match
      this forward, e.g. a different code path);
    - a recorded op that writes an external tensor larger than kScratchBytes (BatchNorm's running
      statistics are small: the replay writes into a copy taken before the op, so the running
      statistics are updated once, as in plain PyTorch);
    - a recorded cuDNN/MIOpen RNN that applies dropout: its masks come from an RNG state buffer of
      its own (dropout_state), which the kernel advances without a version bump (_OWN_RNG_STATE);
    - a recorded op that reads an inference tensor (made under torch.inference_mode(): a teacher's
      features fed to the model), which has no version counter to check at the replay;
    - a storage of the slice that an uninitialised factory (empty_like, new_empty, ...) made and no
      recorded op of the slice wrote: a kernel no dispatch mode sees (a C++/CUDA extension, Triton,
      numpy) filled it (Note [Memory filled outside the dispatcher] in csrc/core/recompute.cpp, where
      the planner makes the same check, so a plan does not count on such a recompute).
  Ops that run under torch.inference_mode() (an evaluation forward at the start of a step) save
  nothing and are counted, never recorded: their tensors have no version counter either (reading
  one raised "Inference tensors do not track version counter" from the recording).
  An external input written in place later in the forward, or in a later forward of the step (seen
  by the mode: nn.Embedding(max_norm=...) renormalises its weight at every forward), is copied first
  for the recorded ops that read it (up to kScratchBytes), or makes every pending recipe that reads it
  replay at once, before the write, and keep its result. After the forward
  nothing is watched: an external input modified between the forward and the replay raises at
  unpack, as PyTorch does for a modified saved tensor -- where autograd saved that input. Where it
  did not (a loop that writes the next batch into its input buffer before backward, and a plan that
  recomputes `sin(x * 2 + 1)` from it: mul and add save nothing), plain PyTorch trains: so at the
  end of the forward the recorded readers of each of its tensor arguments up to kScratchBytes (token
  ids, a small batch) replay from a copy of the bytes they read (not the whole storage: a batch that
  is a view of a large staging buffer), taken then, as for an input written later in the forward
  (found by fuzzing). A larger argument is read as it is, and a change to it between the forward
  and the replay raises a MemschedError at unpack, naming the fix (copying it would cost the plan a
  batch's memory).
  The save's version counter is held, and its unpack's result set on it, in C++ without dispatch
  (Note [Version counter aliases in C++] in csrc/torch/tensor_adapter.h): through the mode, each
  recomputed save cost ~30 us more.
  Limitations: the mode is Python per aten op of the forward (only in steps whose plan
  recomputes something); the replay is the slow path's Python; an op that is nondeterministic
  on the device (atomics) may replay to different bits, as in torch.utils.checkpoint; an external
  input changed between the forward and the replay without a version bump (`p.data.add_(...)`, which
  PyTorch documents as untracked by autograd) replays with its new values, as in
  torch.utils.checkpoint, where plain PyTorch's saved activations keep the old ones. Likewise a write
  that bypasses the dispatcher into a tensor an aten op made (`y = x.sigmoid(); y.numpy()[...] = ...`
  in a custom Function, a kernel writing through data_ptr()) is not seen, and the replay returns the
  aten op's value (found by fuzzing; torch.utils.checkpoint reruns the Function's Python and redoes it).

Note [A recipe built when its saving op has run]
  Rationale: a recomputed activation's Recipe holds the tensor from its save until the op that saved
  it has run (that op may still write it: rrelu_with_noise saves its noise before filling it). It was
  built at the next counted op's dispatch, after that op's own input saves: an output of that op,
  born after them (Note [Measured from birth] in csrc/torch/saved_tensor_path.cpp), was alive beside
  a tensor the plan had released one op before -- a dropout mask beside the next op's output, the
  measured saved-activation peak 19-24% over the hybrid plan's on small MLPs (found by a helper
  probing budgets as a new user).
  Approach: a save made when the op counter says j (an input save of op j, or an output save of op
  j-1) is built once op j has run: at the end of op j's dispatch, before anything of op j+1. An
  output save of a recorded op j-1 is built at once: autograd makes op j's node (the sequence number
  moves on) before it saves op j's inputs, so a save while the counter and the sequence number are
  what they were when op j-1 returned is op j-1's output save -- its op has run. Waiting held
  max_pool2d's indices (an output, no grad_fn) through the next convolution, beside that op's
  output: the measured peak 11-16% over the plan's on a CNN (found by a helper checking budgets).
  A recorded op that writes a built recipe's storage later in the forward, through another version
  counter (`y = h.sigmoid(); y.data.mul_(0.5)`: no version check sees it, and plain PyTorch's saved y
  has the new bytes), makes the recipe take its slice again, with that write, or keep the storage
  (ForwardOpLog._rewritten; building at once had lost such a write one op later: 2e-5 off plain,
  found by a helper reviewing the change). A write of a built recipe's storage that its slice cannot take
  in -- the recipe has replayed already (an outside input of it was written in place, too large to copy),
  or the writer is not recorded (an op under torch.inference_mode()) -- makes it keep the storage: both had
  been lost, 1.3e-3 off plain (found by a helper reviewing the change; _keep_storage).
  Limitations: a save made inside an op's own kernel (no dispatch of ours in between) waits for the
  next counted op to end. A write of a recomputed activation through another version counter after the
  forward has returned (`out = model(x); model.y.data.mul_(0.5); loss.backward()`) is not seen: the replay
  returns the forward's values, where plain PyTorch's saved tensor has the write (as for offloaded saves).

Note [What holds a replay's inputs]
  Rationale: a recorded op's external inputs (a ReLU output that the recorded max_pool2d reads) are
  held by its record, so that the replay can read them. The trace frees such an input where plain
  PyTorch does -- after the last backward node that saved it -- and the plan counts on that. The
  log's `readers` lists (kept for the step, for in-place writes of an input) and `pending` (a shared
  replay's recipe stayed there after its value was set) held records to the step's end, so the
  input lived on beside the tensors fetched after it: the measured peak 13% over the plan's on a
  small CNN and 42% with two micro-batches (found by a helper checking budgets on CPU).
  Approach: only the saves of a recipe (RecomputedView, in autograd's nodes) and `pending` until its
  value is taken hold it; `readers` holds records weakly, and a recipe that takes its value from
  another's replay leaves `pending` then. When the last node that saved it has run, the recipe, its
  records and their inputs go.

Note [Forwards that save nothing]
  Rationale: a forward of the model under torch.no_grad() or inference_mode() between two step
  boundaries -- the Trainer's evaluation after an update, eval_on_start, a generate() call -- saves
  nothing, but it is the step's first forward. Recording matched the n-th forward of a step with the
  n-th run of forward ops of the trace, so an evaluation before the profiled step merged with the
  training forward into one run (every later step recorded from the evaluation's first op: all
  recomputes kept, "not made by a recorded op"), and one before an executed step took the training
  forward's place ("forward not recorded"); so did a second forward with grad enabled before the
  backward (a siamese step's second view: one run of forward ops). Likewise, tensor ops of the loop between two
  micro-batches of gradient accumulation (building or moving the next batch: the Trainer's
  _prepare_inputs) opened a run of forward ops of their own, and the second micro-batch was recorded
  from them. Values were never at risk; the memory was (on a GPU the first planned step's budget
  check then refuses the step).
  Approach: the profiler notes where each forward that runs with grad enabled begins
  (ProfilerSession.note_forward(), called from the Run's root pre-hook), OffloadSchedule.build takes
  those as forward_starts, and the executor records only forwards that run with grad enabled.

Note [Writes in a forward that records nothing]
  Rationale: a forward the log does not record -- under no_grad between a step's forward and its
  backward (a metric on another batch), or one the plan cannot match (more forwards than the profiled
  step had, or after the step diverged) -- ran without the mode, so its in-place writes of what an earlier
  forward's recorded ops read (nn.Embedding(max_norm=...) renormalising its weight, a running mean
  updated in place) went unseen: the replay raised in backward, where plain PyTorch trains (found by a
  helper's random programs).
  Approach: while the step has recorded forwards, such a forward runs under a log that records nothing
  and counts nothing useful; it only sees writes, and each write of an earlier log's outside input is
  copied for its readers first (or makes them replay now), as a write in a later recorded forward is.
  Limitations: that forward pays the mode's cost per op (a step whose plan recomputes, between its first
  forward and run.step() only). Under a caller's own dispatch mode (a FLOP counter) it is not watched,
  and a write there makes the replay raise, as before.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Set

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from memsched._C import MemschedError, autograd_sequence_peek, is_uninitialized_factory_name
from memsched.saved_tensors import on_counter, version_alias

kScratchBytes = 1 << 20  # largest external tensor a recorded op may write (replayed into a copy)

_SYM, _EXT, _SCRATCH, _SNAP = 0, 1, 2, 3


def _key(t):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _Info:
    # rng: may draw random numbers; own_rng: argument positions (dropout, train, dropout_state) of an
    # op that draws from an RNG state of its own, not from a Generator (see _OWN_RNG_STATE)
    __slots__ = ("passthrough", "writes", "rng", "own_rng", "func", "uninit")

    def __init__(self, func):
        schema = func._schema
        self.func = func
        # makes uninitialised memory (Note [Memory filled outside the dispatcher] in csrc/core/recompute.cpp)
        self.uninit = is_uninitialized_factory_name(schema.name)
        self.passthrough = func.is_view or func.namespace == "profiler"  # as in RecordingMode
        self.writes = tuple((i, a.name, a.kwarg_only) for i, a in enumerate(schema.arguments)
                            if (a.alias_info is not None and a.alias_info.is_write)
                            or ("batch_norm" in schema.name and a.name in _UNDECLARED_WRITES))
        self.rng = (any("Generator" in str(a.type) for a in schema.arguments)
                    or any(word in schema.name for word in _RNG_WORDS))
        names = {a.name: (i, a.kwarg_only) for i, a in enumerate(schema.arguments)}
        self.own_rng = (tuple(names[n] for n in _OWN_RNG_STATE)
                        if all(n in names for n in _OWN_RNG_STATE) else None)


# Ops that may draw from the default generator without a Generator argument (native_dropout, the
# attention kernels' dropout_p): csrc/core's is_rng_op_name words, plus attention. Reading the CPU
# generator's state costs ~0.3 ms, so it is read only before these.
_RNG_WORDS = ("dropout", "bernoulli", "rand", "rrelu", "normal", "uniform", "multinomial", "exponential",
              "geometric", "cauchy", "attention")

# Schemas that write an argument without saying so: native_batch_norm, cudnn_batch_norm and
# miopen_batch_norm update the running statistics in training (the reason ATen added
# _native_batch_norm_legit). Treated as written by every *batch_norm* op.
_UNDECLARED_WRITES = ("running_mean", "running_var")

# cuDNN's (and MIOpen's) RNNs draw their dropout masks from `dropout_state`, an RNG state buffer of
# their own that the kernel advances in place without a version bump (ATen caches one per device and
# re-seeds it from the CUDA generator only after that generator's state was set). No generator state
# saved and restored around a replay reproduces the forward's masks, so a recorded
# _cudnn_rnn / miopen_rnn that applies dropout (train and dropout > 0) is not replayed: its
# activations keep their tensors (Note [Unpack-time recompute]).
_OWN_RNG_STATE = ("dropout", "train", "dropout_state")

_INFO: Dict[int, _Info] = {}  # id(func) -> _Info; the entry holds func, so its id is not reused


def _info(func) -> _Info:
    info = _INFO.get(id(func))
    if info is None:
        info = _INFO[id(func)] = _Info(func)
    return info


def _draws_own_rng(info, args, kwargs):
    """True when an op with an RNG state of its own (_OWN_RNG_STATE) applies dropout in this call."""
    values = [kwargs.get(name) if (kwarg_only or i >= len(args)) else args[i]
              for (i, kwarg_only), name in zip(info.own_rng, _OWN_RNG_STATE)]
    dropout, train, state = values
    return bool(train) and isinstance(dropout, (int, float)) and dropout > 0 and isinstance(state, torch.Tensor)


def _written(info, args, kwargs):
    """The tensors an op writes, from its schema."""
    out = []
    for i, name, kwarg_only in info.writes:
        v = kwargs.get(name) if (kwarg_only or i >= len(args)) else args[i]
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


class _Record:
    """One recorded forward op."""
    __slots__ = ("index", "func", "spec", "leaves", "writes", "made", "rng", "grad", "valid", "why", "uninit",
                 "__weakref__")

    def __init__(self, index, func):
        self.index = index      # position in the step's log
        self.func = func
        self.spec = None        # _flatten_call's spec of (args, kwargs)
        self.leaves = []        # non-tensors as they are; tensors as (_SYM, key, geometry, writers) / (_EXT, t, version) /
                                #   (_SCRATCH, copy written by the replay) / (_SNAP, storage bytes, geometry)
        self.writes = set()     # storage keys this op writes (outputs it made and inputs written in place)
        self.made = []          # storage keys of new outputs, in output order
        self.rng = None         # (device or generator, state) before a random op
        self.grad = True        # grad mode it ran under (kernels may read it: mkldnn_rnn_layer's workspace)
        self.valid = True
        self.why = ""
        self.uninit = False     # an uninitialised factory (Note [Memory filled outside the dispatcher])


def _geometry(t):
    """How to see t again on its storage: dtype, size, stride, offset, and its conjugate and negative bits
    (a lazy conj()/neg view reads its storage through them: Note [Unpack-time recompute])."""
    return (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.is_conj(), t.is_neg())


def _with_bits(t, geometry):
    if geometry[5]:
        t = torch._neg_view(t)
    return t.conj() if geometry[4] else t


def _on_bytes(flat, geometry):
    dtype, size, stride, offset = geometry[:4]
    return _with_bits(torch.empty(0, dtype=dtype, device=flat.device).set_(flat.untyped_storage(), offset, size,
                                                                            stride), geometry)


def _byte_span(ts):
    """(lo, hi): the bytes of their common storage that the tensors `ts` read, lo aligned to each one's
    element size (else 0); None when there is nothing to read."""
    lo = hi = None
    for t in ts:
        if t.numel() == 0:
            continue
        itemsize = t.element_size()
        start = t.storage_offset() * itemsize
        end = start + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * itemsize
        lo = start if lo is None else min(lo, start)
        hi = end if hi is None else max(hi, end)
    if lo is None:
        return None
    if any((t.storage_offset() * t.element_size() - lo) % t.element_size() for t in ts if t.numel()):
        lo = 0
    return lo, hi


def _flatten_call(args, kwargs):
    """(leaves, spec) of an aten call's (args, kwargs), as tree_flatten gives them, at a fraction of its
    cost per op (Note [Unpack-time recompute]: this runs for every recorded op of a forward). An aten
    argument is a leaf or a list/tuple of leaves (Tensor[], Tensor?[], int[]); anything deeper takes
    pytree."""
    leaves = []
    shape = []
    for a in args:
        s = _shape_of(a, leaves)
        if s is False:
            return tree_flatten((args, kwargs))
        shape.append(s)
    kw = []
    for name, a in kwargs.items():
        s = _shape_of(a, leaves)
        if s is False:
            return tree_flatten((args, kwargs))
        kw.append((name, s))
    return leaves, (tuple(shape), tuple(kw))


def _shape_of(value, leaves):
    """Appends an argument's leaves to `leaves`; its shape: None (a leaf), (list or tuple, length), or
    False (nested: _flatten_call takes pytree)."""
    t = type(value)
    if t is list or t is tuple:
        for x in value:
            if type(x) in (list, tuple, dict):
                return False
        leaves.extend(value)
        return t, len(value)
    if t is dict:
        return False
    leaves.append(value)
    return None


def _unflatten_call(leaves, spec):
    """(args, kwargs) back from _flatten_call's leaves and spec."""
    if type(spec) is not tuple:
        return tree_unflatten(leaves, spec)
    shape, kw = spec
    values = []
    i = 0
    for s in shape + tuple(s for _, s in kw):
        if s is None:
            values.append(leaves[i])
            i += 1
        else:
            t, n = s
            values.append(t(leaves[i:i + n]))
            i += n
    return values[:len(shape)], {name: v for (name, _), v in zip(kw, values[len(shape):])}


def _output_tensors(out):
    """The tensors of an aten op's result: a tensor, or a tuple/list of tensors and tensor lists."""
    if isinstance(out, torch.Tensor):
        return [out]
    if type(out) is tuple or type(out) is list:
        found = []
        for o in out:
            if isinstance(o, torch.Tensor):
                found.append(o)
            elif type(o) is tuple or type(o) is list:
                found.extend(_output_tensors(o))
        return found
    return [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]


def _on(storage_of, key, geometry):
    dtype, size, stride, offset = geometry[:4]
    base = storage_of[key]
    return _with_bits(torch.empty(0, dtype=dtype, device=base.device).set_(base.untyped_storage(), offset, size,
                                                                            stride), geometry)


class Recipe:
    """One recomputed activation: from its first save until the op that saved it has run, the
    tensor itself (`held`); then either the recorded ops that recreate it (`records`), or, when it
    cannot be recreated exactly, still `held` (kept, with `why`)."""
    __slots__ = ("records", "key", "geometry", "value", "packs", "unpacks", "label", "nbytes", "ordinal", "writers",
                 "version", "shared", "indices", "held", "marker", "final", "why", "stream",
                 "__weakref__")

    def __init__(self, key, t, ordinal, shared, marker):
        self.records = ()
        self.indices = frozenset()
        self.held = t.detach()  # shares storage and version counter, not grad_fn (no reference cycle)
        self.marker = marker    # the op counter at the save: built once that op has run
        self.final = False
        self.why = ""
        self.key = key
        self.geometry = _geometry(t)
        self.value = None       # the replayed storage (a tensor on it), between replay and last unpack
        self.stream = None      # CUDA: the stream `value` was made on (See Note [Replayed values and streams])
        self.packs = 0
        self.unpacks = 0
        self.label = ""
        self.nbytes = t.untyped_storage().nbytes()
        self.ordinal = ordinal
        self.writers = None     # recorded writes of its storage when its slice was taken (_build)
        self.version = t._version
        self.shared = shared          # the plan recreates it inside another activation's replay

    def externals(self):
        for r in self.records:
            for leaf in r.leaves:
                if type(leaf) is tuple and leaf[0] == _EXT:
                    yield leaf[1], leaf[2]

    def replay(self):
        """Run the recorded ops; returns storage key -> replayed tensor (a tensor on each new storage)."""
        for t, version in self.externals():
            if t._version != version:
                if t.is_leaf and t.requires_grad:  # a parameter edited under no_grad (weight clipping, EMA)
                    what = (f"a parameter of shape {list(t.shape)}, read by the forward to make it, was modified in "
                            f"place before backward")
                    fix = ("Change parameters after backward (in the optimizer step, or between run.step() and the "
                           "next forward)")
                else:
                    what = "an input of it was modified in place after the forward read it"
                    fix = "Write the next batch into a new tensor rather than into the one this step's forward read"
                raise MemschedError(
                    f"memsched: recomputed activation {self.label or self.ordinal}: {what} (version {version} -> "
                    f"{t._version}), so it cannot be recomputed exactly (plain PyTorch, which keeps the activation, "
                    f"need not read it again). {fix}, or plan without recompute: planner='dp' (with a "
                    f"host_memory_limit that holds its offloads: below that, memsched runs a plan that recomputes)")
        storage_of = {}
        grad = torch.is_grad_enabled()
        # At the level the forward's dispatch mode saw: below autograd and ADInplaceOrView, so
        # nothing is recorded or saved, in the grad mode of the forward (Note [Unpack-time recompute]).
        try:
            with torch._C._AutoDispatchBelowADInplaceOrView(), _autocast_off():
                for r in self.records:
                    torch._C._set_grad_enabled(r.grad)
                    self._run(r, storage_of)
        finally:
            torch._C._set_grad_enabled(grad)
        return storage_of

    @staticmethod
    def _run(r, storage_of):
        leaves = []
        for leaf in r.leaves:
            if type(leaf) is tuple:
                kind = leaf[0]
                leaf = (_on(storage_of, leaf[1], leaf[2]) if kind == _SYM else
                        leaf[1] if kind == _EXT else leaf[1].clone() if kind == _SCRATCH else
                        _on_bytes(leaf[1], leaf[2]))
            leaves.append(leaf)
        args, kwargs = _unflatten_call(leaves, r.spec)
        out = r.func(*args, **kwargs) if r.rng is None else _with_rng(r.rng, r.func, args, kwargs)
        given = {_key(x) for x in leaves if isinstance(x, torch.Tensor)}
        new = [o for o in _output_tensors(out) if _key(o) not in given]
        for key, o in zip(r.made, new):
            storage_of[key] = o

    def view_on(self, storage_of):
        return _on(storage_of, self.key, self.geometry)

    def set_value(self, storage_of):
        """Keep the replayed storage until the last unpack (and the stream it was made on)."""
        self.value = _on(storage_of, self.key, self.geometry)
        self.stream = torch.cuda.current_stream(self.value.device) if self.value.is_cuda else None

    def take_value(self):
        """The kept replayed storage, ordered for use on the current stream.

        Note [Replayed values and streams]
          The autograd engine runs each backward node on the stream its forward op ran on, and the
          replay runs on the stream of the node whose unpack started it. A value kept for a later
          unpack (a shared replay, a second save of the storage, a replay before an in-place write
          in the forward) may be read by a node on another stream -- a forward that used side
          streams: that stream waits for the replay's, and the caching allocator is told the block
          is used there (record_stream), so it is not reused before those kernels ran. On one stream
          this is a comparison and nothing else."""
        value = self.value
        if self.stream is not None:
            current = torch.cuda.current_stream(value.device)
            if current != self.stream:
                current.wait_stream(self.stream)
                value.record_stream(current)
        return value

    def set_records(self, records):
        self.records = records
        self.indices = frozenset(r.index for r in records)
        self.held = None
        self.final = True

    def keep(self, why):
        self.why = why
        self.final = True


class _autocast_off:
    """Recorded ops are below autocast (their casts were recorded): replay them as they are."""

    def __enter__(self):
        self.states = [(d, torch.is_autocast_enabled(d)) for d in ("cpu", "cuda")]
        self.ctx = [torch.autocast(d, enabled=False) for d, on in self.states if on]
        for c in self.ctx:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctx):
            c.__exit__(*exc)
        return False


def _rng_source(args, kwargs, leaves):
    """The generator an op would draw from: its Generator argument, else its device's default one.
    (native_dropout and the attention kernels' dropout take none and use the default.)"""
    gen = kwargs.get("generator")
    if gen is None:
        gen = next((x for x in args if isinstance(x, torch.Generator)), None)
    if gen is not None:
        return gen
    device = kwargs.get("device")
    if device is None:
        device = next((x.device for x in leaves if isinstance(x, torch.Tensor)), "cpu")
    return torch.device(device)


def _rng_state(where):
    if isinstance(where, torch.Generator):
        return where.get_state()
    if where.type == "cuda":
        return torch.cuda.get_rng_state(where)  # seed and offset, kept on the host: no sync
    return torch.get_rng_state()


def _with_rng(rng, func, args, kwargs):
    where, state = rng
    if isinstance(where, torch.Generator):
        before = where.get_state()
        where.set_state(state)
        try:
            return func(*args, **kwargs)
        finally:
            where.set_state(before)
    if where.type == "cuda":
        before = torch.cuda.get_rng_state(where)
        torch.cuda.set_rng_state(state, where)
        try:
            return func(*args, **kwargs)
        finally:
            torch.cuda.set_rng_state(before, where)
    before = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        return func(*args, **kwargs)
    finally:
        torch.set_rng_state(before)


@dataclass
class RecomputeStats:
    recomputed: int = 0          # activations released after the forward and recreated
    recomputed_bytes: int = 0
    replays: int = 0             # recipes run (shared replays recreate several activations in one)
    replay_s: float = 0.0        # host time spent replaying (CUDA: launch time, not kernel time)
    kept_instead: int = 0        # planned recomputes that kept their tensor (Note [Unpack-time recompute])
    kept_reasons: Dict[str, int] = None

    def keep(self, why):
        self.kept_instead += 1
        if self.kept_reasons is None:
            self.kept_reasons = {}
        self.kept_reasons[why] = self.kept_reasons.get(why, 0) + 1


class ForwardOpLog:
    """The recording state of one step (Note [Unpack-time recompute])."""

    def __init__(self, record_ops: Set[int], shared: Set[int], stats: RecomputeStats, earlier=(),
                 parameter_keys=frozenset()):
        self.record_ops = record_ops  # trace op ids to record
        self.parameter_keys = parameter_keys  # storage keys of the model's parameters (Note [A replay that
                                              # reads a parameter without its gradient])
        self.shared = shared          # ordinals the plan recreates inside another's replay
        self.stats = stats
        self.earlier = list(earlier)  # the step's earlier forwards' logs: their readers see this one's writes
        self.op = 0                   # trace id of the next counted op
        self.paused = 0               # > 0 while the executor's own hooks issue ops
        self.log: List[_Record] = []
        self.live: Dict[int, tuple] = {}  # storage key -> (StorageWeakRef, [record indices writing it])
        self.tainted: Set[int] = set()    # keys written by ops not recorded
        self.watch: Dict[int, list] = {}  # external storage key -> [weakref(Recipe)] pending
        self.readers: Dict[int, list] = {}  # external storage key -> [weakref(_Record)] reading it (Note [What
                                            # holds a replay's inputs])
        self.pending: Dict[int, Recipe] = {}  # ordinal -> recipe not yet unpacked (for shared replays)
        self.shared_pending: Dict[int, List[Recipe]] = {}  # storage key -> pending recipes with `shared` set
        self.unfinished: List[Recipe] = []    # saved, but the op that saved them may still write them
        self.ran = None  # (op counter, autograd sequence peek) when the last recorded op returned
        self.built: Dict[int, list] = {}  # storage key -> [weakref(Recipe)] built on it, this forward
        self.mode: Optional[_LogMode] = None
        self.inputs: List[torch.Tensor] = []  # the forward's tensor arguments (push)

    # -- the dispatch mode ---------------------------------------------------------------------------
    def push(self, first_op, inputs=()):
        """Record from trace op `first_op`; inputs: the forward's tensor arguments (Note [Unpack-time
        recompute]: small ones a recorded op read are copied at the forward's end)."""
        self.op = first_op
        self.inputs = [x for x in inputs if isinstance(x, torch.Tensor)]
        self.mode = _LogMode(self)
        self.mode.__enter__()

    def pop(self):
        """Leave the mode (the end of a forward, or an abandoned step); the log is dropped."""
        for x in self.inputs:
            # the caller may refill its batch buffer before backward (plain PyTorch need not read it again)
            key = _key(x)
            if key in self.readers and x.numel() * x.element_size() <= kScratchBytes:
                self._snapshot_for_readers(key, x)  # (the bytes its readers read, checked again there)
        self.inputs = []
        self.finish(None)
        mode, self.mode = self.mode, None
        if mode is not None:
            try:
                mode.__exit__(None, None, None)
            except Exception:
                pass  # not on top any more (a caller's mode entered inside forward and left open)
        self.log = []
        self.live = {}
        self.tainted = set()
        self.built = {}
        # (watch and readers stay for the step: a later forward's in-place write of an input read here --
        # nn.Embedding(max_norm=...) renormalises its weight at every forward -- is seen by its log,
        # which snapshots for them through `earlier`; found by fuzzing)

    def _before_write(self, key, x):
        """External storage `key` is about to be written in this forward: every recorded reader of it, in
        this forward or an earlier one of the step, replays from the bytes it read."""
        self._snapshot_for_readers(key, x)
        for log in self.earlier:
            if key in log.readers:
                log._snapshot_for_readers(key, x)

    def dispatch(self, func, args, kwargs):
        info = _INFO.get(id(func)) or _info(func)
        if info.passthrough or self.paused:
            return func(*args, **kwargs)
        j = self.op
        self.op = j + 1
        if (j in self.record_ops or (info.writes and self._writes_live(info, args, kwargs))) \
                and not torch.is_inference_mode_enabled():  # nothing saved there; its tensors have no versions
            out = self._record(func, info, args, kwargs)
        else:
            if info.writes:
                self._foreign_write(info, args, kwargs)
            out = func(*args, **kwargs)
        if self.unfinished and j >= self.unfinished[0].marker:
            self.finish(j + 1)  # See Note [A recipe built when its saving op has run]
        return out

    def _writes_live(self, info, args, kwargs):
        """True when the op writes a storage a recorded op made: it is recorded too (rrelu_with_noise
        fills the noise that empty_like made; the chain names in-place writers by their name only)."""
        for t in _written(info, args, kwargs):
            entry = self.live.get(_key(t))
            if entry is not None and not entry[0].expired():
                return True
        return False

    def _record(self, func, info, args, kwargs):
        r = _Record(len(self.log), func)
        r.uninit = info.uninit
        leaves, r.spec = _flatten_call(args, kwargs)
        written = {id(t) for t in _written(info, args, kwargs)} if info.writes else ()
        inputs = set()  # storage keys of every tensor argument: an output on one of them is not new
        for x in leaves:
            if not isinstance(x, torch.Tensor):
                r.leaves.append(x)
                continue
            key = _key(x)
            inputs.add(key)
            entry = self.live.get(key) if key is not None else None
            if entry is not None and not entry[0].expired():
                r.leaves.append((_SYM, key, _geometry(x), entry[1]))  # entry[1]: its writers so far and later
                if id(x) in written:
                    r.writes.add(key)
                    if key in self.tainted:
                        r.valid, r.why = False, "tainted"
            elif x.is_inference():
                # made under torch.inference_mode(): no version counter, so a later change (inside
                # inference mode) could not be told (Note [Unpack-time recompute])
                r.valid, r.why = False, "reads an inference tensor"
                r.leaves.append((_EXT, x, None))
            elif id(x) in written:
                self._before_write(key, x)  # earlier recorded readers saw it before this write
                if x.untyped_storage().nbytes() > kScratchBytes:
                    r.valid, r.why = False, "writes an input in place"
                    r.leaves.append((_EXT, x, x._version))
                else:
                    r.leaves.append((_SCRATCH, x.detach().clone()))
            else:
                r.leaves.append((_EXT, x, x._version))
                self.readers.setdefault(key, []).append(weakref.ref(r))
        if info.rng:  # the generator's state before a random op, restored around its replay
            where = _rng_source(args, kwargs, leaves)
            r.rng = (where, _rng_state(where))
        if info.own_rng is not None and _draws_own_rng(info, args, kwargs):
            r.valid, r.why = False, "dropout from an RNG state of its own (cuDNN RNN)"
        r.grad = torch.is_grad_enabled()
        out = func(*args, **kwargs)
        self.ran = (self.op, autograd_sequence_peek())  # See Note [A recipe built when its saving op has run]
        for o in _output_tensors(out):
            key = _key(o)
            if key is None or key in inputs:
                continue  # an in-place op's result (its write is above) or a view of an input
            st = o.untyped_storage()
            self.live[key] = (StorageWeakRef(st), [r.index])
            self.tainted.discard(key)
            r.made.append(key)
            r.writes.add(key)
        for key in r.writes:
            if key not in r.made:
                self.live[key][1].append(r.index)
        self.log.append(r)
        if self.built and written:
            for x in leaves:
                if isinstance(x, torch.Tensor) and id(x) in written:
                    key = _key(x)
                    if key in self.built:
                        self._rewritten(key, x, r.index)
        return out

    def _snapshot_for_readers(self, key, x):
        """External storage `key` is about to be written (or may be, after the forward): recorded ops that
        read it replay from a copy of the bytes they read, taken now (up to kScratchBytes), or cannot be
        replayed."""
        readers = [r for r in (ref() for ref in self.readers.pop(key, ())) if r is not None]
        if not readers:
            return
        leaves = [(r, i, leaf) for r in readers for i, leaf in enumerate(r.leaves)
                  if type(leaf) is tuple and leaf[0] == _EXT and _key(leaf[1]) == key]
        span = _byte_span([leaf[1] for _, _, leaf in leaves])
        flat = None
        if span is not None and span[1] - span[0] <= kScratchBytes:
            st = x.untyped_storage()
            whole = torch.empty(0, dtype=torch.uint8, device=x.device).set_(st, 0, (st.nbytes(),), (1,))
            flat = whole[span[0]:span[1]].clone()  # the bytes read, not the whole storage (a view of a staging buffer)
        copied = True
        for r, i, leaf in leaves:
            if flat is None or leaf[1]._version != leaf[2]:
                r.valid, r.why = False, "an input modified in place"
                copied = False
            else:
                g = _geometry(leaf[1])
                itemsize = leaf[1].element_size()
                offset = (g[3] * itemsize - span[0]) // itemsize if leaf[1].numel() else 0
                r.leaves[i] = (_SNAP, flat, g[:3] + (offset,) + g[4:])
        refs = self.watch.pop(key, None)
        if copied or not refs:
            return
        # Recipes already built on a reader that has no copy: replay them now, before the write.
        for ref in refs:
            recipe = ref()
            if recipe is not None and recipe.held is None and recipe.value is None and recipe.unpacks == 0:
                self.materialize(recipe)

    def _foreign_write(self, info, args, kwargs):
        for t in _written(info, args, kwargs):
            key = _key(t)
            if key is None:
                continue
            if key in self.live:
                self.tainted.add(key)
                if key in self.built:
                    self._written_unrecorded(key, t)
            self._before_write(key, t)

    # -- packing and replay ----------------------------------------------------------------------------
    def begin(self, t, ordinal):
        """The first save of a recomputed activation: a Recipe holding `t` until the op that saved it
        has run (it may still write it: rrelu_with_noise saves its noise before filling it), or a
        reason to keep it (str)."""
        key = _key(t)
        entry = self.live.get(key) if key is not None else None
        if entry is None or entry[0].expired():
            return "not made by a recorded op"
        recipe = Recipe(key, t, ordinal, ordinal in self.shared, self.op)
        if self.ran == (self.op, autograd_sequence_peek()):
            self._finish_one(recipe)  # an output save: its op has run (Note [A recipe built when ...])
        else:
            self.unfinished.append(recipe)
        return recipe

    def finish(self, before_op):
        """Build the recipes of the saves made before op `before_op` (None: all of them)."""
        keep = []
        for recipe in self.unfinished:
            if before_op is not None and recipe.marker >= before_op:
                keep.append(recipe)
                continue
            self._finish_one(recipe)
        self.unfinished = keep

    def _finish_one(self, recipe):
        why = self._build(recipe)
        if why:
            recipe.keep(why)
            self.stats.keep(why)
        else:
            self.stats.recomputed += 1
            self.stats.recomputed_bytes += recipe.nbytes

    def serves_a_later_save(self, recipe):
        """Whether a later save of recipe's storage may share its slice: no op wrote that storage since the
        slice was taken. A save through another unsafe view (unsafe_chunk: each piece has a version counter
        of its own, ATen's GRU cell) can come after a write the slice does not hold, at an equal version."""
        if recipe.writers is None:
            return True  # not taken yet: it will be, with every write until then (the saving op still runs)
        entry = self.live.get(recipe.key)
        return entry is not None and len(entry[1]) == recipe.writers and recipe.key not in self.tainted

    def _build(self, recipe):
        """Give `recipe` the slice of recorded ops that writes its storage; a reason if it cannot."""
        if recipe.held._version != recipe.version:
            return "modified in place"  # unpack raises, as PyTorch does
        why, records = self._slice(recipe)
        if why:
            return why
        recipe.set_records(records)
        self._adopt(recipe)
        self.pending[recipe.ordinal] = recipe
        if recipe.shared:
            self.shared_pending.setdefault(recipe.key, []).append(recipe)
        self.built.setdefault(recipe.key, []).append(weakref.ref(recipe))
        return ""

    def _adopt(self, recipe):
        """Watch the outside inputs of recipe's (new) slice, and note how many writes of its storage it holds."""
        recipe.writers = len(self.live[recipe.key][1])
        ref = weakref.ref(recipe)
        for x, _ in recipe.externals():
            k = _key(x)
            if k is not None:
                self.watch.setdefault(k, []).append(ref)

    def _rewritten(self, key, x, index):
        """Recorded op `index` wrote storage `key` (through x) after recipes of it were built: through another
        version counter (`y.data.mul_`), which no version check sees. A saved tensor in plain PyTorch sees
        the write, so each such recipe takes its slice again, with the write, or keeps the storage (See
        Note [A recipe built when its saving op has run])."""
        for ref in self.built.get(key, ()):
            recipe = ref()
            if recipe is None or recipe.held is not None or recipe.unpacks or index in recipe.indices:
                continue
            if recipe.value is not None:
                # replayed already (before an in-place write of one of its inputs): its value lacks this write
                self._keep_storage(recipe, x, "written in place after its replay in the forward")
                continue
            why, records = self._slice(recipe)
            if not why:
                recipe.set_records(records)
                self._adopt(recipe)
                continue
            self._keep_storage(recipe, x, why)

    def _written_unrecorded(self, key, x):
        """An op the log does not record (under torch.inference_mode()) writes storage `key` (through x) after
        recipes of it were built: each keeps the storage, as plain PyTorch's saved tensor sees the write."""
        for ref in self.built.get(key, ()):
            recipe = ref()
            if recipe is not None and recipe.held is None and not recipe.unpacks:
                self._keep_storage(recipe, x, "tainted")

    def _keep_storage(self, recipe, x, why):
        """A built recipe keeps its storage after all, through x (any tensor on it: unpack views it with the
        save's geometry), and is counted as kept instead of recomputed."""
        recipe.held = x.detach()
        recipe.value = recipe.stream = None
        recipe.keep(why)
        self.stats.recomputed -= 1
        self.stats.recomputed_bytes -= recipe.nbytes
        self.stats.keep(why)
        if self.pending.pop(recipe.ordinal, None) is recipe and recipe.shared:
            self.shared_pending[recipe.key].remove(recipe)

    def _slice(self, recipe):
        """(reason, records): the recorded ops that write recipe's storage and what they read, in log order;
        a reason why they cannot recreate it exactly instead."""
        # Note [A slice from its storages' writers]: each storage a recorded op read was written, before
        # that op, by the records of its writer list (the _SYM leaf holds that list; a key names one
        # storage while `live` holds its weak reference), so the slice is found from the recipe's
        # storage back through those lists -- work in the slice's size, not the log's (a scan of the
        # whole log per recipe was quadratic in the forward's length).
        needed = {recipe.key}
        chosen = {}
        work = [(self.live[recipe.key][1], len(self.log))]
        made_empty = []  # writer lists of storages an uninitialised factory made
        while work:
            writers, before = work.pop()
            if self.log[writers[0]].uninit:
                made_empty.append(writers)
            for i in writers:
                if i >= before:
                    break  # written after the reader read it (lists are in op order)
                if i in chosen:
                    continue
                r = self.log[i]
                if not r.valid:
                    return r.why, None
                chosen[i] = r
                for leaf in r.leaves:
                    if type(leaf) is tuple and leaf[0] == _SYM:
                        needed.add(leaf[1])
                        work.append((leaf[3], i))
        if not chosen:
            return "not made by a recorded op", None
        for writers in made_empty:  # See Note [Memory filled outside the dispatcher] (csrc/core/recompute.cpp)
            if not any(i in chosen for i in writers[1:]):
                return "made by an empty tensor op and filled outside the dispatcher (an extension's kernel, numpy)", None
        if not needed.isdisjoint(self.tainted):
            return "tainted", None
        if self.parameter_keys:
            for r in chosen.values():
                for leaf in r.leaves:
                    if type(leaf) is tuple and leaf[0] == _EXT and not leaf[1].requires_grad \
                            and _key(leaf[1]) in self.parameter_keys:
                        return "reads a parameter through an alias without gradient", None  # See Note [A replay that ...]
        return "", [chosen[i] for i in sorted(chosen)]

    # Note [A replay that reads a parameter without its gradient]
    #   Rationale: a recorded op that reads a parameter through an alias carrying no gradient
    #   (`w.detach()`, `w.data`, a view of one) sends w no gradient, so w's gradient can be final, and w
    #   updated in place inside backward -- by the fused update (fuse_optimizer=True) or by the caller's
    #   own optimizer in a register_post_accumulate_grad_hook -- before a consumer's backward unpacks the
    #   recomputed activation: the replay read the updated weight. Through .detach() the version check
    #   raised mid-backward, after the fused update had stepped part of the model (and named a batch
    #   buffer as the cause); through .data it silently recomputed other values (3.6e-2 off plain after 5
    #   steps). Plain PyTorch keeps the activation and never reads w again (found by a helper probing
    #   recompute). The fused runtime's holds (Note [A parameter read after its gradient is final] in
    #   ooo/backward.py) see saves, not replays, and cannot see the caller's hook.
    #   Approach: such a save keeps its tensor, as any save the log cannot recreate exactly; run.report()
    #   counts it with this reason. A read with gradient needs nothing: the reading op's backward comes
    #   after every replay of what it made, so the parameter is not final before then.
    def materialize(self, recipe):
        """Replay `recipe` now and keep its value (and those of the shared replays it recreates)."""
        t0 = time.perf_counter()
        storage_of = recipe.replay()
        self.stats.replays += 1
        self.stats.replay_s += time.perf_counter() - t0
        recipe.set_value(storage_of)
        taken = [recipe]
        for key in storage_of:  # the pending shared recipes this replay recreates (not every pending one)
            for other in self.shared_pending.get(key, ()):
                if other is not recipe and other.value is None and other.indices <= recipe.indices:
                    other.set_value(storage_of)
                    taken.append(other)
        for r in taken:  # their saves hold them from here (Note [What holds a replay's inputs])
            if self.pending.pop(r.ordinal, None) is r and r.shared:
                self.shared_pending[r.key].remove(r)


class _LogMode(TorchDispatchMode):
    """Counts and records a forward's aten ops for ForwardOpLog.

    WARNING: __torch_dispatch__ is assigned after the class body, as for the profiler's
    RecordingMode: TorchDispatchMode.__init_subclass__ would wrap it in torch._disable_dynamo,
    which costs more per op than a small CPU op."""

    def __init__(self, log):
        super().__init__()
        self.log = log


def _log_dispatch(self, func, types, args=(), kwargs=None):
    return self.log.dispatch(func, args, kwargs or {})


_LogMode.__torch_dispatch__ = _log_dispatch


class RecomputedView:
    """A save of a recomputed activation: unpack() replays (or takes the shared replay's value) and
    returns the saved view. Saves of one storage share its Recipe; each has its own geometry (an
    attention saves q as [B, T, D] in one op and as [B*H, T, d] in the next) and its own version
    counter (Note [Version counter of a saved tensor] in saved_tensors.py)."""
    __slots__ = ("recipe", "log", "owner", "geometry", "counter", "version")

    def __init__(self, recipe, log, owner, t):
        self.recipe = recipe
        self.log = weakref.ref(log) if log is not None else (lambda: None)
        self.owner = owner
        self.geometry = _geometry(t)
        self.counter = version_alias(t)  # the saved tensor's version counter, not its storage
        self.version = t._version

    def unpack(self):
        # inside a forward (torch.autograd.grad there), the ops issued here are not the model's
        log = self.owner.oplog_
        if log is None:
            return self._unpack()
        log.paused += 1
        try:
            return self._unpack()
        finally:
            log.paused -= 1

    def _unpack(self):
        r = self.recipe
        self.owner.path.observe(r.ordinal)
        if self.counter._version != self.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: saved activation {r.label or r.ordinal} is at version {self.counter._version}; "
                f"expected version {self.version} instead (memsched recomputes it)")
        if r.held is not None:
            # kept (Note [Unpack-time recompute]), or a step abandoned before its recipe was built
            return on_counter(self.counter, r.held, self.geometry[1:4])
        if r.value is None:
            log = self.log()
            if log is not None and r.ordinal in log.pending:
                log.materialize(r)
            else:
                t0 = time.perf_counter()
                storage_of = r.replay()
                r.set_value(storage_of)
                self.owner.recompute_stats.replays += 1
                self.owner.recompute_stats.replay_s += time.perf_counter() - t0
        out = r.take_value()
        r.unpacks += 1
        if r.unpacks % r.packs == 0:
            r.value = None  # every save has been used once; another backward replays again
        # a fresh tensor object (the caller may keep it) on the saved tensor's version counter
        return on_counter(self.counter, out, self.geometry[1:4])  # (the counter alias keeps t's conj/neg bits)
