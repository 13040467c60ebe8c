"""Which weights an asynchronous stage's forward (and the same micro-batch's
backward) uses: ``none``, ``stash`` or ``predict``.

Entry points: ``make_policy(name, optimizer) -> WeightPolicy``;
``policy.load(master, replica, versions_ahead)`` before each forward.

Note [Weight versions in asynchronous 1F1B]
  Rationale: without a flush, stage k of K runs the forward of a micro-batch,
  then (in steady state) s = K - 1 - k updates of its own weights (the backwards of earlier
  micro-batches), then that micro-batch's backward. Its gradient is then
  computed against other weights than its forward used.
  Approach: each micro-batch in flight has its own replica of the stage
  module (memsched.pipeline.async_stage). A policy decides what the replica
  holds while that micro-batch is in flight:
    none    -- the replica aliases the live weights: the forward reads version
               v, the backward reads whatever version is current (v + s):
               stale and inconsistent, as pipelining without care is.
    stash   -- PipeDream's weight stashing: the replica is a copy of version v;
               forward and backward agree, the gradient (of version v) is
               applied to version v + s.
    predict -- S2: the replica holds W_hat = W - lr * s * d, the weights
               predicted s updates ahead (s: the updates between this
               micro-batch's forward and its backward; K - 1 - k in steady
               state, the micro-batches in flight on the stage when it enters
               while the pipeline fills, after Pipeline.flush(); predicting
               K - 1 - k there forwarded the first micro-batch after a flush at
               weights no update would reach) from the optimizer's own smoothed
               update direction d: SGD's momentum buffer (momentum > 0), or
               Adam's bias-corrected m_hat / (sqrt(v_hat) + eps) (AdamW adds
               weight_decay * W, as its update does). Forward and backward
               agree and are computed near the version the gradient is
               applied to. That version (v + s: every earlier micro-batch
               applied) is the one synchronous training computes this
               micro-batch's gradient at, on every stage; prediction error
               (the next s directions are not all d) is the only difference.
  A stage with s = 0 (the last) aliases under every policy: nothing to predict.
  Limitations: the prediction reads lr and the optimizer state when the
  forward runs; an LR schedule that changes lr within the next s updates is
  not foreseen. Nesterov SGD predicts with the momentum buffer alone.
  Copies (stash, predict) cost s + 1 copies of the stage's parameters: one
  per micro-batch in flight (s of them) plus the one the next forward fills
  while they are still in flight (its forward runs before the oldest one's
  backward frees a replica); counted in the stage's memory report, predict's
  with the largest transient direction tensor beside them.
"""
from __future__ import annotations

from typing import List

import torch

from memsched._C import MemschedError

POLICIES = ("predict", "stash", "none")


class WeightPolicy:
    name = "none"
    copies = False  # does a replica hold its own copy (True) or alias the live weights (False)

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.peak_buffer_bytes = 0  # transient prediction buffers (direction), per forward

    def load(self, master: List[torch.nn.Parameter], replica: List[torch.nn.Parameter], versions_ahead: int) -> None:
        """Fills the replica's parameters before a forward (no-op for aliases)."""


class StashPolicy(WeightPolicy):
    name = "stash"
    copies = True

    @torch.no_grad()
    def load(self, master, replica, versions_ahead):
        torch._foreach_copy_(replica, master)


class PredictPolicy(WeightPolicy):
    name = "predict"
    copies = True

    def __init__(self, optimizer):
        super().__init__(optimizer)
        for i, g in enumerate(optimizer.param_groups):
            if isinstance(optimizer, torch.optim.SGD) and not g.get("momentum", 0):
                raise MemschedError(
                    f"policy='predict': optimizer param_groups[{i}] is SGD without momentum, which has no smoothed "
                    f"gradient to predict from. Give SGD momentum > 0 (e.g. 0.9), use Adam/AdamW, or "
                    f"policy='stash'")
        if not isinstance(optimizer, (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)):
            raise MemschedError(
                f"policy='predict' supports torch.optim.SGD (momentum > 0), Adam and AdamW, whose smoothed "
                f"gradient it reads; got {type(optimizer).__name__}. Use policy='stash' (PipeDream) instead")

    def _direction(self, p: torch.Tensor, group: dict):
        """The update direction d of one parameter (the step is lr * d), or None before the first step."""
        st = self.optimizer.state.get(p)
        if not st:
            return None
        if isinstance(self.optimizer, torch.optim.SGD):
            d = st.get("momentum_buffer")
            return None if d is None else d
        step = float(st["step"])
        if step == 0:
            return None
        b1, b2 = group["betas"]
        sq = st["max_exp_avg_sq"] if group.get("amsgrad") else st["exp_avg_sq"]
        d = (st["exp_avg"] / (1 - b1 ** step)) / ((sq / (1 - b2 ** step)).sqrt_().add_(group["eps"]))
        if isinstance(self.optimizer, torch.optim.AdamW) and group["weight_decay"]:
            d.add_(p, alpha=group["weight_decay"])
        return d

    @torch.no_grad()
    def load(self, master, replica, versions_ahead):
        torch._foreach_copy_(replica, master)
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        for p, r in zip(master, replica):
            g = group_of[id(p)]
            d = self._direction(p, g)
            if d is None:
                continue
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, d.numel() * d.element_size())
            # torch's SGD/Adam/AdamW step is W -= lr * d also with maximize (it negates the gradient)
            r.add_(d, alpha=-float(g["lr"]) * versions_ahead)


def make_policy(name: str, optimizer: torch.optim.Optimizer) -> WeightPolicy:
    if name not in POLICIES:
        raise MemschedError(f"policy: expected one of {POLICIES}, got {name!r}")
    return {"predict": PredictPolicy, "stash": StashPolicy, "none": WeightPolicy}[name](optimizer)
