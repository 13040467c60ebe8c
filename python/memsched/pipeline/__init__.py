"""memsched.pipeline: pipelined model parallelism, one process per stage
(torch.distributed; NCCL on GPUs, gloo on CPU), asynchronous 1F1B without
flush with weight prediction (S2), stashing (PipeDream) or neither, and
torch.distributed.pipelining's synchronous schedules through one entry point.
See pipeline.py for the user's view and simulate.py for the throughput model.
"""
from memsched.pipeline.pipeline import ASYNC_SCHEDULES, SCHEDULES, Pipeline
from memsched.pipeline.process_group import select_backend
from memsched.pipeline.split import split_stages
from memsched.pipeline.weight_policy import POLICIES

__all__ = ["Pipeline", "SCHEDULES", "ASYNC_SCHEDULES", "POLICIES", "split_stages", "select_backend"]
