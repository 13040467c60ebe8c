"""The plan-driven offload executor: saved-tensor hooks that move planned activations to host and back.

Entry point: OffloadExecutor(model, device, host_buffers). install() once;
then per step: set_schedule(schedule) (None: run plainly), the model's forward
runs with the hooks, backward unpacks, end_step() -> StepStats. remove()
restores everything.

Note [Executor hooks and their lifetime]
  Rationale: the user drives the loop, so the executor cannot wrap "the step";
  it must attach to the model and be removable without a trace.
  Approach: the first forward of a step (a forward pre-hook on the root module)
  pushes the saved-tensor hooks (torch._C._autograd._push_saved_tensors_default_hooks);
  end_step() (run.step()) pops them. So the hooks cover what the profiler
  covered -- forward, the loss, backward (a reentrant checkpoint's recompute) --
  and ordinals match the trace's. Labels carry no module path in executed
  steps, so no hook runs per submodule (docs/CONVENTIONS-activation-identity.md).
  An exception inside forward (seen by an always-called forward hook: output
  None) abandons the step: later packs pass through untouched and the next
  forward pops our pair and starts a fresh step. Always-called hooks do not
  run on KeyboardInterrupt; the next forward notices (`in_forward_` still set)
  and restarts; remove() pops our pair after checking it is on top.
  Unpack hooks are stored per saved tensor at pack time, so backward works
  whether or not our pair is still pushed. A forward that raises pops our
  pair at once and drops the step; what a step that raised later leaves is
  owned by its graph (See Note [A step that raises] in optimize.py).

Note [A step whose backward raised]
  Rationale: a backward pass that raised in a planned step (an out-of-memory error, a Function's
  backward), caught by the loop, left the step open: the loop's next forward counted as that step's
  second, saved activations the trace does not have, and ran plainly as a mismatch ("3 planned, 1
  plain", found by a helper injecting failures mid-step) -- after a backward out of memory, the retry
  ran without offloading.
  Approach: the first unpack of a backward pass (SavedTensorPath::unpack, C++) marks it open and
  queues an engine callback that closes it; the engine runs that callback only when the pass
  completes. A forward outside the engine that finds a pass still open abandons the step, as after a
  forward that raised, and starts a fresh one with the plan. A pass that completed (gradient
  accumulation's next micro-batch) leaves the step as it is.
  Limitations: a pass that raised before its first unpack of a save of this step's hooks is not seen
  (the next forward then continues the step, and mismatches). One C++ callback per backward pass.

Note [A plan with nothing to do]
  Rationale: budget=None on a step that fits the device keeps every activation: its plan moves
  nothing, yet the executor's hooks ran at every save and unpack (numbering, the identity check,
  the version check, CPU's memory count). On a host-bound model that cost 1.14x plain, 6.7 us per
  saved tensor (a small decoder on one CPU thread, benchmarks/python/bench_offload_overhead.py),
  and PyTorch's saved-tensor hook mechanism alone, with identity hooks, costs 3 us of it: no
  hook-based path gets a keep-all step to plain's speed.
  Approach: a plan that offloads and recomputes nothing and holds no budget (budget=None, keep all
  because the profiled step fits) is run without saved-tensor hooks (`hookless`, set by the Run per
  plan): autograd saves as in plain PyTorch, with its own version check. The root module's forward
  hooks still open and close the step; its times are measured, and on an accelerator its peak (the
  allocator's host-side counter). A step that saves other tensors than the trace needs no
  fallback, as there is nothing to undo; the one change that alters budget=None's plan -- a step
  that no longer fits the device -- is seen in the measured peak (Note [Budgets] in optimize.py).
  Limitations: such steps count no activations (StepStats.hooked False): on CPU run.report() shows
  no measured saved-activation peak. A byte budget, a fraction or a percentage keeps the hooks even
  when its plan keeps everything: a step that grows must be seen to be re-planned within it.
  timeline=True keeps them too (its per-tensor samples come from the hooks).

Note [Foreign saved-tensor hooks]
  Rationale: our pair is pushed at a step's first forward and popped at
  run.step(), which is not nested inside a caller's context: with
  `with save_on_cpu(): out = model(x)` (or checkpoint(model, x)) the caller's
  exit would pop OUR pair and leave theirs on the stack for good (and a
  non-reentrant checkpoint's backward then fails); under
  disable_saved_tensors_hooks the push itself raises.
  Approach: when a step's first forward starts while any saved-tensor hooks
  are active (or hooks are disabled), the step runs plainly -- the caller's
  hooks do what they would do without memsched -- marked "diverged" with the
  reason, so the Run warns and re-profiles a later step. The other way round
  -- the caller enters hooks after our push and run.step() runs inside them --
  our pair cannot be popped from under theirs: it is marked buried, passes
  every pack through untouched (no step is active), and is popped as soon as
  it is on top again (the next forward, or remove()).

Note [What is never offloaded]
  - parameters and buffers of the model (ActivationNumbering gives them no
    ordinal; they are returned as they are);
  - storages smaller than `min_bytes`, storages on another device, non-strided
    or conjugate/negative-bit tensors, tensor subclasses;
  - tensors whose (ordinal, label) does not equal the trace's: from the first
    mismatch on, the step runs plainly (See Note [Activation identity]);
  - a save of a fetched copy during backward (a reentrant checkpoint saving
    what it unpacked): it counts as a re-pack of the original's ordinal, as in
    the profiled step, and stays on the device;
  - a second save of an offloaded storage after it was modified in place
    (different _version): that save keeps the device tensor, since the host
    copy holds the older values.
  A second save of an offloaded storage through a tensor with another version
  counter (unsafe_chunk/unsafe_split outputs, as in ATen's GRU and LSTM cells:
  `a, b = gates.unsafe_chunk(2, 1); a.sigmoid_(); b.sigmoid_()`) gets a host
  copy of its own, taken at that save: the first copy may predate an in-place
  change made through the other counter, and equal version numbers on two
  counters prove nothing (See Note [Version counter identity] in
  csrc/torch/tensor_adapter.h). Each counter's copy is reused only by saves
  through that counter at the version it was copied at.
  Every offload is an exact byte copy of the whole storage; unpack rebuilds the
  view (dtype, size, stride, storage offset) on the fetched storage. Values are
  therefore bitwise those PyTorch would have used -- a wrong plan costs time or
  memory, never a wrong gradient.

Note [Version checks]
  With saved-tensor hooks installed PyTorch no longer checks that a saved
  tensor was not modified in place before backward used it (try
  save_on_cpu with y = x.sigmoid(); y.mul_(2)): a buggy step would silently
  get a wrong gradient. The executor restores the check: kept tensors and
  parameters are packed with their _version and compared at unpack (the
  detached alias shares the version counter). An offloaded save holds the
  saved tensor's version counter itself (not its storage) and compares it at
  unpack, so a change made through any alias is seen, as plain PyTorch sees it
  (Note [Offloaded saves in C++] in csrc/torch/saved_tensor_offload.cpp).
  Limitation: a change that bumps no version (`h.data.mul_(2)`, a tensor
  aliasing the storage via set_) after the save is seen by plain PyTorch's
  backward but not by an offloaded copy taken at pack time (as with
  torch.autograd.graph.save_on_cpu): the gradient then uses the values at the
  save. PyTorch documents such changes as untracked by autograd.
  Unpacked tensors share the saved tensor's counter, as SavedVariable::unpack
  makes them in plain PyTorch, so a backward that writes one in place (a custom
  Function's backward changing its saved input) is seen by the other saves of
  that tensor: offloaded saves of executed steps set it in C++, recomputed saves
  and the profiled step's offloaded saves through Note [Version counter of a
  saved tensor] in saved_tensors.py.

Note [Copy after the op]
  Rationale: autograd saves an op's inputs before its kernel runs, and some
  kernels then write a saved input without bumping its version:
  rrelu_with_noise saves `noise` (fresh from empty_like) and fills it
  afterwards. A copy taken at pack time holds the bytes from before the kernel
  (torch.autograd.graph.save_on_cpu has the same defect). On CUDA the D2H
  stream would wait on an event recorded before the kernel was even launched.
  Approach: a pack only queues its D2H copy; the queue is issued at the first
  pack of a later op -- the thread's autograd sequence number
  (_C.autograd_sequence_peek) changes when an op records its Node, before its
  saves, and not between the saves of one op -- and at the end of the forward,
  at the first unpack and at the end of the step. By then every kernel of the
  op has run (CPU) or been launched on the compute stream (CUDA).
  Limitations: a storage waits on the device for one more op than planned.

Note [No host synchronisation in a step]
  Rationale: a host that waits for the GPU at every step (torch.cuda.synchronize to read a
  clock, or to release the copies' holds) cannot queue the next step's kernels while the GPU
  runs this one; on a host-bound model that idles the GPU between steps.
  Approach: nothing in a step or in run.step() waits for the GPU. end_step() issues what is
  queued and leaves the copies in flight holding what they read (_C.CopyEngine.end_step(); the
  holds are polled at later hook calls and steps). The step's duration, stall and copy times
  are CUDA events (the engine's StepCopyLog), read when first asked for (StepStats.resolve(); Run resolves the previous
  step's stats once its events have completed, without waiting). The peak is the allocator's
  host-side counter, final when the step's work is enqueued.
  Limitations: reading a step's duration_s right after run.step() waits for that step (with
  timeline=True, for its copies too: they run on the copy streams, which the end mark does not wait for).

Note [Packing without reference cycles]
  A pack hook that returns the tensor it was given (or a tuple holding it)
  leaks when the tensor is the node's own output: tensor -> grad_fn -> saved
  variable -> packed object -> tensor. Kept activations are therefore packed
  as (ordinal, tensor.detach()), which shares storage and version counter but
  not grad_fn -- what PyTorch itself stores for outputs.
"""
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_leaves

