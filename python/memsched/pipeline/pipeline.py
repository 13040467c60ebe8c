"""``memsched.pipeline.Pipeline``: pipelined model parallelism, one process per
stage, launched with torchrun, in memsched's context-manager style.

    # torchrun --nproc-per-node=4 train.py
    with memsched.pipeline.Pipeline(model, split_points=["6", "12", "18"],
                                    optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4),
                                    loss_fn=F.cross_entropy, schedule="async-1f1b", policy="predict") as pipe:
        for x, y in loader:            # every process iterates the same batches
            loss = pipe.step((x, y))   # the loss on the last stage's process, None on the others
    print(pipe.report())               # per-stage memory (stashed versions, prediction buffers) and counters

Schedules: ``async-1f1b`` (no flush; See Note [Asynchronous 1F1B schedule] in
async_stage.py) with ``policy`` predict / stash / none (Note [Weight versions
in asynchronous 1F1B] in weight_policy.py), and torch.distributed.pipelining's
synchronous ``1f1b``, ``gpipe``, ``interleaved-1f1b``, ``interleaved-zb``,
``zbv`` (sync_schedule.py). One ``step(batch)`` is one optimizer update per
stage: for a synchronous schedule, of the whole batch cut into
``n_microbatches``; for ``async-1f1b``, of one earlier micro-batch (the batch
is one micro-batch; the one updating stage k was injected s = K-1-k steps ago).
"""
from __future__ import annotations

import numbers
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from memsched._C import MemschedError
from memsched.pipeline.process_group import backend_matches, ensure_process_group, stage_device
from memsched.pipeline.split import split_stages
from memsched.pipeline.sync_schedule import SYNC_SCHEDULES, stages_of_rank
from memsched.pipeline.weight_policy import POLICIES

ASYNC_SCHEDULES = ("async-1f1b",)
SCHEDULES = ASYNC_SCHEDULES + SYNC_SCHEDULES


