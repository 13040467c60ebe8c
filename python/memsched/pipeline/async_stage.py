"""One stage of asynchronous 1F1B without flush (PipeDream-style), with a
weight policy (none / stash / predict) and out-of-order backward inside the
stage.

Entry point: ``AsyncStage(module, index, num_stages, optimizer, policy,
loss_fn, device, prev, next)``; ``run_step(inputs, target)`` once per
``Pipeline.step()``, ``drain()`` at the end.

Note [Asynchronous 1F1B schedule]
  Rationale: no flush between mini-batches; every stage is busy in steady state.
  Approach: every call of step(batch) injects one micro-batch. Stage k runs
  its forward (receiving the activation of the same micro-batch from stage
  k - 1), then -- once more than s = K - 1 - k micro-batches are in flight
  here -- the backward of the oldest one (its output gradient was sent by
  stage k + 1 in an earlier call), then one optimizer update with that
  micro-batch's gradient. The last stage (s = 0) computes the loss and runs
  the backward at once. So stage k updates once per call after a warm-up of s
  calls, and between a micro-batch's forward and backward there are exactly s
  updates of this stage (See Note [Weight versions in asynchronous 1F1B]).
  Pipeline.flush()/exit runs the remaining backwards (cool-down). After a
  flush the pipeline fills again: the j-th micro-batch after it (j < s) has
  only j updates between its forward and backward (the micro-batches in
  flight here when it enters), which is what predict extrapolates over.
  Sends are non-blocking (Link.send); a stage only waits for the data it needs.

Note [dX before dW in a pipeline stage]
  Rationale (S4): the next stage upstream waits for this stage's input
  gradient dX; the weight gradients dW of this stage are needed only by its
  own update.
  Approach: each replica runs under memsched's OutOfOrderBackward with an
  unbounded deferral limit on the inline executor: every Linear/Conv dW is
  queued and runs in the end-of-backward flush. A tensor hook on the stage's
  input sends dX upstream the moment autograd produces it, before that flush.
  On CUDA the stream executor runs dW on a side stream instead, concurrently.
  ``report()['dw_items_run_before_dx']`` counts dW items that ran early (the
  scheduler's urgent items); it is 0 on the inline executor.
  Limitations: one OutOfOrderBackward per replica (one iteration per
  micro-batch each: a graph in flight per replica).
"""
from __future__ import annotations

import copy
from collections import deque
from typing import Callable, Optional

import torch
import torch.nn as nn

from memsched._C import MemschedError
from memsched.ooo import OutOfOrderBackward
from memsched.pipeline.memory import stage_memory
from memsched.pipeline.p2p import Link
from memsched.pipeline.weight_policy import make_policy

UNBOUNDED_DEFERRAL_BYTES = 1 << 50  # See Note [dX before dW in a pipeline stage]


class _Replica:
    def __init__(self, module: nn.Module, params, alias_of, ooo_kwargs):
        self.module = module
        self.params = params
        if alias_of is not None:
            for q, p in zip(params, alias_of):
                q.data = p.data  # shares storage, keeps its own version counter: updates are seen, not refused
        self.aliased = alias_of is not None
        self.ooo = OutOfOrderBackward(module, **ooo_kwargs).install()


