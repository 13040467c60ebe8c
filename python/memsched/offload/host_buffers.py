"""Host memory for offloaded activations: pooled pinned blocks on CUDA, pageable on CPU.

Entry point: HostBuffers(pinned).empty(nbytes) -> a flat uint8 CPU tensor. The
allocator issue's memsched._C.HostTensorPool is used when the extension has it
(its blocks go back to the pool when the tensor dies); until then torch's own
host allocator stands in (torch.empty(pin_memory=...), which caches pinned
blocks as well).
"""
import torch

from memsched import _C


class HostBuffers:
    """Source of host staging buffers for one executor."""

    def __init__(self, pinned):
        self.pinned = bool(pinned)  # page-locked (needed for asynchronous D2H/H2D copies)
        pool_type = getattr(_C, "HostTensorPool", None)
        self.pool = pool_type(self.pinned) if pool_type is not None else None  # None: torch's allocator
        self.bytes_handed_out = 0  # SUM: bytes of every buffer returned by empty()

    @property
    def source(self):
        """Where the buffers come from, for reports."""
        kind = "pinned" if self.pinned else "pageable"
        return f"memsched HostTensorPool ({kind})" if self.pool is not None else f"torch host allocator ({kind})"

    def empty(self, nbytes):
        """An uninitialised flat uint8 host tensor of `nbytes` bytes."""
        self.bytes_handed_out += nbytes
        if self.pool is not None:
            # WARNING: the block returns to the pool when the tensor dies; CopyEngine keeps every host
            # buffer referenced until the copy touching it has finished (Note [Offload copy ordering]).
            return self.pool.empty(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
