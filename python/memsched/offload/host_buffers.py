"""Host memory for offloaded activations: pooled pinned blocks on CUDA, pageable on CPU.

Note [Host memory limit]
  Rationale: page-locked memory is taken from the OS and cannot be swapped; a plan that offloads
  more than the machine can spare fails inside the driver, mid-step, or starves the rest of the
  machine.
  Approach: optimize(host_memory_limit=...) (default half of the RAM) bounds the host copies
  alive at once (the bytes the copies asked for, not the pool's rounded blocks). A plan whose
  offloaded bytes per step exceed it is replaced by the fastest plan for the budget that fits, or
  refused at planning, before any planned step, with a MemschedError naming a limit that works
  (Note [Plans within host_memory_limit] in host_limit.py). At run time an
  offload that would cross the limit (a step saving more than its trace) keeps that tensor on
  the device and is counted (StepStats.host_limited), never a failed allocation.
  The pool caches its segments: pinned memory is allocated once and reused across steps.

Entry point: HostBuffers(pinned, limit_bytes): the executor's host pool (memsched._C.HostTensorPool:
cudaHostAlloc segments on CUDA, which torch sees as pinned; aligned malloc on CPU) and its limit.
The copy engine (_C.CopyEngine, Note [Offload copy ordering] in csrc/torch/copy_engine.h) takes
its blocks from `pool` and checks the limit per offload; this object keeps the policy: the limit,
how to say it, and where the blocks come from for reports.
"""
import os


from memsched import _C
from memsched.units import format_bytes, parse_bytes

DEFAULT_HOST_FRACTION = 0.5  # of the machine's RAM: the default host_memory_limit


def host_ram_bytes():
    """This machine's physical memory, bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_host_limit(value):
    """host_memory_limit -> (bytes, how to say it). None: half of the machine's RAM; a float in
    (0, 1]: that fraction of it; bytes or a string like '32GiB'. See Note [Host memory limit]."""
    forms = ("pass bytes (34359738368), a size ('32GiB') or a fraction of this machine's RAM in (0, 1] "
             "(0.5, the default)")
    if value is None:
        value = DEFAULT_HOST_FRACTION
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"host_memory_limit: a fraction of host RAM must be in (0, 1], got {value!r}; {forms}")
        limit = int(value * host_ram_bytes())
        return limit, f"{value:g} of this machine's {format_bytes(host_ram_bytes())} of RAM"
    try:
        limit = parse_bytes(value, name="host_memory_limit")
    except ValueError as err:
        raise ValueError(f"{err}; or {forms}") from None
    return limit, "host_memory_limit"


class HostBuffers:
    """The host pool of one executor, and its limit."""

    def __init__(self, pinned, limit_bytes=None, limit_text="host_memory_limit"):
        self.pinned = bool(pinned)  # page-locked (needed for asynchronous D2H/H2D copies)
        self.engines_ = []          # copy engines that check the limit per offload (attach())
        self.limit = limit_bytes    # most bytes of host copies alive at once (None: no limit)
        self.limit_text = limit_text
        # The pool caches its segments: pinned memory is allocated once and reused across steps.
        self.pool = _C.HostTensorPool(self.pinned)

    @property
    def limit(self):
        return self.limit_

    @limit.setter
    def limit(self, value):
        self.limit_ = value
        for engine in self.engines_:
            engine.limit_bytes = -1 if value is None else int(value)

    def attach(self, engine):
        """A copy engine taking blocks from `pool` checks this limit (kept in step when it changes)."""
        self.engines_.append(engine)
        engine.limit_bytes = -1 if self.limit_ is None else int(self.limit_)

    @property
    def source(self):
        """Where the buffers come from, for reports."""
        return f"memsched HostTensorPool ({'pinned' if self.pinned else 'pageable'})"

    def live_bytes(self):
        """Bytes of host copies alive now (what they asked the pool for, as the copy engine counts
        against the limit; the pool's blocks are rounded up)."""
        return self.pool.stats().get("requested_bytes.all.current", 0)