class AsyncStage:
    def __init__(self, module: nn.Module, index: int, num_stages: int, optimizer: torch.optim.Optimizer,
                 policy: str, loss_fn: Optional[Callable], device: torch.device,
                 prev: Optional[Link], next: Optional[Link], max_deferred_bytes=None, executor: str = "auto"):
        self.module = module
        self.index = index
        self.num_stages = num_stages
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.device = device
        self.prev, self.next = prev, next
        self.versions_ahead = num_stages - 1 - index
        self.policy = make_policy(policy, optimizer)
        self.params = [p for p in module.parameters() if p.requires_grad]
        ooo_kwargs = {"max_deferred_bytes": UNBOUNDED_DEFERRAL_BYTES if max_deferred_bytes is None
                      else max_deferred_bytes, "executor": executor}
        copies = self.policy.copies and self.versions_ahead > 0
        self.replicas = []
        for _ in range(self.versions_ahead + 1):
            rep = copy.deepcopy(module)
            for rb, mb in zip(rep.buffers(), module.buffers()):
                rb.data = mb.data  # running statistics are one set, updated by every forward
            rparams = [q for q in rep.parameters() if q.requires_grad]
            self.replicas.append(_Replica(rep, rparams, None if copies else self.params, ooo_kwargs))
        self.pending = deque()  # (output, replica) of micro-batches whose backward has not run
        self._turn = 0
        self.steps = 0
        self.updates = 0
        self.dx_sent = 0

    # -------------------------------------------------------------- schedule
    def run_step(self, inputs, target):
        rep = self.replicas[self._turn]
        self._turn = (self._turn + 1) % len(self.replicas)
        if not rep.aliased:
            # the updates of this stage between this forward and its backward: one per micro-batch already
            # in flight here; s in steady state, fewer after a flush (See Note [Weight versions in
            # asynchronous 1F1B])
            self.policy.load(self.params, rep.params, min(self.versions_ahead, len(self.pending)))
        if self.prev is None:
            x = inputs.to(self.device) if isinstance(inputs, torch.Tensor) else inputs
        else:
            x = self.prev.recv()
            if x.is_floating_point():
                x.requires_grad_(True)
                x.register_hook(self._send_dx)
        with torch.enable_grad():
            out = rep.module(x)
            if self.next is None:
                if target is None:
                    raise MemschedError("step(batch): the last stage needs the target; pass batch=(inputs, target)")
                loss = self.loss_fn(out, target.to(self.device))
        self.steps += 1
        if self.next is None:
            loss.backward()
            self._update(rep)
            return loss.detach()
        self.next.send(out, f"stage {self.index} output")
        self.pending.append((out, rep))
        if len(self.pending) > self.versions_ahead:
            self._backward_oldest()
        return None

    def drain(self) -> None:
        """Cool-down: the backwards of every micro-batch still in flight (its gradient comes from downstream)."""
        while self.pending:
            self._backward_oldest()
        for link in (self.prev, self.next):
            if link is not None:
                link.wait_sends()

    def _backward_oldest(self) -> None:
        out, rep = self.pending.popleft()
        dy = self.next.recv()
        if dy.shape != out.shape:
            raise MemschedError(f"stage {self.index}: received an output gradient of shape {tuple(dy.shape)} for "
                                f"an output of shape {tuple(out.shape)}")
        out.backward(dy)
        self._update(rep)

    def _send_dx(self, grad: torch.Tensor) -> None:
        self.prev.send(grad, f"stage {self.index} input gradient")
        self.dx_sent += 1

    def _update(self, rep: _Replica) -> None:
        rep.ooo.step()
        for p, q in zip(self.params, rep.params):
            p.grad, q.grad = q.grad, None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1

    # -------------------------------------------------------------- reports
    def report(self) -> dict:
        reports = [r.ooo.report() for r in self.replicas]
        out = stage_memory(
            stage=self.index, policy=self.policy.name, params=self.params, optimizer=self.optimizer,
            replica_copies=[q for r in self.replicas if not r.aliased for q in r.params],
            transient_buffer_bytes=self.policy.peak_buffer_bytes, in_flight=len(self.pending),
            peak_deferred_bytes=max(r["peak_deferred_bytes"] for r in reports))
        out.update({
            "schedule": "async-1f1b",
            "versions_ahead": self.versions_ahead,
            "steps": self.steps,
            "updates": self.updates,
            "dx_sent": self.dx_sent,
            "dw_items": sum(r["deferred_items"] for r in reports),
            "dw_items_run_before_dx": sum(r["urgent_items"] for r in reports),
        })
        return out

    def close(self) -> None:
        for r in self.replicas:
            r.ooo.remove()