from memsched import _C, allocator
from memsched.copy_inert import inert_on_copy
from memsched.offload.peak_gap import PhasePeaks
from memsched.offload.recompute import ForwardOpLog, RecomputedView, RecomputeStats
from memsched.offload.recompute import _key as _recompute_key
from memsched.profiler.unmodeled import DeviceCounters
from memsched.saved_tensors import storage_key
from memsched.user_frame import user_stacklevel  # See Note [Warnings point at the caller's code]


@dataclass
class StepStats:
    """What one step did, measured.

    On CUDA, duration_s, stall_s and copies come from CUDA events that are read when first asked
    for (See Note [No host synchronisation in a step]); every other figure is final at once.
    """
    mode: str = "plain"            # "plain" (no schedule), "planned", "diverged"
    duration_s_: float = 0.0       # see duration_s
    activations: int = 0           # COUNT of activation storages packed
    activation_bytes: int = 0      # SUM of their storage bytes
    offloaded: int = 0             # COUNT of storages copied to host
    offloaded_bytes: int = 0       # SUM
    d2h_bytes: int = 0             # SUM device-to-host bytes moved
    h2d_bytes: int = 0             # SUM host-to-device bytes moved
    prefetched: int = 0            # COUNT fetched ahead of use on the H2D stream
    on_demand: int = 0             # COUNT fetched synchronously at unpack (stalls)
    late_prefetches: int = 0       # COUNT prefetches still in flight when their tensor was needed
    stall_s_: float = 0.0          # see stall_s
    peak_bytes: int = 0            # max sampled memory (see memory_source)
    memory_source: str = ""        # what the samples measure
    mismatch: str = ""             # first identity mismatch, "" if none
    label_mismatch: bool = False   # it was an activation's label (shapes, control flow), not another cause
    hooked: bool = True            # False: a keep-all plan ran without saved-tensor hooks (Note [A plan with
                                   # nothing to do]): activations, activation_bytes and (CPU) peak_bytes not counted
    plan_index: int = 0            # the Run's steps_profiled when it ran: which plan (a re-profile makes a new one)
    budget_bytes: int = None       # the budget that plan was held to (optimizer state included); None: none
    host_limited: int = 0          # COUNT offloads kept on the device: host_memory_limit reached
    guard_waits: int = 0           # COUNT compute-stream waits of the memory guard (Note [Memory guard])
    guard_releases: int = 0        # COUNT D2H copies whose device blocks it released in stream order
    guard_released_bytes: int = 0  # SUM bytes those releases gave back to the allocator
    # Accelerator only (Note [Where the peak went] in offload/peak_gap.py); None / 0 elsewhere:
    phase_peaks: PhasePeaks = None  # the allocator's peak read after each phase of the step
    sampled_peak_bytes: int = 0     # the memory guard's highest reading of the allocated count
    in_flight_at_sampled_peak: int = 0  # device bytes held for D2H copies in flight at that reading
    reserved_peak_bytes: int = 0    # max_memory_reserved over the step (read after the update)
    recomputed: int = 0            # COUNT storages released after the forward and replayed in backward
    recomputed_bytes: int = 0      # SUM
    replays: int = 0               # COUNT recipes run (a shared replay recreates several storages)
    replay_s: float = 0.0          # host seconds spent replaying (CUDA: launches, not kernel time)
    recompute_kept: int = 0        # COUNT planned recomputes kept on the device (Note [Unpack-time recompute])
    recompute_kept_reasons: dict = field(default_factory=dict)
    samples: list = field(default_factory=list)  # [(t_s, bytes)] memory over the step (timeline=True only)
    copies_: list = field(default_factory=list)  # see copies
    pending_: object = field(default=None, repr=False, compare=False)  # (ready, resolve) of CUDA events
    clock_: object = field(default=None, repr=False, compare=False)    # (t0_s, _C.StepCopyLog)

    def resolve(self):
        """Read the step's CUDA timing events (waits for them if the GPU has not reached them)."""
        if self.pending_ is not None:
            _, resolve = self.pending_
            self.pending_ = None
            resolve(self)
        return self

    @property
    def ready(self):
        """Whether the step's figures can be read without waiting (its CUDA events have completed)."""
        return self.pending_ is None or self.pending_[0]()

    def try_resolve(self):
        """resolve() if the step's events have completed; never waits."""
        if self.pending_ is not None and self.ready:
            self.resolve()

    @property
    def duration_s(self):
        """Seconds from the first forward to the end of run.step() (CUDA: between events on the
        compute stream)."""
        return self.resolve().duration_s_

    @property
    def stall_s(self):
        """Seconds the compute stream waited for H2D copies (CPU: on-demand copy time)."""
        return self.resolve().stall_s_

    @property
    def copies(self):
        """[(kind, start_s, end_s, bytes)] of the copy streams (timeline=True only)."""
        return self.resolve().copies_


