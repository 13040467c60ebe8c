"""Host memory for offloaded activations: pooled pinned blocks on CUDA, pageable on CPU.

Note [Host memory limit]
  Rationale: page-locked memory is taken from the OS and cannot be swapped; a plan that offloads
  more than the machine can spare fails inside the driver, mid-step, or starves the rest of the
  machine.
  Approach: optimize(host_memory_limit=...) (default half of the RAM) bounds the host copies
  alive at once. A plan whose offloaded bytes per step exceed it is refused at planning, before
  any planned step, with a MemschedError naming the limit and how to raise it. At run time an
  offload that would cross the limit (a step saving more than its trace) keeps that tensor on
  the device and is counted (StepStats.host_limited), never a failed allocation.
  The pool caches its segments: pinned memory is allocated once and reused across steps.

Entry point: HostBuffers(pinned).empty(nbytes) -> a flat uint8 CPU tensor. The
allocator issue's memsched._C.HostTensorPool is used when the extension has it
(its blocks go back to the pool when the tensor dies); until then torch's own
host allocator stands in (torch.empty(pin_memory=...), which caches pinned
blocks as well).
"""
import os

import torch

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
    """Source of host staging buffers for one executor."""

    def __init__(self, pinned, limit_bytes=None, limit_text="host_memory_limit"):
        self.pinned = bool(pinned)  # page-locked (needed for asynchronous D2H/H2D copies)
        self.limit = limit_bytes    # most bytes of host copies alive at once (None: no limit)
        self.limit_text = limit_text
        pool_type = getattr(_C, "HostTensorPool", None)
        self.pool = pool_type(self.pinned) if pool_type is not None else None  # None: torch's allocator
        self.bytes_handed_out = 0  # SUM: bytes of every buffer returned by empty()

    @property
    def source(self):
        """Where the buffers come from, for reports."""
        kind = "pinned" if self.pinned else "pageable"
        return f"memsched HostTensorPool ({kind})" if self.pool is not None else f"torch host allocator ({kind})"

    def live_bytes(self):
        """Bytes of host buffers alive now (the pool's rounded blocks)."""
        if self.pool is not None:
            return self.pool.stats().get("allocated_bytes.all.current", 0)
        return 0  # torch's allocator keeps no count we can read cheaply: unlimited

    def has_room(self, nbytes):
        """Whether a buffer of nbytes stays within the limit (Note [Host memory limit])."""
        return self.limit is None or self.live_bytes() + nbytes <= self.limit

    def empty(self, nbytes):
        """An uninitialised flat uint8 host tensor of `nbytes` bytes."""
        self.bytes_handed_out += nbytes
        if self.pool is not None:
            # WARNING: the block returns to the pool when the tensor dies; CopyEngine keeps every host
            # buffer referenced until the copy touching it has finished (Note [Offload copy ordering]).
            return self.pool.empty(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
