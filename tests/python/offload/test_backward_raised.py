"""A backward pass that raised in a planned step, caught by the loop: the next forward starts a fresh
step that runs the plan (Note [A step whose backward raised] in offload/executor.py)."""
import warnings

import pytest
import torch
import torch.nn as nn

import memsched
from memsched import models

FAIL = {"on": False}


class RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if FAIL["on"]:
            raise FloatingPointError("injected backward failure (an out-of-memory error, say)")
        return g


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = models.build_model("transformer")

    def forward(self, x):
        return RaisesInBackward.apply(self.m(x))


def _train(model, opt, step, accumulate=1):
    for s in range(6):
        FAIL["on"] = s == 2
        try:
            for a in range(accumulate):
                x, y = models.example_batch("transformer", 8, seed=10 * s + a)
                models.loss_fn("transformer", model(x), y).backward()
            step()
        except FloatingPointError:
            opt.zero_grad(set_to_none=True)
        finally:
            FAIL["on"] = False


@pytest.mark.parametrize("planner", ["dp", "hybrid"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_step_after_a_backward_that_raised_runs_the_plan(planner, accumulate):
    """Was: the next forward counted as the failed step's second, mismatched the trace and ran plainly."""
    torch.manual_seed(0)
    plain = Wrapped()
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-3)

    def plain_step():
        popt.step()
        popt.zero_grad(set_to_none=True)

    _train(plain, popt, plain_step, accumulate)
    torch.manual_seed(0)
    model = Wrapped()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no mismatch warning
        with memsched.optimize(model, optimizer=opt, budget=0.5, planner=planner) as run:
            _train(model, opt, run.step, accumulate)
    assert run.steps_profiled == 1 and run.steps_planned == 4 and run.steps_plain == 0, run.report()
    assert all(s.mode == "planned" and s.offloaded + s.recomputed > 0 for s in run.step_stats)
    for (n, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), n
