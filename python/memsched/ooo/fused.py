"""Per-parameter optimizer steps with torch's own optimizer implementations.

Entry point: ``ParamStepper(optimizer).step(param)``.

Note [Per-parameter step through a one-parameter group view]
  Rationale: the fused update must apply exactly torch.optim's math (SGD with
  momentum, Adam, AdamW -- including their options: weight decay, nesterov,
  amsgrad, maximize, foreach/fused kernels) to one parameter, the moment its
  gradient is final, without keeping the other gradients around.
  Approach: for the call, ``optimizer.param_groups`` is replaced by one group
  that is a shallow copy of the parameter's real group with ``params=[p]``;
  ``optimizer.step()`` then runs torch's implementation on that parameter with
  its state ``optimizer.state[p]`` (keyed by the parameter, so shared with the
  real optimizer: momentum buffers, exp_avg, step counts persist as usual). The
  hyper-parameters (lr, betas, weight_decay, ...) are read from the real group
  at every call, so learning-rate schedulers keep working. On CPU torch's
  default is the single-tensor path, which already loops parameter by
  parameter: the result is bitwise what a full ``optimizer.step()`` gives.
  Limitations: optimizer step hooks run once per parameter; ``step()``'s
  closure argument is not supported; optimizers whose update couples
  parameters (LBFGS, or anything with a global norm) cannot be fused and are
  rejected. On CUDA the default foreach path runs on one-tensor lists: same
  elementwise math.
"""
from __future__ import annotations

from typing import Dict

import torch

from memsched._C import MemschedError

SUPPORTED_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class ParamStepper:
    """Applies ``optimizer``'s update to one parameter at a time."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        if type(optimizer) not in SUPPORTED_OPTIMIZERS:
            raise MemschedError(
                f"fuse_optimizer=True supports torch.optim.SGD, Adam and AdamW (per-parameter updates); "
                f"got {type(optimizer).__module__}.{type(optimizer).__qualname__}. Use fuse_optimizer=False "
                f"and call optimizer.step() after backward.")
        self.optimizer = optimizer
        self.steps = 0  # COUNT: per-parameter updates applied
        self._group_of: Dict[int, int] = {}
        self.refresh()

    def refresh(self) -> None:
        """Re-reads which group each parameter belongs to (after add_param_group)."""
        self._group_of = {}
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                self._group_of[id(p)] = gi

    def owns(self, param: torch.Tensor) -> bool:
        return id(param) in self._group_of

    def step(self, param: torch.Tensor) -> None:
        """One optimizer update of ``param`` from ``param.grad``; the gradient is then freed."""
        gi = self._group_of.get(id(param))
        if gi is None:
            self.refresh()
            gi = self._group_of.get(id(param))
            if gi is None:
                return  # not optimized by this optimizer: leave the gradient alone
        opt = self.optimizer
        view = dict(opt.param_groups[gi])
        view["params"] = [param]
        saved = opt.param_groups
        opt.param_groups = [view]
        try:
            opt.step()
        finally:
            opt.param_groups = saved
        param.grad = None
        self.steps += 1
