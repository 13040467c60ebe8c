"""Point-to-point sends of stage boundary tensors between neighbouring ranks.

Entry point: ``Link(peer, device, group)`` with ``send(tensor)`` (non-blocking:
the send completes in the background; ``wait_sends()`` waits for all) and
``recv() -> tensor``.

Each tensor travels as a fixed-size header (dtype code, number of dimensions,
sizes) followed by the data, so a boundary tensor may change shape between
batches (a shorter last batch). Messages between two ranks arrive in the order
they were sent (torch.distributed's point-to-point ordering per pair).
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist

from memsched._C import MemschedError

_MAX_DIMS = 8
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]


class Link:
    """One direction-agnostic channel to one peer rank."""

    def __init__(self, peer: int, device: torch.device, group=None):
        self.peer = peer
        self.device = device
        self.group = group
        self._pending: List[Tuple[object, torch.Tensor]] = []  # (work, buffer kept alive until done)
        self.bytes_sent = 0

    def send(self, t: torch.Tensor, what: str) -> None:
        if not isinstance(t, torch.Tensor):
            raise MemschedError(f"{what}: a stage must return one tensor to send to the next stage, got "
                                f"{type(t).__name__}. Choose split points where one tensor flows between modules")
        if t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
            raise MemschedError(f"{what}: cannot send a tensor of dtype {t.dtype} with {t.dim()} dimensions "
                                f"(supported: {_MAX_DIMS} dimensions, dtypes {[str(d) for d in _DTYPES]})")
        data = t.detach().contiguous()
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        header[0] = _DTYPES.index(t.dtype)
        header[1] = t.dim()
        if t.dim():
            header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        for buf in (header, data):
            self._pending.append((dist.isend(buf, self.peer, group=self.group), buf))
        self.bytes_sent += data.numel() * data.element_size()
        self._reap()

    def recv(self) -> torch.Tensor:
        header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        dist.recv(header, self.peer, group=self.group)
        h = header.tolist()
        out = torch.empty(h[2:2 + h[1]], dtype=_DTYPES[h[0]], device=self.device)
        dist.recv(out, self.peer, group=self.group)
        return out

    def _reap(self) -> None:
        self._pending = [(w, b) for w, b in self._pending if not w.is_completed()]

    def wait_sends(self) -> None:
        for w, _ in self._pending:
            w.wait()
        self._pending = []
