"""offloaded_saves.py -- profile a step that does not fit: its saved activations live on the host.

Entry point: OffloadedSaves(device, host_buffers, min_bytes) handed to
ProfilerSession(..., offload=saves) (memsched.optimize(..., profile="offload")). The session then
records through OffloadingRecorder, whose pack/unpack hooks keep the device copy of a saved
activation only while someone besides autograd uses it. saves.stats (ProfiledStepStats) is what
the step measured.

Note [Profiling with saved activations offloaded]
  Rationale: memsched.optimize profiles the user's first step and plans from the next one; a
  profile that keeps every activation on the device needs plain PyTorch's memory, so memsched
  could only train a batch whose plain step already fits. The profiled step must offload, yet its
  Trace must describe the step as plain PyTorch runs it -- the same ops, activations, sizes,
  producers, uses and frees as a keep-all profile -- or the plan would be made for another step.
  torch.autograd.graph.save_on_cpu gives up the device storage at the save and fetches a new one
  in backward, so the recorder would see the storage die early (a free), a new storage in
  backward (a temporary), and its copies as ops.
  Approach: keep the storage object, drop only its memory.
  - pack: the recorder numbers and marks the save exactly as in a keep-all profile
    (Recorder.note_save); the packed object (_Save) holds the storage's Python object (so the
    StorageImpl, whose address is the trace's key, lives exactly as long as under keep-all, where
    the packed KeptSave holds it) plus the view geometry, and a detached alias for the version
    check.
  - release: after every recorded op (inside the dispatch mode, so nothing here is recorded) the
    pending storages are polled. When the only references left are ours -- the StorageImpl's use
    count is 1 (its Python object) plus our aliases -- nothing else can read or write it any more:
    each alias gives way to a storage-free one on the same version counter (an in-place change
    after the save raises at unpack, as plain PyTorch does; Note [Version counter of a saved
    tensor] in saved_tensors.py), the whole storage is copied to a host block and `storage.resize_(0)` gives the
    memory back. The copies run through a CopyEngine on the compute stream (as save_on_cpu's):
    on CUDA the freed block returns to the caching allocator at once and is reused in stream
    order, after the copy, so the profiled step holds no memory for copies in flight and needs
    no event polling; prefetch on side streams is for the planned steps. Copying at release rather than at the save takes
    the bytes backward would have read: later in-place writes that bump no version (rrelu's noise,
    unsafe_chunk gates of ATen's GRU/LSTM cells, `.data`) are in the copy, so gradients stay
    bitwise plain's.
  - unpack: a released storage is grown back (`resize_(nbytes)`, on the compute stream) and filled
    from its host block (the compute stream waits for the copy); the saved view is rebuilt on it
    with its dtype, size, stride and offset, and the saved tensor's version counter. It is the same StorageImpl, so backward ops read the
    trace's key, and it dies when the last packed object and unpacked tensor die -- when it would
    under keep-all. Grown back, it stays on the device until then.
  - Nothing done here goes through the profiler's dispatch mode: polls run inside
    __torch_dispatch__ (the mode is off there) and unpack under torch._C._DisableTorchDispatch.
  Kept on the device (a KeptSave, as in a keep-all profile): parameters and buffers, saves made
  during backward, tensors on another device, below min_bytes, not strided, conjugate/negative
  views, subclasses, storages that cannot be resized (from_numpy, DLPack), and what would take
  host_memory_limit past its limit (counted in host_limited).
  Memory: `stats.activation_peak_bytes` counts saved-activation storages holding device memory,
  from their first pack until released, and again from a fetch until they die -- what the
  executor measures on CPU for an executed step ("saved-activation storages alive"). On CUDA
  Run reads torch.cuda.max_memory_allocated for the profiled step too.
  Kept saves go through the keep-all path (Recorder.keep), so Note [Held outside the graph] tracks
  them as in a keep-all profile; a storage saved on the host is checked by the same rule at the
  same moments (OffloadingRecorder._check_slots), so held_until_op is the keep-all profile's too.
  The one Trace field that differs from a keep-all profile is ops' duration_us (timing noise; no
  copy is inside an op's timing, but on CUDA the copies share the compute stream between ops).
  Checked for MLP, CNN, transformers (with dropout) and LSTM/GRU in
  tests/python/test_profiler_offloaded_saves.py.
  Limitations: a storage is released one recorded op after its last other user lets go (the op
  running holds its inputs); one alive past the step (the caller's batch, a kept output) is never
  released; copies are on demand (no prefetch), so the profiled step is slower than a planned one.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from memsched import _C
from memsched.profiler.recorder import Recorder
from memsched.saved_tensors import storage_free

_use_count = torch._C._storage_Use_Count
_no_dispatch = torch._C._DisableTorchDispatch
_graph_task_id = torch._C._current_graph_task_id
_kept_pack = _C.kept_pack
_kept_unpack = _C.kept_unpack

# _Slot.state
_RESIDENT = 0   # on the device, others may still use it: polled
_RELEASED = 2   # memory given back; the host block has the bytes
_FETCHED = 3    # grown back in backward (or never released): stays until it dies
_STAYS = 4      # the host limit was reached at release: stays on the device


@dataclass
class ProfiledStepStats:
    """How the profiled step treated its saved activations, and what it measured."""
    mode: str = "keep"               # "offload" or "keep" (every saved activation on the device)
    activation_peak_bytes: Optional[int] = None  # most bytes of saved-activation storages on the device
    peak_bytes: Optional[int] = None  # CUDA: torch.cuda.max_memory_allocated over the step
    offloaded: int = 0               # COUNT storages released to host memory
    offloaded_bytes: int = 0         # SUM their bytes
    fetched: int = 0                 # COUNT storages grown back in backward
    kept: int = 0                    # COUNT saved storages never offloaded (see the Note)
    host_limited: int = 0            # COUNT of those kept because host_memory_limit was reached
    d2h_bytes: int = 0               # SUM
    h2d_bytes: int = 0               # SUM


class _Slot:
    """One saved storage the step may offload."""

    __slots__ = ("storage", "key", "nbytes", "state", "d2h", "saves", "__weakref__")

    def __init__(self, storage, key, nbytes):
        self.storage = storage   # its Python UntypedStorage (keeps the StorageImpl, not the memory)
        self.key = key           # StorageImpl address: the trace's key
        self.nbytes = nbytes
        self.state = _RESIDENT
        self.d2h = None          # CopyTicket of the host copy (dst: the host block)
        self.saves = []          # weakref.ref(_Save) of its packed objects


class _Save:
    """What autograd stores for an offloaded save. Holds no tensor with a grad_fn (See Note
    [Packing without reference cycles] in offload/executor.py)."""

    __slots__ = ("slot", "alias", "counter", "version", "dtype", "size", "stride", "offset", "owner",
                 "__weakref__")

    def __init__(self, slot, t, owner):
        self.slot = slot
        self.alias = t.detach()     # shares the version counter; dropped at release
        self.counter = None         # from release on: the version counter without the storage
        self.version = t._version
        self.dtype = t.dtype
        self.size = tuple(t.size())
        self.stride = tuple(t.stride())
        self.offset = t.storage_offset()
        self.owner = owner          # the OffloadedSaves (a retained graph may unpack after the step)

    def settle(self):
        """Release time: keep the version counter, drop the alias and with it the storage (Note [Version
        counter of a saved tensor] in saved_tensors.py)."""
        a, self.alias = self.alias, None
        if a is not None:
            # our alias itself: here, inside the profiler's dispatch mode, detach() would make a new counter
            self.counter = storage_free(a)


def _modified(save, version):
    return RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"a saved tensor of shape {list(save.size)} is at version {version}; expected version {save.version} "
        "instead. (memsched checks this itself because saved-tensor hooks turn PyTorch's own check off; "
        "plain PyTorch raises the same error.)")


class OffloadedSaves:
    """The profiled step's saved activations, on the host while only autograd holds them."""

    def __init__(self, device, host_buffers, min_bytes=0):
        from memsched import _C
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # t.device is 'cuda:N' and torch.device('cuda:0') != torch.device('cuda') (Run._check_device)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.host = host_buffers
        self.min_bytes = int(min_bytes)
        self.on_new_slot = None  # callback(slot) at a storage's first save (OffloadingRecorder)
        # The Run's host pool and its limit (checked per save by the engine, as the executor's is).
        self.engine = _C.CopyEngine(self.device, host_buffers.pool)
        host_buffers.attach(self.engine)
        self.engine.on_compute_stream = True  # See the Note: blocks are freed in stream order
        self.begin_step()

    def begin_step(self):
        self.stats = ProfiledStepStats(mode="offload", activation_peak_bytes=0)
        self.slots_ = {}        # storage key -> weakref.ref(_Slot)
        self.kept_ = set()      # storage keys saved and kept on the device
        self.pending_ = []      # weakref.ref(_Slot) in state _RESIDENT, in save order
        self.resident_ = {}     # storage key -> bytes on the device (the measurement)
        self.current_ = 0       # SUM of resident_
        self.full_ = {}         # storage key -> its bytes at its first save, while it lives
        self.full_sum_ = 0      # SUM of full_
        self.deaths_ = {}       # storage key -> weakref whose callback ends its residence

    def released_bytes(self):
        """Bytes of saved storages alive but not on the device now: what a keep-all trace counts that
        this step does not hold (Note [Memory the trace does not model] in unmodeled.py)."""
        return self.full_sum_ - self.current_

    def end_step(self):
        """The step's figures (no wait: copies in flight keep what they read)."""
        log = self.engine.end_step()
        self.stats.d2h_bytes, self.stats.h2d_bytes = log.d2h_bytes, log.h2d_bytes
        self.pending_ = []
        return self.stats

    def release_done(self):
        """Drop what completed copies hold (CUDA: host blocks of fetches still in flight at the step's
        end); never waits."""
        if self.engine.pending_count():
            self.engine.poll()

    def finish(self):
        """Wait for every copy and release what they hold (the Run ended)."""
        self.engine.release()  # synchronises: the copies run on the compute stream

    # -- the measurement -------------------------------------------------------------------------
    def _account(self, key, storage, first=False):
        """Saved storage `key` holds storage.nbytes() of device memory now (read from the storage
        itself, so a release that freed nothing is not counted as one)."""
        nbytes = storage.nbytes()
        self.current_ += nbytes - self.resident_.get(key, 0)
        self.resident_[key] = nbytes
        if self.current_ > self.stats.activation_peak_bytes:
            self.stats.activation_peak_bytes = self.current_
        if first and key not in self.deaths_:
            resident, deaths, full = self.resident_, self.deaths_, self.full_
            full[key] = nbytes
            self.full_sum_ += nbytes

            def died(ref, key=key):
                if deaths.get(key) is ref:  # the address may be reused at once: forget the key
                    del deaths[key]
                    self.kept_.discard(key)
                    self.current_ -= resident.pop(key, 0)
                    self.full_sum_ -= full.pop(key, 0)

            self.deaths_[key] = weakref.ref(storage, died)

    # -- pack --------------------------------------------------------------------------------------
    def pack(self, t):
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None  # no storage: nothing to offload
        key = storage._cdata
        ref = self.slots_.get(key)
        slot = ref() if ref is not None else None
        if slot is None:
            if key in self.kept_:
                return None
            nbytes = storage.nbytes()
            if key not in self.resident_:
                self._account(key, storage, first=True)
            if not self._offloadable(t, storage, nbytes):
                self.kept_.add(key)
                self.stats.kept += 1
                return None
            slot = _Slot(storage, key, nbytes)
            self.slots_[key] = weakref.ref(slot)
            self.pending_.append(weakref.ref(slot))
            if self.on_new_slot is not None:
                self.on_new_slot(slot)
        elif slot.state == _STAYS:
            return None
        save = _Save(slot, t, self)
        slot.saves.append(weakref.ref(save))
        return save

    def _offloadable(self, t, storage, nbytes):
        if not (nbytes >= self.min_bytes and nbytes > 0 and t.device == self.device
                and t.layout == torch.strided and type(t) is torch.Tensor
                and not t.is_conj() and not t.is_neg() and not t.is_quantized and storage.resizable()):
            return False
        if not self.engine.has_room(nbytes):
            self.stats.host_limited += 1  # See Note [Host memory limit] (offload/host_buffers.py)
            return False
        return True

    # -- release (after every recorded op) ---------------------------------------------------------
    def poll(self):
        """Copy and release every pending storage that only our packed objects still reference."""
        if self.engine.pending_count():
            self.engine.poll()
        left = []
        with _no_dispatch():
            for ref in self.pending_:
                slot = ref()
                if slot is None:
                    continue  # every save of it died (a graph dropped in forward)
                if not self._release(slot) and slot.state == _RESIDENT:
                    left.append(ref)
        self.pending_ = left

    def _release(self, slot):
        """Copy `slot` to the host and give its memory back if nothing but our aliases references
        it; True when released."""
        saves = [s for s in (r() for r in slot.saves) if s is not None]
        aliases = sum(1 for s in saves if s.alias is not None)
        if _use_count(slot.key) != 1 + aliases:
            return False  # still used by the forward (or held by the caller)
        if not self.engine.has_room(slot.nbytes):
            slot.state = _STAYS  # See Note [Host memory limit] (offload/host_buffers.py)
            self.stats.kept += 1
            self.stats.host_limited += 1
            return False
        for s in saves:
            s.settle()
        flat = torch.empty(0, dtype=torch.uint8, device=self.device).set_(slot.storage, 0, (slot.nbytes,), (1,))
        slot.d2h = self.engine.offload_many([flat], hold=False)[0]
        del flat
        if _use_count(slot.key) != 1:  # WARNING: never free what another holder may read (cannot happen)
            slot.state = _STAYS
            self.stats.kept += 1
            return False
        slot.storage.resize_(0)
        slot.state = _RELEASED
        self._account(slot.key, slot.storage)
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += slot.nbytes
        return True

    # -- unpack ------------------------------------------------------------------------------------
    def unpack(self, save):
        slot = save.slot
        alias = save.alias
        if alias is not None:
            # Never released: the storage is on the device; PyTorch's version check, as kept_unpack.
            if alias._version != save.version:
                raise _modified(save, alias._version)
            return alias
        counter = save.counter
        if counter is not None and counter._version != save.version:
            raise _modified(save, counter._version)
        with _no_dispatch():
            if slot.state == _RELEASED:
                slot.storage.resize_(slot.nbytes)  # allocated on the compute stream
                flat = torch.empty(0, dtype=torch.uint8, device=self.device).set_(
                    slot.storage, 0, (slot.nbytes,), (1,))
                ticket = self.engine.fetch_into(flat, slot.d2h.dst, after=slot.d2h)
                self.engine.wait(ticket)
                slot.d2h = None  # the engine holds the host block until the copy is done
                self.stats.fetched += 1
                self._account(slot.key, slot.storage)
            slot.state = _FETCHED
            if counter is None:  # (cannot happen: a save is settled when its storage is released)
                return torch.empty(0, dtype=save.dtype, device=self.device).set_(
                    slot.storage, save.offset, save.size, save.stride)
            # on the saved tensor's version counter: a change made through it in backward is seen by
            # the other saves of this tensor, as in plain PyTorch
            out = counter.detach()
            with torch._C._AutoDispatchBelowADInplaceOrView():
                out.set_(slot.storage, save.offset, save.size, save.stride)
            return out


