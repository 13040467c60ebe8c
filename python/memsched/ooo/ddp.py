"""Bucketed gradient all-reduce for out-of-order backward under
DistributedDataParallel.

Entry point: ``BucketReducer(ddp_model, params)``; ``bucket_of`` feeds the
DwScheduler, ``ready(b)`` launches, ``poll()`` / ``wait_all()`` finish.

Note [DDP and deferred weight gradients]
  Rationale: DDP's Reducer learns that a gradient is ready from a post-hook
  on the parameter's AccumulateGrad node (Reducer::autograd_hook). A deferred
  dW returns None through autograd, so that hook fires with an undefined
  gradient -- the Reducer would reduce zeros -- and the real gradient arrives
  later, outside autograd, where the Reducer never looks.
  Approach: while installed, the DDP module runs as under ``no_sync()``
  (``require_backward_grad_sync = False``: no prepare_for_backward, the
  Reducer's hooks return at once) and memsched does the reduction itself: the
  parameters are cut into buckets like DDP's (reverse registration order,
  DDP's first-bucket cap, then ``ddp.bucket_bytes_cap``); the DwScheduler orders deferred work so the next
  bucket completes first (See Note [dW priority] in csrc/core/dw_scheduler.h);
  a ready bucket is flattened, divided by the world size and all-reduced
  asynchronously on DDP's process group, strictly in bucket order on every
  rank (collectives must match across ranks); results are copied back into
  ``param.grad``. Gradient accumulation: only the last micro-step reduces,
  as DDP does under ``no_sync()`` for the others.
  Unused parameters: a parameter whose ``.grad`` is None on this rank (no pass
  reached it since zero_grad(set_to_none=True)) is reduced as zeros. Plain DDP
  (find_unused_parameters=True) gives it the reduced gradient when any rank used
  it, and leaves it None when none did; so each bucket carries one flag per
  parameter after its gradients (1/world_size where .grad is defined), summed by
  the same all-reduce, and a None ``.grad`` whose flag came back non-zero gets
  the reduced gradient -- every rank then steps it alike, as under plain DDP.
  Only a bucket holding such a parameter reads its flags on the host.
  Limitations: sparse gradients are not used.

Note [DDP features the bucket reduction replaces]
  Rationale: with DDP's own sync off (Note [DDP and deferred weight gradients]), features that act
  through it were lost without a word (found by a helper probing as a new user, gloo, 2 ranks):
  a comm hook (fp16_compress_hook: parameters 1.1e-4 off plain DDP), ddp.no_sync() around a step
  that then updates (local SGD: memsched reduced anyway, 7e-2 off), module buffers broadcast at
  every forward (BatchNorm running statistics drifted apart across ranks, 4.6e-2 off: DDP sets
  require_forward_param_sync only after a forward that syncs); static_graph=True failed inside
  torch's Reducer (an internal assert) and ddp.join() (uneven inputs) let its shadow all-reduces meet
  the buckets' (gloo aborted the process).
  Approach: static_graph and a comm hook are refused at install (a hook registered later, at the next
  forward); `require_backward_grad_sync` is set to SYNC_OFF, a falsy object, so a caller's no_sync()
  -- which sets a real False and puts SYNC_OFF back -- shows at the forward (in_no_sync): a forward of
  the step's last micro-step under it, and a forward under join(), are refused there, before anything
  changes; after each forward, buffers_after_forward sets require_forward_param_sync as DDP's own
  post-forward would have (grad enabled and the caller's no_sync() off -- at every micro-step of an
  accumulation too: it was only the last one's, and BatchNorm statistics on rank 1 were 7e-3 off plain DDP
  for a loop accumulating without no_sync(), found by a helper probing compositions), so DDP broadcasts
  buffers at the next forward as it does without memsched.
  Limitations: a buffer comm hook (register_buffer_comm_hook) is left to DDP's own path. A loop that
  accumulates without no_sync() gets gradients equal to plain DDP's only up to float rounding: plain DDP
  all-reduces the accumulated gradients at every micro-step, memsched once per optimizer step (as plain
  DDP under no_sync()); a warning says so once and names no_sync().

Note [Collectives that gloo's threads release]
  Rationale: a spawned gloo rank aborted now and then at exit ("terminate called without an active
  exception", SIGABRT; about 1 run in 20 of the two-rank test). gloo's worker thread (runLoop)
  destroys a finished collective when it lets go of it. The collective holds `flat`, a tensor made
  in Python, and the thread-local state captured at the launch, which inside loss.backward() holds
  a Python object (torch stashes a contextvars context there: _engine_run_backward). Where Python
  let go first, that destruction takes the GIL from gloo's thread; when it came just as the
  interpreter was finalising (the last bucket, then a short path to exit), taking the GIL ended the
  thread inside a noexcept destructor: std::terminate.
  Approach: the launch runs without torch's stashed context (_without_python_tls: gloo's thread runs
  no Python), and _finish, before the copy-back, waits -- GIL released -- until gloo's thread has
  dropped its reference to `flat` (its use count back to Python's one), so the last reference, and
  with it any Python object, is released here, on the caller's thread. gloo only: NCCL's works are
  released by its watchdog thread, polled far less often than a bucket takes.
  Limitations: the wait is bounded (2 s; gloo drops its reference microseconds after completing, but
  on a loaded machine its thread may not run for a while: the first bound, 0.1 s, can run out under
  CI's load, after which the reducer stops waiting -- a likely, not reproduced, cause of the abort that
  remained, 1 run in ~30); a
  reducer whose `flat` is still held then (by something else than gloo) stops waiting for good.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist


@contextlib.contextmanager
def _without_python_tls():
    """See Note [Collectives that gloo's threads release]: torch's context stash (torch >= 2.12) is out
    of the thread-local state for the block, then put back."""
    has = getattr(torch._C, "_is_key_in_tls", None)
    if has is None or not hasattr(torch._C, "_remove_obj_from_tls") or not has("context"):
        yield
        return
    stashed = torch._C._get_obj_in_tls("context")
    torch._C._remove_obj_from_tls("context")
    try:
        yield
    finally:
        torch._C._stash_obj_in_tls("context", stashed)


class _SyncOff:
    """DDP's require_backward_grad_sync while memsched reduces (See Note [DDP features the bucket reduction
    replaces]): false for DDP, and not the False a caller's no_sync() sets."""

    def __bool__(self):
        return False

    def __repr__(self):
        return "SYNC_OFF"