class Pipeline:
    """Splits ``model`` at ``split_points`` and trains this process's stage(s).

    Args:
      model: an nn.Sequential (nested Sequentials allowed), built identically on every process.
      split_points: names (or top-level indices) of the modules that begin stages 1..K-1.
      optimizer: a callable params -> torch.optim.Optimizer, called with this process's parameters.
      loss_fn: loss_fn(output, target) -> scalar loss (mean over the batch), run on the last stage.
      schedule: one of SCHEDULES (default "async-1f1b").
      policy: "predict" (default for async-1f1b), "stash" or "none"; async-1f1b only.
      n_microbatches: synchronous schedules only (default: the number of stages).
      device: this process's device (default cuda:LOCAL_RANK with a GPU, else CPU; "cuda" without an index
        means cuda:LOCAL_RANK); NCCL on CUDA, gloo on CPU.
      max_deferred_bytes, executor: passed to each stage's OutOfOrderBackward (async-1f1b; default: every
        dW is deferred until the stage's dX has been sent).
    """

    def __init__(self, model: nn.Module, split_points: Sequence, optimizer: Callable, loss_fn: Callable,
                 schedule: str = "async-1f1b", policy: Optional[str] = None, n_microbatches: Optional[int] = None,
                 device=None, max_deferred_bytes=None, executor: str = "auto"):
        if schedule not in SCHEDULES:
            raise MemschedError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
        if schedule in ASYNC_SCHEDULES:
            policy = "predict" if policy is None else policy
            if policy not in POLICIES:
                raise MemschedError(f"policy: expected one of {POLICIES}, got {policy!r}")
            if n_microbatches not in (None, 1):
                raise MemschedError("n_microbatches: async-1f1b injects each step's batch as one micro-batch "
                                    "(one update per stage per step); leave n_microbatches unset")
        else:
            if policy is not None:
                raise MemschedError(f"policy={policy!r} applies to schedule='async-1f1b' only; the synchronous "
                                    f"schedule {schedule!r} flushes every step, so every weight is current")
            if n_microbatches is not None and (isinstance(n_microbatches, bool)
                                               or not isinstance(n_microbatches, numbers.Integral)
                                               or n_microbatches < 1):
                raise MemschedError(f"n_microbatches: expected a whole number >= 1, got {n_microbatches!r}")
        if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
            raise MemschedError("optimizer: pass a callable that builds the optimizer from this process's "
                                "parameters, e.g. lambda params: torch.optim.AdamW(params, lr=3e-4)")
        if not callable(loss_fn):
            raise MemschedError(f"loss_fn: expected a callable loss_fn(output, target), got {loss_fn!r}")
        self.stage_modules = split_stages(model, split_points)  # checked before any process group exists
        self.model = model
        self.num_stages = len(self.stage_modules)
        self.schedule = schedule
        self.policy = policy
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self._optimizer_factory = optimizer
        self._device_arg = device
        self._ooo = {"max_deferred_bytes": max_deferred_bytes, "executor": executor}
        self._runner = None
        self._created_group = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Pipeline":
        self.device = stage_device(self._device_arg)
        self._created_group, self.backend = ensure_process_group(self.device)
        try:
            self._start()
        except BaseException:
            self._close_group()
            raise
        return self

    def _start(self) -> None:
        backend_matches(self.device, self.backend)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.schedule in ASYNC_SCHEDULES:
            if self.num_stages != self.world:
                raise MemschedError(f"split_points: async-1f1b runs one stage per process: give {self.world - 1} "
                                    f"split points for {self.world} processes (got {self.num_stages} stages)")
            self.stage_indices = [self.rank]
        else:
            self.stage_indices = stages_of_rank(self.schedule, self.rank, self.world, self.num_stages)
        mods = [self.stage_modules[i].to(self.device) for i in self.stage_indices]
        params = [p for m in mods for p in m.parameters() if p.requires_grad]
        if not params:
            raise MemschedError(f"split_points: stage(s) {self.stage_indices} of process {self.rank} have no "
                                f"trainable parameters; move a split point so every stage holds a layer with weights")
        opt = self._optimizer_factory(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise MemschedError(f"optimizer: the callable must return a torch.optim.Optimizer, got {type(opt).__name__}")
        owned = {id(p) for g in opt.param_groups for p in g["params"]}
        if owned != {id(p) for p in params}:
            raise MemschedError("optimizer: the callable must build the optimizer over exactly the parameters it "
                                "is given (this process's stage), not over the whole model")
        self.optimizer = opt
        if self.schedule in ASYNC_SCHEDULES:
            from memsched.pipeline.async_stage import AsyncStage
            from memsched.pipeline.p2p import Link

            k = self.rank
            prev = Link(k - 1, self.device) if k > 0 else None
            nxt = Link(k + 1, self.device) if k < self.num_stages - 1 else None
            self._runner = AsyncStage(mods[0], k, self.num_stages, opt, self.policy, self.loss_fn, self.device,
                                      prev, nxt, **self._ooo)
        else:
            from memsched.pipeline.sync_schedule import SyncRunner

            m = self.n_microbatches or self.num_stages
            self._runner = SyncRunner(mods, self.stage_indices, self.num_stages, opt, self.loss_fn, self.device,
                                      self.schedule, m)

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None and self._runner is not None:
                self._runner.drain()
                self._final_report = self._runner.report()
        finally:
            if self._runner is not None:
                self._runner.close()
                self._runner = None
            self._close_group()

    def _close_group(self) -> None:
        if self._created_group and dist.is_initialized():
            dist.destroy_process_group()
        self._created_group = False

    # ------------------------------------------------------------------ training
    def step(self, batch):
        """One update per stage. batch = (inputs, target), the same on every process (stage 0 reads the
        inputs, the last stage the target; every process checks the batch size from its copy). Synchronous
        schedules take one batch size throughout, a multiple of n_microbatches (See Note [Batch sizes under
        synchronous schedules] in sync_schedule.py). Returns the loss (a 0-dim tensor) on the process of the last
        stage -- for async-1f1b the loss of this batch at the weights its forward used -- and None elsewhere."""
        if self._runner is None:
            raise MemschedError("step(): use the Pipeline as a context manager (`with Pipeline(...) as pipe:`)")
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise MemschedError(f"step(batch): batch must be (inputs, target), got {type(batch).__name__}")
        return self._runner.run_step(batch[0], batch[1])

    def flush(self) -> None:
        """async-1f1b: runs the backward of every micro-batch still in flight (as leaving the `with` block
        does), so every stage's weights include every step so far. No-op for synchronous schedules."""
        if self._runner is None:
            raise MemschedError("flush(): use the Pipeline as a context manager (`with Pipeline(...) as pipe:`)")
        self._runner.drain()

    def report(self) -> dict:
        """This process's stage: memory by kind (bytes) and counters."""
        if self._runner is None:  # after the `with` block: the report taken when it ended
            return dict(getattr(self, "_final_report", {}))
        return self._runner.report()

    @property
    def stage_module(self) -> nn.Module:
        """This process's (first) stage: the model's own modules, trained in place."""
        return self.stage_modules[self.stage_indices[0]]
