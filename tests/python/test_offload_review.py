"""Adversarial review of memsched.optimize() and the offload executor (CPU).

Each test is a reproducer of a bug found in review: it compares gradients and
parameters bitwise with plain PyTorch after a few steps, or checks that no
hook, mode or state outlives the Run.
"""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memsched.optimize import optimize
from offload_standins import install_standins


@pytest.fixture(autouse=True)
def planner_if_missing(monkeypatch):
    install_standins(monkeypatch, only_missing=True)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _data(step, batch=4):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch, 8, generator=g), torch.randn(batch, 8, generator=g)


def _plain_step(model, step, x, y):
    F.mse_loss(model(x), y).backward()


def _compare(make_model, step_fn, steps=4, **kw):
    """Train with optimize(offload everything) and plainly; assert bitwise equality. Returns (run, warnings)."""
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    grads, ref_grads = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with optimize(model, opt, budget=1.0, planner="offload_all_prefetch", **kw) as run:
            for step in range(steps):
                step_fn(model, step, *_data(step))
                grads.append([p.grad.clone() for p in model.parameters()])
                run.step()
    for step in range(steps):
        step_fn(ref, step, *_data(step))
        ref_grads.append([p.grad.clone() for p in ref.parameters()])
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    for step, (gs, rs) in enumerate(zip(grads, ref_grads)):
        for i, (g, r) in enumerate(zip(gs, rs)):
            assert torch.equal(g, r), f"step {step} param {i}: gradient differs"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"
    return run, [str(w.message) for w in caught]


def _no_hooks_left():
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, "saved-tensor hooks leaked"
    assert torch._C._len_torch_dispatch_stack() == 0, "dispatch mode leaked"


# -- the caller's own saved-tensor hooks around the forward (Note [Foreign saved-tensor hooks]) -----------
@pytest.mark.parametrize("profiled_first", [False, True])
def test_save_on_cpu_around_the_forward_only_leaks_no_hooks(profiled_first):
    # Before the fix: our pair was pushed inside the caller's context and save_on_cpu's exit popped it,
    # leaving save_on_cpu's hooks on the global stack after the Run (one more per step).
    def step_fn(model, step, x, y):
        if profiled_first and step == 0:
            out = model(x)
        else:
            with torch.autograd.graph.save_on_cpu():
                out = model(x)
        F.mse_loss(out, y).backward()

    run, caught = _compare(Small, step_fn)
    _no_hooks_left()
    assert any("saved-tensor hooks" in m for m in caught)
    assert all(s.offloaded == 0 for s in run.step_stats)


def test_checkpoint_around_the_root_module_is_plain_and_bitwise():
    # Before the fix: checkpoint's exit popped our pair, and its backward recompute failed
    # (AttributeError: 'function' object has no attribute '_user_hooks').
    def step_fn(model, step, x, y):
        F.mse_loss(checkpoint(model, x, use_reentrant=False), y).backward()

    _compare(Small, step_fn)
    _no_hooks_left()


def test_disabled_saved_tensor_hooks_around_the_forward_runs_plainly():
    def step_fn(model, step, x, y):
        with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
            out = model(x)
        F.mse_loss(out, y).backward()

    _compare(Small, step_fn)
    _no_hooks_left()
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()


def test_callers_hooks_entered_before_the_step_and_left_after_it_are_kept():
    # The caller's hooks around the whole step stay theirs: they see every save, memsched offloads nothing.
    seen = []

    def pack(t):
        seen.append(t.shape)
        return t

    def step_fn(model, step, x, y):
        F.mse_loss(model(x), y).backward()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run, _ = _compare(Small, step_fn, steps=3)
        assert len(seen) > 0
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        assert top is not None and top[0] is pack
    _no_hooks_left()