def _is_memsched_pack(fn):
    """Whether a saved-tensor pack hook is memsched's: an executor's C function or a profiler's."""
    owner = getattr(fn, "__self__", None)
    return (getattr(fn, "__name__", "") == "memsched_pack"
            or type(owner).__module__ == "memsched.profiler.recorder")


def foreign_hooks_reason(check_dispatch_modes=False):
    """Why memsched must not instrument a forward starting now (None: it may).

    See Note [Foreign saved-tensor hooks]. check_dispatch_modes: also refuse under an active
    TorchDispatchMode (the profiler enters one from the first forward to run.step()).
    """
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        return "saved-tensor hooks are disabled around the forward (torch.autograd.graph.disable_saved_tensors_hooks)"
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is not None:
        if _is_memsched_pack(top[0]):
            return ("another memsched Run's step is open around this forward (its model's forward ran and its "
                    "run.step() has not yet): one Run's hooks cover its step from the first forward to "
                    "run.step(), so a second model's Run cannot start its own step inside; call the first "
                    "Run's run.step() before this model's forward, or put both models under one Run (one "
                    "nn.Module holding both)")
        return ("the caller's own saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks, save_on_cpu, "
                "a non-reentrant checkpoint) are active around the forward")
    if check_dispatch_modes and torch._C._len_torch_dispatch_stack() > 0:
        return "a TorchDispatchMode of the caller (or another memsched Run's profiler) is active around the forward"
    return None