class OffloadingRecorder(Recorder):
    """The profiler's Recorder with Note [Profiling with saved activations offloaded]."""

    def __init__(self, *args, saves: OffloadedSaves, **kwargs):
        super().__init__(*args, **kwargs)
        self.saves = saves
        saves.on_new_slot = self._track_slot
        self.held_slots_ = []  # weakref.ref(_Slot) checked before each forward op (Note [Held outside the graph])
        self.off_device = saves.released_bytes  # Note [Memory the trace does not model]

    def _track_slot(self, slot):
        self.held_slots_.append(weakref.ref(slot))

    def _check_slots(self, backward):
        """Note [Held outside the graph] for saves on the host, with the keep-all check's timing and
        rule (Recorder._check_held): before each forward op, every tracked storage is stamped held
        until the last op begun, and leaves the set once nothing but its saves references it; once,
        after the first backward op, what is still held is stamped and the set is emptied. So
        held_until_op is the keep-all profile's."""
        watch, tensor_held, left = self._watch, self.builder.tensor_held, []
        for ref in self.held_slots_:
            slot = ref()
            if slot is None or slot.key not in watch:
                continue
            aliases = sum(1 for s in (r() for r in slot.saves) if s is not None and s.alias is not None)
            still = _use_count(slot.key) != 1 + aliases
            if still or not backward:
                tensor_held(slot.key)
            if still and not backward:
                left.append(ref)
        self.held_slots_ = left

    def pack(self, t):
        if _graph_task_id() != -1:
            return Recorder.pack(self, t)  # a save made during backward: kept, as a keep-all profile
        act = self.note_save(t)
        if act is None:
            return _kept_pack(t)  # a parameter or buffer
        packed = self.saves.pack(t)
        return packed if packed is not None else self.keep(t, act)  # kept on the device, as keep-all

    def unpack(self, packed):
        if type(packed) is _Save:
            return packed.owner.unpack(packed)
        return _kept_unpack(packed)

    def on_op(self, func, info, args, kwargs):
        if self.held_slots_ and not self.in_optimizer and _graph_task_id() == -1:
            self._check_slots(False)  # before a forward op, as Recorder.on_op checks kept saves
        out = Recorder.on_op(self, func, info, args, kwargs)
        if self.held_slots_ and _graph_task_id() != -1:
            self._check_slots(True)  # after the first backward op
        if self.saves.pending_:
            self.saves.poll()
        return out
