"""The synchronous schedules of ``torch.distributed.pipelining`` behind
memsched's entry point, for comparison with the asynchronous ones.

Entry points: ``SYNC_SCHEDULES`` (name -> torch class, stages per rank),
``SyncRunner(stage_modules, stage_indices, num_stages, optimizer, loss_fn,
device, schedule, n_microbatches)`` with ``run_step(inputs, target)``.

Each call is one flushed step: the batch is cut into ``n_microbatches``,
torch's schedule runs their forwards and backwards, the gradients are averaged
over micro-batches (``scale_grads``), and the optimizer updates once -- the
same update as single-process training on the whole batch with a mean loss.
Zero-bubble schedules split each backward into input and weight gradients
(torch's own dX-first); ``zbv`` places two stages per rank in a V
(rank r holds stages r and 2W - 1 - r), ``interleaved-*`` place stage r + i*W
on rank r.

Note [Batch sizes under synchronous schedules]
  Rationale: torch.distributed.pipelining cuts the batch (inputs on the first
  stage, target on the last) into n_microbatches along dim 0 and fixes every
  stage's receive buffers from the first step's micro-batch. A batch size not
  divisible by n_microbatches, or one that differs from the first step's,
  failed deep inside torch: a batch-size mismatch in the loss on the last
  rank, 'Connection closed by peer' on the others, or gloo aborting the
  process (SIGABRT) when a larger batch followed a smaller one. Equal
  micro-batches are also what makes the mean of per-micro-batch mean losses
  (scale_grads) the whole batch's mean.
  Approach: run_step refuses such a batch before any communication, naming
  n_microbatches and the fix. Every process is given the same batch
  (Pipeline.step's contract), so every process reaches the same decision
  from its own copy, with no message exchanged, and none is left waiting on
  a peer that refused. A process given no batch tensor at all (neither inputs
  nor target; the middle stages read neither) cannot check; it learns of a
  peer's refusal as of any peer's error (the connection closes when that
  process ends).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

from memsched._C import MemschedError
from memsched.pipeline.memory import stage_memory


# name -> (class in torch.distributed.pipelining, stage layout)
_TORCH_CLASSES = {"1f1b": ("Schedule1F1B", "single"), "gpipe": ("ScheduleGPipe", "single"),
                  "interleaved-1f1b": ("ScheduleInterleaved1F1B", "interleaved"),
                  "interleaved-zb": ("ScheduleInterleavedZeroBubble", "interleaved"),
                  "zbv": ("ScheduleZBVZeroBubble", "v")}
SYNC_SCHEDULES = tuple(_TORCH_CLASSES)


def _torch_schedules() -> Dict[str, tuple]:
    import torch.distributed.pipelining as pp

    return {k: (getattr(pp, cls), layout) for k, (cls, layout) in _TORCH_CLASSES.items() if hasattr(pp, cls)}


def stages_of_rank(schedule: str, rank: int, world: int, num_stages: int) -> List[int]:
    """The stage indices rank `rank` runs under `schedule` (refusing a stage count the layout cannot place)."""
    layout = _TORCH_CLASSES[schedule][1]
    if layout == "single":
        if num_stages != world:
            raise MemschedError(f"split_points: schedule {schedule!r} runs one stage per process: give "
                                f"{world - 1} split points for {world} processes (got {num_stages} stages)")
        return [rank]
    if layout == "v":
        if num_stages != 2 * world:
            raise MemschedError(f"split_points: schedule 'zbv' runs two stages per process in a V: give "
                                f"{2 * world - 1} split points for {world} processes (got {num_stages} stages)")
        return [rank, 2 * world - 1 - rank]
    if num_stages % world or num_stages // world < 2:
        raise MemschedError(f"split_points: schedule {schedule!r} interleaves several stages per process: the "
                            f"number of stages must be a multiple (>= 2) of {world} processes (got {num_stages})")
    return list(range(rank, num_stages, world))


def _skip_p2p_warmup_with_self(stage) -> None:
    """torch 2.11's schedules warm up p2p with each neighbour stage, also one on the same rank (zbv's V,
    or interleaving on one process), and gloo refuses a send to itself ('Pair is not connected'); torch 2.14
    no longer calls this for a PipelineStage. Same-rank neighbours exchange nothing over p2p afterwards."""
    warmup = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if warmup is None:
        return

    def without_self():
        return [op for op in warmup() if getattr(op, "group_peer", None) != stage.group_rank]

    stage._get_init_p2p_neighbors_ops = without_self


class SyncRunner:
    def __init__(self, stage_modules: List[nn.Module], stage_indices: List[int], num_stages: int,
                 optimizer: torch.optim.Optimizer, loss_fn: Callable, device: torch.device, schedule: str,
                 n_microbatches: int, group=None):
        from torch.distributed.pipelining import PipelineStage

        available = _torch_schedules()
        if schedule not in available:
            raise MemschedError(f"schedule {schedule!r} needs torch.distributed.pipelining."
                                f"{_TORCH_CLASSES[schedule][0]}, which torch {torch.__version__} does not have")
        cls, layout = available[schedule]
        self.schedule_name = schedule
        self.modules = stage_modules
        self.indices = stage_indices
        self.num_stages = num_stages
        self.optimizer = optimizer
        self.device = device
        self.stages = [PipelineStage(m, i, num_stages, device, group=group)
                       for m, i in zip(stage_modules, stage_indices)]
        for stage in self.stages:
            _skip_p2p_warmup_with_self(stage)
        self.is_first = 0 in stage_indices
        self.is_last = num_stages - 1 in stage_indices
        self.n_microbatches = n_microbatches
        arg = self.stages[0] if layout == "single" else self.stages
        self.schedule = cls(arg, n_microbatches, loss_fn=loss_fn, scale_grads=True)
        self.steps = 0
        self.batch_size = None  # the first step's; See Note [Batch sizes under synchronous schedules]

    def _check_batch(self, inputs, target) -> None:
        """See Note [Batch sizes under synchronous schedules]."""
        rows = {name: t.shape[0] for name, t in (("inputs", inputs), ("target", target))
                if isinstance(t, torch.Tensor) and t.dim() > 0}
        if not rows:
            return
        if len(set(rows.values())) > 1:
            raise MemschedError(f"step(batch): inputs have {rows['inputs']} rows but target has {rows['target']}; "
                                f"the schedule cuts both into n_microbatches along dim 0, so give them the same "
                                f"batch size")
        b, m = next(iter(rows.values())), self.n_microbatches
        if self.batch_size is None:
            if b < m or b % m:
                raise MemschedError(f"step(batch): batch size {b} is not divisible by n_microbatches={m}; a "
                                    f"synchronous schedule cuts the batch into {m} equal micro-batches. Use a "
                                    f"batch size that is a multiple of {m}, or set n_microbatches to a divisor "
                                    f"of {b}")
            self.batch_size = b
        elif b != self.batch_size:
            raise MemschedError(f"step(batch): batch size {b} differs from the first step's {self.batch_size}; "
                                f"torch.distributed.pipelining fixes each stage's buffers at the first step, so "
                                f"synchronous schedules need one batch size throughout. Drop the short last batch "
                                f"(DataLoader(..., drop_last=True)), or use schedule='async-1f1b', which takes "
                                f"any batch size")

    def run_step(self, inputs, target):
        self._check_batch(inputs, target)  # before any communication
        args = (inputs.to(self.device),) if self.is_first else ()
        kwargs = {}
        losses: List[torch.Tensor] = []
        if self.is_last:
            kwargs = {"target": target.to(self.device), "losses": losses}
        self.schedule.step(*args, **kwargs)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        if self.is_last:
            return torch.stack([l.detach() for l in losses]).mean()
        return None

    def drain(self) -> None:
        """Every step is flushed: nothing in flight."""

    def report(self) -> dict:
        params = [p for m in self.modules for p in m.parameters()]
        out = stage_memory(stage=self.indices[0] if len(self.indices) == 1 else list(self.indices),
                           policy="sync", params=params, optimizer=self.optimizer, replica_copies=[],
                           transient_buffer_bytes=0, in_flight=0, peak_deferred_bytes=0)
        out.update({"schedule": self.schedule_name, "steps": self.steps, "updates": self.steps,
                    "n_microbatches": self.n_microbatches})
        return out

    def close(self) -> None:
        pass
