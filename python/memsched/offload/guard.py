"""The memory guard's table: how much the ops after each activation's first save may allocate.

Entry point: guard_headroom(trace) -> [bytes per activation ordinal]. The executor hands it, with
the budget, to the C++ hooks (SavedTensorPath.set_memory_guard), which release D2H copies in flight
in stream order when the allocator's count plus this headroom would pass the budget. See Note
[Memory guard] in csrc/torch/saved_tensor_offload.cpp.

The guard checks at an activation's first save, after the op that made it has allocated; what the
step allocates next, before the next activation's save checks again, is the outputs of the forward
ops in between. Activations are numbered in the order of their first save, which follows their
producers; the table uses the running maximum of the producers' op ids, so a save numbered later
than its producer (a batch input saved by a later op) never widens the window backwards.
"""
from __future__ import annotations

from typing import Dict, List

from memsched.offload.schedule import ordinal_of_label


def guard_headroom(trace) -> List[int]:
    """headroom[k]: the most bytes one forward op allocates (its outputs, as the trace sizes them)
    after activation k's producer, up to the next activation's producer (at least the op right
    after it). Ordinals the trace has no activation for get 0."""
    ops = trace.ops
    forward_ops = [i for i, op in enumerate(ops) if op.phase == "forward"]
    if not forward_ops:
        return []
    last_forward = forward_ops[-1]
    allocated = [0] * len(ops)
    producer: Dict[int, int] = {}
    for rec in trace.tensors:
        if 0 <= rec.producer_op < len(ops):
            allocated[rec.producer_op] += rec.bytes
        k = ordinal_of_label(rec.label)
        if k is not None:
            producer[k] = rec.producer_op
    if not producer:
        return []
    n = max(producer) + 1
    starts = []  # ordinal -> running max of producer ops (-1: before the step)
    running = -1
    for k in range(n):
        running = max(running, producer.get(k, -1))
        starts.append(running)
    headroom = [0] * n
    for k in range(n):
        lo = starts[k] + 1
        hi = starts[k + 1] if k + 1 < n else last_forward
        hi = max(hi, lo)
        hi = min(hi, last_forward)
        if k in producer and lo <= hi:
            headroom[k] = max(allocated[lo:hi + 1])
    return headroom
