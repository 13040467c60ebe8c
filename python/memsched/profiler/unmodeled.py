"""unmodeled.py -- memory the device allocator holds that no traced tensor accounts for.

Entry points: DeviceCounters.for_device(device) (None on CPU), add_unmodeled(trace, op_peaks).

Note [Memory the trace does not model]
  Rationale: the trace sizes each storage from its tensor. On a GPU the caching allocator holds
  more: cuBLAS/cuDNN workspaces, its rounding (a block may be up to 1 MiB larger than asked for),
  buffers a kernel allocates and frees inside one op. On an H100 keep_all's simulated peak missed
  23% of max_memory_allocated (a Llama-style decoder), so every plan under-counted its memory and
  no budget held.
  Approach: on an accelerator the profiler starts a new allocator peak before each op it records
  and reads the peak after it (C++ counters, no synchronisation; memsched's shim when its allocator
  is installed): the memory the device held during that op. After the step, add_unmodeled()
  subtracts keep_all's modelled memory during each op; what remains is memory no tensor of the
  trace explains. It enters the trace as temporaries that never leave the device: one as large as
  the least of these remainders, alive through the whole step, and one per op for the rest where
  that exceeds kMinExtraBytes, alive during that op only. Planners and the simulator count them like
  any other memory, so keep_all's simulated peak is the profiled step's measured peak and a plan's
  memory includes what the device adds (run.report() states the unmodeled bytes at the peak).
  A step profiled with its saves offloaded (profile="offload", Note [Profiling with saved
  activations offloaded]) holds less than keep_all: the bytes of saved storages it has released
  (copied to the host, alive in the trace) are read at each op's start and taken off keep_all's
  modelled memory before the subtraction.
  Limitations: op granularity: a workspace an op frees before it returns counts for the whole op.
  The profiled step restarts the allocator's peak at every op, so torch.cuda.max_memory_allocated()
  read after it covers only its last op; ProfilerSession.device_peak_bytes has the step's.
  Rounding is charged to the step, not to each tensor, so a plan that offloads many tensors frees
  slightly more than it is credited with.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from memsched import _C, allocator

kMinExtraBytes = 1 << 20  # a per-op remainder below this is dropped (allocator rounding noise)
UNMODELED_LABEL = "unmodeled"  # label prefix of the temporaries add_unmodeled() adds


class DeviceCounters:
    """The device allocator's peak, reset and read around each op (Note [Memory the trace does not model])."""

    def __init__(self, device: torch.device):
        self.device = device
        self.name = str(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.index = index
        if allocator.is_installed():
            shim = allocator._load_shim()
            self.reset = lambda: shim.memsched_reset_peak_stats(index)
            self.peak = lambda: shim.memsched_allocated_peak_bytes(index)
            self.reserved_peak = lambda: shim.memsched_reserved_peak_bytes(index)
        else:
            name = f"{device.type}:{index}"
            self.reset = lambda: _C.reset_device_peak(name)
            self.peak = lambda: _C.device_peak_bytes(name)
            self.reserved_peak = lambda: _C.device_reserved_peak_bytes(name)

    @classmethod
    def for_device(cls, device) -> Optional["DeviceCounters"]:
        """Counters for a CUDA device; None elsewhere (CPU memory is measured by the executor's count),
        and None where the allocator keeps no statistics (another pluggable allocator than memsched's:
        torch's CUDAPluggableAllocator raises from getDeviceStats): the trace is then not corrected."""
        d = torch.device(device)
        if d.type != "cuda" or not torch.cuda.is_available():
            return None
        counters = cls(d)
        try:
            counters.reset()
            counters.peak()
        except Exception:
            return None
        return counters


def add_unmodeled(trace, op_peaks: Dict[int, int], off_device: Optional[Dict[int, int]] = None) -> int:
    """Add the memory `op_peaks` (op id -> allocator peak during that op) shows beyond keep_all's
    modelled memory to `trace` as temporaries; returns the bytes added at the op of the step's measured
    peak (0 when nothing was added). off_device (op id -> bytes): traced storages the step held off the
    device during that op (a profile with its saves offloaded), which keep_all counts and the allocator
    did not. See Note [Memory the trace does not model]."""
    ops = len(trace.ops)
    if not op_peaks or ops == 0:
        return 0
    import memsched  # planning imports the profiler package

    modelled = _C.modelled_memory(trace, memsched.plan(trace, planner="keep_all"))
    off = off_device or {}
    extra = {i: op_peaks[i] - (modelled[i] - off.get(i, 0)) for i in op_peaks if 0 <= i < len(modelled)}
    if not extra:
        return 0
    base = max(min(extra.values()), 0)
    last = ops - 1
    if base > 0:
        # no uses: an op's inputs are what a recompute chain must recreate (csrc/core/recompute.cpp)
        trace.add_tensor(base, "uint8", "temporary", -1, [], last, f"{UNMODELED_LABEL}:step")
    for i in sorted(extra):
        rest = extra[i] - base
        if rest >= kMinExtraBytes:
            trace.add_tensor(rest, "uint8", "temporary", i, [], i, f"{UNMODELED_LABEL}:op{i}")
    peak_op = max(op_peaks, key=lambda i: op_peaks[i])
    rest = extra.get(peak_op, 0) - base
    return base + (rest if rest >= kMinExtraBytes else 0)