SYNC_OFF = _SyncOff()


def refuse_unsupported(ddp, at_install: bool = True) -> None:
    """What the bucket reduction cannot stand in for, refused before anything changes (See Note [DDP
    features the bucket reduction replaces]); also at each forward (at_install=False: only what is cheap to
    read, a comm hook registered later through register_comm_hook)."""
    from memsched._C import MemschedError

    if getattr(ddp, "static_graph", False):
        raise MemschedError(
            "DistributedDataParallel(static_graph=True) is not supported by memsched's out-of-order backward: "
            "memsched all-reduces the gradients itself, with DDP's Reducer turned off, which a static graph's "
            "Reducer does not allow. Build the DDP module with static_graph=False, or leave the model out of ooo "
            "(ooo=False, fuse_optimizer=False)")
    hooked = bool(getattr(ddp, "_comm_hooks", None))
    if not hooked and at_install:  # a built-in hook (_register_builtin_comm_hook) shows in the logging data only
        try:
            hooked = bool(ddp._get_ddp_logging_data().get("comm_hook"))
        except Exception:  # noqa: BLE001 -- no logger, an older DDP: only _comm_hooks tells
            pass
    if hooked:
        raise MemschedError(
            "a DDP comm hook (register_comm_hook, e.g. fp16_compress_hook) is not run by memsched's out-of-order "
            "backward: memsched all-reduces each bucket itself, so the hook's compression or averaging would be "
            "skipped (parameters differ from plain DDP). Register no comm hook, or leave the model out of ooo "
            "(ooo=False, fuse_optimizer=False)")


