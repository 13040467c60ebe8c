"""memsched.offload: execute an offload plan in eager PyTorch.

  OffloadSchedule  (schedule.py)     Trace + Plan -> per-activation actions and prefetch triggers
  CopyEngine       (memsched._C, csrc/torch/copy_engine.h) D2H / H2D copies on side streams (in order on
                   CPU), pooled events, and the memory they hold until they complete
  HostBuffers      (host_buffers.py) pinned (CUDA) or pageable (CPU) host blocks
  OffloadExecutor  (executor.py)     the saved-tensor hooks; one StepStats per step
  report.py        planned-vs-measured table (RunReport) and the timeline PNG
  chrome_trace.py  the timeline as a Chrome trace event file (Perfetto), merged with torch.profiler's on request
  compare.py       the side-by-side demo (plain vs memsched.optimize), used by `python -m memsched demo`
The user API on top is memsched.optimize() (optimize.py).
"""
from memsched._C import CopyEngine, CopyTicket
from memsched.offload.executor import OffloadExecutor, StepStats
from memsched.offload.host_buffers import HostBuffers
from memsched.offload.schedule import OffloadSchedule, ordinal_of_label

__all__ = ["CopyEngine", "CopyTicket", "HostBuffers", "OffloadExecutor", "OffloadSchedule", "StepStats",
           "ordinal_of_label"]
