"""op_timer.py -- per-op durations: CUDA events for ops on CUDA tensors, the
wall clock (perf_counter_ns) otherwise.

Entry point: OpTimer.start(is_cuda) -> token; OpTimer.stop(op_id, token, is_cuda)
-> microseconds now (CPU) or None (CUDA: resolved by resolve() after one
synchronize at the end of the step, so timing adds no sync per op).
"""
from __future__ import annotations

import time
from typing import List, Tuple

import torch


class OpTimer:
    def __init__(self):
        self._cuda: List[Tuple[int, object, object]] = []  # (op id, start event, end event)

    def start(self, is_cuda: bool):
        if is_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter_ns()

    def stop(self, op_id: int, token, is_cuda: bool):
        if is_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._cuda.append((op_id, token, ev))
            return None
        return (time.perf_counter_ns() - token) / 1000.0

    def resolve(self, builder) -> None:
        """Write the CUDA-timed durations into `builder` (synchronises once)."""
        if not self._cuda:
            return
        torch.cuda.synchronize()
        for op_id, start, end in self._cuda:
            builder.set_duration_us(op_id, max(0.0, start.elapsed_time(end) * 1000.0))
        self._cuda.clear()