class OffloadExecutor:
    """Saved-tensor hooks executing an OffloadSchedule. See the Notes above."""

    def __init__(self, model, device, host_buffers, min_bytes=0, on_mismatch=None, timeline=False):
        self.model = model
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # tensors report 'cuda:N': the hooks compare devices exactly (Run._check_device)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeline = bool(timeline)           # keep per-tensor memory samples and the copy log per step
        self.min_bytes = int(min_bytes)          # size floor for offload, bytes
        self.is_cuda = self.device.type == "cuda"
        # the allocator's peak after each phase (Note [Where the peak went]); None where unreadable
        self.meter = DeviceCounters.for_device(self.device) if self.is_cuda else None
        self.host = host_buffers
        # See Note [Offload copy ordering] (csrc/torch/copy_engine.h): copies, their events and holds.
        self.engine = _C.CopyEngine(self.device, host_buffers.pool, timeline=self.timeline)
        host_buffers.attach(self.engine)
        self.on_mismatch = on_mismatch           # callback(str) on the first mismatch of a step
        # See Note [The saved-tensor fast path] (csrc/torch/saved_tensor_path.h): the hooks are C++;
        # they call back into this object (held weakly) only for the slow path.
        self.path = _C.SavedTensorPath(str(self.device), self)
        self.path.timeline = self.timeline
        self.path.set_copy_engine(self.engine)  # the hooks poll copies in C++
        self.pack_fn_ = self.path.pack_function()
        self.unpack_fn_ = self.path.unpack_function()
        self.schedule = None                     # OffloadSchedule for the next step; None: plain
        self.active = True                       # False: forward runs untouched (e.g. while profiling)
        self.hookless = False                    # the schedule's steps push no saved-tensor hooks (Note [A plan
                                                 # with nothing to do]); set by the Run for each plan
        self.handles_ = []                       # hook handles on the root module
        self.pushed_ = False                     # our saved-tensor hooks are on the hook stack
        self.oplog_ = None                       # the running forward's ForwardOpLog (recompute plans only)
        self.buried_ = False                     # popped by us but under the caller's hooks: pop when on top
        self.in_step__ = False                   # a step has started (first forward seen)
        self.forward_failed__ = False            # the last forward raised: restart numbering
        self.in_forward_ = False                 # between the root's forward pre-hook and forward hook
        self._reset_step()

    # The C++ hooks pack through (act on) a step only while it runs and its forward has not failed.
    @property
    def in_step_(self):
        return self.in_step__

    @in_step_.setter
    def in_step_(self, value):
        self.in_step__ = value
        self.path.step_active = value and not self.forward_failed__

    @property
    def forward_failed_(self):
        return self.forward_failed__

    @forward_failed_.setter
    def forward_failed_(self, value):
        self.forward_failed__ = value
        self.path.step_active = self.in_step__ and not value

    @property
    def diverged_(self):
        return self.path.diverged

    # -- lifetime ---------------------------------------------------------------------------------
    def install(self):
        if self.handles_:
            raise RuntimeError("OffloadExecutor.install(): already installed")
        try:
            self._read_parameters()
            # See Note [Copies of a model under memsched] (copy_inert.py)
            self.handles_.append(self.model.register_forward_pre_hook(inert_on_copy(self._forward_pre),
                                                                      with_kwargs=True))
            self.handles_.append(self.model.register_forward_hook(inert_on_copy(self._forward_post),
                                                                  always_call=True))
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self):
        """Remove every hook, pop our saved-tensor hooks if still pushed, wait for copies."""
        self._pop_hooks()
        # A step still open (its backward may run after the Run ends): its saves need their copies.
        self.path.issue_copies()
        if self.buried_:
            warnings.warn("memsched: the caller's saved-tensor hooks pushed after memsched's are still active "
                          "when the Run ends, so memsched's (now pass-through) pair under them cannot be popped",
                          RuntimeWarning, stacklevel=user_stacklevel())
        for h in self.handles_:
            h.remove()
        self.handles_ = []
        self.engine.release()
        self._reset_step()
        self.in_step_ = False
        self.in_forward_ = False
        self.forward_failed_ = False

    def _read_parameters(self):
        """The model's parameter and buffer storages are never activations (read again whenever a
        schedule is set: a re-profile after a parameter was replaced sees the new one)."""
        self.path.set_parameters(list(self.model.parameters()) + list(self.model.buffers()))

    def set_schedule(self, schedule):
        """Schedule for the steps that follow (None: plain PyTorch with measurement)."""
        self.schedule = schedule
        self._read_parameters()
        if schedule is None:
            self.path.clear_schedule()
        else:
            self.path.set_schedule(schedule.labels, schedule.offload | schedule.recompute, schedule.first_bwd_op,
                                   [q for q, ks in schedule.prefetch_at.items() if ks], schedule.before_step)
            self.path.set_trigger_nodes(schedule.trigger_nodes)
            self.path.set_prefetches({q: ks for q, ks in schedule.prefetch_at.items() if ks})
            self.path.set_recompute(schedule.recompute)
        self.path.min_bytes = self.min_bytes
        self.engine.on_compute_stream = bool(schedule is not None and schedule.copies_on_compute_stream)
        if schedule is None:
            self.set_memory_guard(None)

    def set_memory_guard(self, budget_bytes, headroom=()):
        """Accelerator: keep the allocator's count within budget_bytes by releasing copies in flight
        in stream order (Note [Memory guard] in csrc/torch/saved_tensor_offload.cpp); None: off.
        headroom: offload.guard.guard_headroom(trace). A no-op on CPU, where copies hold nothing."""
        if not self.engine.is_accelerator:
            return
        if budget_bytes is None:
            self.path.clear_memory_guard()
        else:
            self.path.set_memory_guard(int(budget_bytes), list(headroom), allocator.allocated_bytes_fn())

    # -- step bookkeeping -------------------------------------------------------------------------
    def _reset_step(self):
        self.stats = StepStats()
        # The offloaded saves' tables live in self.path (Note [Offloaded saves in C++]).
        self.recipes_ = weakref.WeakValueDictionary()  # recomputed ordinal -> its Recipe
        self.t0_ = time.perf_counter()
        self._stop_recording()
        self.oplogs_ = []           # this step's ForwardOpLogs (Note [Unpack-time recompute]), one per forward
        self.recompute_stats = RecomputeStats()
        # counters, memory samples, the prefetch trigger, the offloaded saves and `diverged` live in self.path
        self.path.begin_step(self.t0_)

    def _begin_step(self):
        self._reset_step()
        self.in_step_ = True
        self.forward_failed_ = False
        self.stats.mode = "planned" if self.schedule is not None else "plain"
        if self.is_cuda:
            allocator.reset_cuda_peak(self.device)
        if self.meter is not None:
            self.stats.phase_peaks = PhasePeaks()
        self.engine.begin_step()  # CUDA: the step's first timing mark on the compute stream
        if self.is_cuda:
            self.stats.memory_source = "torch.cuda.memory_allocated"
        else:
            self.stats.memory_source = "saved-activation storages alive (executor count)"
        self._sample()

    def _begin_hookless_step(self):
        """See Note [A plan with nothing to do]: the step saves as plain PyTorch does; only its peak
        (an accelerator's allocator) and times are measured."""
        self.stats.hooked = False
        if not self.is_cuda:
            self.stats.memory_source = ("not measured: a keep-all plan runs without saved-tensor hooks (Note [A "
                                        "plan with nothing to do])")

    def end_step(self):
        """Finish the step: pop the hooks, issue what is queued and return its StepStats, without
        waiting for the GPU (See Note [No host synchronisation in a step]). The copies still in
        flight keep what they read until they complete."""
        self._pop_hooks()
        stats = self.stats
        if not self.in_step_:
            return None
        self.path.issue_copies()
        log = self.engine.end_step()
        self.path.need_poll = self.engine.pending_count() > 0
        stats.d2h_bytes, stats.h2d_bytes = log.d2h_bytes, log.h2d_bytes
        self._sample()
        stats.activations = self.path.activations
        stats.activation_bytes = self.path.activation_bytes
        c = self.path.offload_counters
        stats.offloaded, stats.offloaded_bytes = c["offloaded"], c["offloaded_bytes"]
        stats.prefetched, stats.on_demand, stats.late_prefetches = c["prefetched"], c["on_demand"], c["late_prefetches"]
        stats.host_limited = c["host_limited"]
        stats.guard_waits, stats.guard_releases = c["guard_waits"], c["guard_releases"]
        stats.guard_released_bytes = c["guard_released_bytes"]
        stats.sampled_peak_bytes, stats.in_flight_at_sampled_peak = c["sampled_peak_bytes"], c["in_flight_at_sampled_peak"]
        if self.path.guard_error:
            warnings.warn(f"memsched: the memory guard is off: the device allocator's count of allocated bytes "
                          f"could not be read ({self.path.guard_error}); the steps may exceed the budget when the "
                          "host runs ahead of the GPU (Note [Memory guard])",
                          RuntimeWarning, stacklevel=user_stacklevel())
            self.path.guard_error = ""
        if not self.engine.is_accelerator:
            stats.stall_s_ = c["stall_s"]
        rs = self.recompute_stats
        stats.recomputed, stats.recomputed_bytes, stats.replays = rs.recomputed, rs.recomputed_bytes, rs.replays
        stats.replay_s, stats.recompute_kept = rs.replay_s, rs.kept_instead
        stats.recompute_kept_reasons = dict(rs.kept_reasons or {})
        self.path.finish_step()  # CPU: See Note [Measured from birth] (saved_tensor_path.cpp)
        stats.peak_bytes = self.path.peak_bytes if stats.hooked else 0
        if self.timeline:
            stats.samples = list(self.path.samples)
        # the allocator's counters are the host's: final once the step's work is enqueued
        if stats.phase_peaks is not None:
            stats.phase_peaks.backward = self.meter.peak()
            stats.peak_bytes = max(stats.peak_bytes, stats.phase_peaks.forward, stats.phase_peaks.backward)
        if self.is_cuda:
            if stats.phase_peaks is None:
                stats.peak_bytes = max(stats.peak_bytes, allocator.cuda_max_memory_allocated(self.device))
        elif self.timeline:
            stats.copies_ = log.host_copies()
        stats.clock_ = (self.t0_, log)
        self.stamp(stats)
        self._reset_step()
        self.in_step_ = False
        return stats

    def measure_update(self, stats):
        """After the optimizer's update of `stats`' step (Note [Where the peak went]): the step's peak
        including the update, and its reserved peak. The peak was not restarted since the step began."""
        if stats is None or stats.phase_peaks is None:
            return
        stats.phase_peaks.update = self.meter.peak()
        stats.peak_bytes = max(stats.peak_bytes, stats.phase_peaks.update)
        stats.reserved_peak_bytes = self.meter.reserved_peak()

    def stamp(self, stats):
        """End `stats`' step now: run.step() stamps again after the optimizer's update."""
        t0, log = stats.clock_
        if not self.engine.is_accelerator:
            stats.duration_s_ = time.perf_counter() - t0
            return
        self.engine.mark_end(log)  # (again) on the compute stream
        timeline = self.timeline

        def resolve(s):
            s.duration_s_, s.stall_s_, copies = log.resolve()
            s.copies_ = copies if timeline else []

        stats.pending_ = (log.ready, resolve)

    @property
    def diverged(self):
        return self.diverged_

    # -- forward hooks on the root module -----------------------------------------------------------
    def _forward_pre(self, module, args, kwargs=None):
        self._reap_buried()
        if self.in_forward_:
            # The previous forward was interrupted by a BaseException (KeyboardInterrupt), which skips
            # always_call hooks: restart.
            self.forward_failed_ = True
        self.in_forward_ = True
        if not self.active:
            return
        if self.in_step_ and (self.forward_failed_ or (self.path.backward_open and torch._C._current_graph_task_id() == -1)):
            self._abandon_step()  # See Note [A step whose backward raised]
        if not self.in_step_:
            self._begin_step()
            if self.hookless and self.schedule is not None:
                self._begin_hookless_step()
                return
            foreign = foreign_hooks_reason()
            if foreign is not None:
                # See Note [Foreign saved-tensor hooks]: run this step plainly, never push ours.
                self._diverge(foreign)
                return
            torch._C._autograd._push_saved_tensors_default_hooks(self.pack_fn_, self.unpack_fn_)
            self.pushed_ = True
        if self.pushed_ and self.schedule is not None and self.schedule.recompute:
            self._start_recording((args, kwargs))

    def _forward_post(self, module, args, output):
        self.in_forward_ = False
        self._stop_recording()
        self.path.issue_copies()
        phases = self.stats.phase_peaks
        if phases is not None and self.in_step_:  # Note [Where the peak went]: no reset, no sync
            phases.forward = max(phases.forward, self.meter.peak())
        if output is not None and self.in_step_ and self.schedule is not None and self.schedule.trigger_nodes:
            # See Note [Backward node triggers] (csrc/torch/saved_tensor_path.cpp)
            roots = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            self.path.hook_nodes(roots)
        if output is None and self.in_step_:
            # always_call hook after an exception (forward returned nothing): abandon the step now,
            # holding nothing of it (See Note [A step that raises]).
            self.forward_failed_ = True
            self._abandon_step()

    def saved_nothing(self):
        """The open step has saved no activation yet (its forwards so far ran under no_grad)."""
        return self.path.activations == 0

    def drop_empty_step(self):
        """End an open step that saved nothing (an evaluation under no_grad began it), so that the Run
        can profile the rest of it (Note [One plan per input shape] in offload/shape_plans.py)."""
        if self.in_step_ and self.saved_nothing():
            self._abandon_step()

    def _abandon_step(self):
        """Drop the running step: pop our hooks, wait for its copies and release what they held.
        What its graph holds (host copies, fetched copies) dies with the graph."""
        self._stop_recording()
        self._pop_hooks()
        self.engine.release()
        self._reset_step()
        self.in_step_ = False

    def _pop_hooks(self):
        if self.pushed_:
            self.pushed_ = False
            self.buried_ = True
        self._reap_buried()

    def _reap_buried(self):
        """Pop our pair once it is on top again. While the caller's hooks sit above it (entered after
        our push, still open at run.step()) it stays buried and packs pass through untouched."""
        if not self.buried_:
            return
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] is self.pack_fn_:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.buried_ = False

    # -- unpack-time recompute (See Note [Unpack-time recompute] in recompute.py) -----------------------
    def _start_recording(self, args=()):
        """Record this forward's chain ops; its first op is the trace's n-th forward start. args: the
        forward's arguments (ForwardOpLog.push)."""
        n = len(self.oplogs_)
        starts = self.schedule.forward_starts
        if torch._C._len_torch_dispatch_stack() > 0:
            return  # under a caller's dispatch mode: not matchable, its recomputes keep their tensors
        if not torch.is_grad_enabled() or n >= len(starts) or self.diverged_:
            # Not one of the plan's forwards (Note [Forwards that save nothing] in recompute.py), or not
            # matchable: it records nothing, but its in-place writes are watched for the earlier forwards'
            # recipes (Note [Writes in a forward that records nothing] in recompute.py)
            if self.oplogs_:
                log = ForwardOpLog(frozenset(), frozenset(), self.recompute_stats, self.oplogs_)
                log.push(0)
                self.oplog_ = log
            return
        if n == 0:  # once per step (p.data = ... between steps gives a parameter another storage)
            # parameters that get a gradient (a frozen one is never updated inside backward)
            self.parameter_keys_ = frozenset(k for k in (_recompute_key(p) for p in self.model.parameters()
                                                         if p.requires_grad) if k is not None)
        log = ForwardOpLog(self.schedule.recompute_ops, self.schedule.shared, self.recompute_stats, self.oplogs_,
                           self.parameter_keys_)
        self.oplogs_.append(log)
        log.push(starts[n], tree_leaves(args))
        self.oplog_ = log

    def _stop_recording(self):
        log, self.oplog_ = getattr(self, "oplog_", None), None
        if log is not None:
            log.pop()

    def _pack_recompute(self, t, k, first):
        """A save of ordinal k, which the plan recomputes: a RecomputedView, or kept (a tuple)."""
        stats = self.recompute_stats
        recipe = self.recipes_.get(k)
        if first:
            log = self.oplog_
            recipe = log.begin(t, k) if log is not None else "forward not recorded"
            if isinstance(recipe, str):
                stats.keep(recipe)
                recipe = None
            else:
                self.recipes_[k] = recipe  # counted as recomputed (or kept) once its op has run
                recipe.label = self.path.label(k)
        elif recipe is not None and (storage_key(t) != recipe.key or t._version != recipe.version
                                     or self.oplog_ is None or not self.oplog_.serves_a_later_save(recipe)):
            recipe = None  # another storage or version at this ordinal, or written since: keep this save
        if recipe is None:
            return (k, t.detach(), t._version)  # See Notes [Packing without reference cycles], [Version checks]
        recipe.packs += 1
        return RecomputedView(recipe, self.oplog_ or (self.oplogs_[-1] if self.oplogs_ else None), self, t)

    # -- the slow path of the C++ hooks (See Note [The saved-tensor fast path]) ----------------------
    def _pack_slow(self, t, k, may_offload, nbytes):
        """A save of ordinal k, which the plan recomputes (offloaded saves never reach Python: Note
        [Offloaded saves in C++]). may_offload: its first pack, matching the trace."""
        log = self.oplog_
        if log is None:
            return self._pack_recompute(t, k, may_offload)
        log.paused += 1  # ops issued here are not the model's (Note [Unpack-time recompute])
        try:
            return self._pack_recompute(t, k, may_offload)
        finally:
            log.paused -= 1

    def _diverge_label(self, k, expected, label):
        # Executed steps label without the module path (docs/CONVENTIONS-activation-identity.md): show
        # both sides in that form, and the trace's module apart, so only the real difference shows.
        def split(text):
            parts = text.split(":", 3) if isinstance(text, str) else []
            return (parts[2], parts[3]) if len(parts) == 4 and parts[0] == "act" else ("", text)

        module, want = split(expected)
        got = split(label)[1]
        where = f" in module '{module}'" if module else ""
        self.stats.label_mismatch = True  # (Note [Nothing to match under budget=None] in optimize.py)
        if expected is None:
            self._diverge(f"activation {k}: the trace has no such activation, this step saves {got}")
        else:
            self._diverge(f"activation {k}{where}: the trace has {want}, this step has {got} (shape:dtype)")

    def _memory_allocated(self):
        return allocator.cuda_memory_allocated(self.device)

    def _diverge(self, why):
        self.path.diverged = True
        self.stats.mode = "diverged"
        self.stats.mismatch = why
        if self.on_mismatch is not None:
            self.on_mismatch(why)
        else:
            warnings.warn(f"memsched: this step does not match the profiled trace ({why}); "
                          "it runs without offloading from there on", RuntimeWarning, stacklevel=user_stacklevel())

    def _sample(self):
        """A memory sample: the timeline's (timeline=True), otherwise only the CPU peak (CUDA reads
        max_memory_allocated at the step's end), so no per-tensor list grows and no allocator query
        runs per saved tensor."""
        self.path.sample()

    def check_invariants(self):
        self.engine.check_invariants()
        self.path.check_offload_invariants()
