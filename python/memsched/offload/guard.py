"""The memory guard's table: how far device memory grows after each activation's first save.

Entry point: guard_headroom(trace) -> [bytes per activation ordinal]. The executor hands it, with
the budget, to the C++ hooks (SavedTensorPath.set_memory_guard), which release D2H copies in flight
in stream order when the allocator's count plus this headroom would pass the budget. See Note
[Memory guard] in csrc/torch/saved_tensor_offload.cpp.

The guard checks at an activation's first save, after the op that made it has allocated; until the
next activation's save checks again, the forward ops in between allocate their outputs and free
what they no longer need. The headroom is the most the keep-all memory curve rises above its value
at the activation's producer within that window, and at least the largest single output there (a
curve that falls first can still need one output's room). Activations are numbered in the order of
their first save, which follows their producers; the table uses the running maximum of the
producers' op ids, so a save numbered later than its producer (a batch input saved by a later op)
never widens the window backwards.
"""
from __future__ import annotations

from typing import Dict, List

from memsched import _C
from memsched.offload.schedule import ordinal_of_label


def guard_headroom(trace) -> List[int]:
    """headroom[k]: how far memory rises after activation k's producer, up to the next activation's
    producer (at least the op right after it), in the forward. Ordinals the trace has no activation
    for get 0."""
    import memsched  # planning imports the offload package

    ops = trace.ops
    forward_ops = [i for i, op in enumerate(ops) if op.phase == "forward"]
    if not forward_ops:
        return []
    last_forward = forward_ops[-1]
    allocated = [0] * len(ops)
    producer: Dict[int, int] = {}
    before = 0  # bytes live before the first op: the curve's value at "op -1"
    for rec in trace.tensors:
        if 0 <= rec.producer_op < len(ops):
            allocated[rec.producer_op] += rec.bytes
        else:
            before += rec.bytes
        k = ordinal_of_label(rec.label)
        if k is not None:
            producer[k] = rec.producer_op
    if not producer:
        return []
    curve = _C.modelled_memory(trace, memsched.plan(trace, planner="keep_all"))  # bytes during each op
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
        hi = min(max(hi, lo), last_forward)
        if k in producer and lo <= hi:
            base = curve[starts[k]] if starts[k] >= 0 else before
            headroom[k] = max(max(curve[lo:hi + 1]) - base, max(allocated[lo:hi + 1]))
    return headroom
