"""memsched: memory scheduling for PyTorch training.

Profile one training step into a Trace, plan which activations stay on the GPU
under a memory budget, execute the plan, reorder backward. See README.md.
"""
import torch  # noqa: F401  -- loads libc10/libtorch before the extension needs them

from memsched import _C
from memsched._C import MemschedError, Op, TensorRecord, Trace
from memsched.units import format_bytes, parse_bytes
from memsched.profiler import profile
from memsched import models
from memsched.device import DeviceModel, load_device, measure_device
from memsched.planning import Plan, SimResult, plan, simulate
from memsched.optimize import Run, optimize
from memsched import allocator
from memsched.allocator import dump_snapshot, memory_snapshot, memory_stats
from memsched.ooo import OutOfOrderBackward
from memsched import pipeline
from memsched import partition  # callable: memsched.partition(trace, devices, cap)

__version__ = "0.1.0"

__all__ = [
    "MemschedError",
    "Op",
    "TensorRecord",
    "Trace",
    "format_bytes",
    "parse_bytes",
    "profile",
    "models",
    "DeviceModel",
    "Plan",
    "SimResult",
    "load_device",
    "measure_device",
    "plan",
    "simulate",
    "optimize",
    "Run",
    "allocator",
    "dump_snapshot",
    "memory_snapshot",
    "memory_stats",
    "OutOfOrderBackward",
    "pipeline",
    "partition",
]