def in_no_sync(ddp) -> bool:
    """Whether the caller's ddp.no_sync() is active (it sets a real False over SYNC_OFF)."""
    return ddp.require_backward_grad_sync is False


def check_forward(ddp, last_micro_step: bool, accumulation: int) -> None:
    """At a forward's start (See Note [DDP features the bucket reduction replaces])."""
    from memsched._C import MemschedError

    refuse_unsupported(ddp, at_install=False)
    join = getattr(ddp, "_join_config", None)
    if join is not None and getattr(join, "enable", False):
        raise MemschedError(
            "DistributedDataParallel.join() (uneven inputs) is not supported by memsched's out-of-order "
            "backward: the join's shadow all-reduces of a rank out of data would meet memsched's bucket "
            "all-reduces of the others (gloo aborts the process). Give every rank the same number of batches "
            "(DistributedSampler(drop_last=True)), or leave the model out of ooo (ooo=False, fuse_optimizer=False)")
    if last_micro_step and in_no_sync(ddp):
        raise MemschedError(
            f"a forward under ddp.no_sync() ends an optimizer step (grad_accumulation_steps={accumulation}, and this "
            "is its last micro-step): plain DDP would skip the gradient all-reduce and step each rank with its own "
            "gradients, where memsched's out-of-order backward reduces every step's gradients itself. If no_sync() "
            "marks gradient accumulation, pass grad_accumulation_steps=<backward passes per optimizer step>; for "
            "local SGD leave the model out of ooo (ooo=False, fuse_optimizer=False)")


def buffers_after_forward(ddp, syncs: bool) -> None:
    """After a forward: what DDP's own post-forward sets when it syncs -- buffers broadcast at the next forward
    after a grad-enabled forward of a step that reduces (See Note [DDP features the bucket reduction
    replaces])."""
    ddp.require_forward_param_sync = bool(syncs and torch.is_grad_enabled())


def _released_by_gloo(flat: torch.Tensor, seconds: float = 2.0) -> bool:
    """See Note [Collectives that gloo's threads release]: whether `flat` came to be referenced by
    the caller alone within `seconds`, sleeping with the GIL released meanwhile."""
    deadline = time.monotonic() + seconds
    spins = 0
    while flat._use_count() > 1:
        if time.monotonic() > deadline:
            return False
        spins += 1
        # yield at first; then sleep, so that a busy machine (CI: two ranks on two cores) runs gloo's thread
        time.sleep(0 if spins < 64 else 2e-4)
    return True


