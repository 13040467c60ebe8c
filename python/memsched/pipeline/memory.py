"""What one pipeline stage holds in memory, by kind (bytes), for ``Pipeline.report()``.

Entry point: ``stage_memory(...) -> dict``. Stashed weight versions (policy
``stash``) and prediction buffers (policy ``predict``: the predicted weight
copies in flight, plus the largest transient direction tensor) are counted
beside the parameters and optimizer state, so policies compare on one line.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch


def tensor_bytes(ts: Iterable[Optional[torch.Tensor]]) -> int:
    seen, total = set(), 0
    for t in ts:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        key = (t.untyped_storage().data_ptr(), t.device)
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v))


def stage_memory(*, stage: int, policy: str, params, optimizer, replica_copies, transient_buffer_bytes: int,
                 in_flight: int, peak_deferred_bytes: int) -> dict:
    """replica_copies: the parameters of the replicas that hold their own copy (not aliases)."""
    copies = tensor_bytes(replica_copies)
    return {
        "stage": stage,
        "policy": policy,
        "param_bytes": tensor_bytes(params),
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "stashed_version_bytes": copies if policy == "stash" else 0,
        "prediction_buffer_bytes": (copies + transient_buffer_bytes) if policy == "predict" else 0,
        "in_flight_microbatches": in_flight,
        "peak_deferred_dw_bytes": peak_deferred_bytes,
    }