class BucketReducer:
    def __init__(self, ddp_model, params: Sequence[torch.nn.Parameter]):
        self.ddp = ddp_model
        self.group = ddp_model.process_group
        self.world_size = dist.get_world_size(self.group)
        self.params = list(params)
        self._gloo = dist.get_backend(self.group) == "gloo"  # See Note [Collectives that gloo's threads release]
        cap = int(getattr(ddp_model, "bucket_bytes_cap", 25 * 1024 * 1024))
        config = getattr(ddp_model, "_bucket_config", None)  # torch >= 2.12
        if config is not None:
            first_cap = int(config.first_bucket_bytes_cap)
        elif getattr(ddp_model, "bucket_bytes_cap_default", False):
            first_cap = int(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1024 * 1024))
        else:
            first_cap = cap
        self.buckets: List[List[int]] = []
        current: List[int] = []
        current_bytes = 0
        for i in reversed(range(len(self.params))):
            p = self.params[i]
            nbytes = p.numel() * p.element_size()
            limit = first_cap if not self.buckets else cap
            if current and current_bytes + nbytes > limit:
                self.buckets.append(current)
                current, current_bytes = [], 0
            current.append(i)
            current_bytes += nbytes
        if current:
            self.buckets.append(current)
        self.bucket_of: Dict[int, int] = {i: b for b, ids in enumerate(self.buckets) for i in ids}
        self.trace: List[tuple] = []  # (event, bucket, perf_counter seconds)
        self._reset()

    def _reset(self) -> None:
        self._ready = set()
        self._launched = 0  # buckets 0.._launched-1 are launched
        self._works: Dict[int, tuple] = {}  # bucket -> (work, flat)
        self._finished = 0  # buckets 0.._finished-1 are copied back

    def begin_iteration(self) -> None:
        self._reset()
        self.trace = []

    def ready(self, bucket: int) -> None:
        """Bucket ``bucket`` has every gradient final: launch it (and any ready
        buckets after it), in bucket order."""
        self._ready.add(bucket)
        while self._launched in self._ready:
            self._launch(self._launched)
            self._launched += 1

    def _launch(self, b: int) -> None:
        ids = self.buckets[b]
        parts = []
        for i in ids:
            p = self.params[i]
            parts.append(p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype,
                                                                                      device=p.device))
        # one flag per parameter: used (a defined .grad) on some rank (Unused parameters, in the Note).
        # Made on the device by fill kernels: torch.tensor(list, device=cuda) is a blocking
        # host-to-device copy, a host synchronisation with the stream (the side stream's queued dW
        # work) inside the step.
        used = [self.params[i].grad is not None for i in ids]
        kw = dict(dtype=parts[0].dtype, device=parts[0].device)
        if all(used):
            parts.append(torch.ones(len(ids), **kw))
        else:
            parts.extend(torch.ones(1, **kw) if u else torch.zeros(1, **kw) for u in used)
        flat = torch.cat(parts)
        flat.div_(self.world_size)
        self.trace.append(("allreduce_start", b, time.perf_counter()))
        with _without_python_tls():  # See Note [Collectives that gloo's threads release]
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._works[b] = (work, flat)

    def _finish(self, b: int) -> List[int]:
        work, flat = self._works.pop(b)
        work.wait()
        del work  # (flat's one reference left outside Python is then the collective's own)
        if self._gloo and not _released_by_gloo(flat):  # before any view of flat: a view holds flat too
            self._gloo = False  # someone else holds it: waiting again would only cost time
        self.trace.append(("allreduce_done", b, time.perf_counter()))
        ids = self.buckets[b]
        flags = flat[flat.numel() - len(ids):]
        used = None  # read on the host only for a bucket with a parameter this rank did not reach
        offset = 0
        for j, i in enumerate(ids):
            p = self.params[i]
            n = p.numel()
            if p.grad is not None:
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            else:
                if used is None:
                    used = flags.tolist()
                if used[j] > 0:  # another rank used it: plain DDP assigns the reduced gradient
                    p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n
        return ids

    def poll(self) -> List[int]:
        """Copies back the leading buckets whose all-reduce has finished;
        returns their parameter indices (in bucket order)."""
        done: List[int] = []
        while self._finished < self._launched:
            if not self._works[self._finished][0].is_completed():  # (no name left holding the work)
                break
            done += self._finish(self._finished)
            self._finished += 1
        return done

    def wait_all(self) -> List[int]:
        """Launches every bucket not launched yet (in order), waits for all and
        copies back; returns the parameter indices finished here."""
        for b in range(len(self.buckets)):
            self._ready.add(b)
        while self._launched < len(self.buckets):
            self._launch(self._launched)
            self._launched += 1
        done: List[int] = []
        while self._finished < self._launched:
            done += self._finish(self._finished)
            self._finished += 1
        return done

    def first_allreduce_start(self) -> Optional[float]:
        starts = [t for (e, _, t) in self.trace if e == "allreduce_start"]
        return min(starts) if starts else None
