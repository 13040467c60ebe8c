"""Adversarial review of memsched.optimize() and the offload executor (CPU).

Each test is a reproducer of a bug found in review: it compares gradients and
parameters bitwise with plain PyTorch after a few steps, or checks that no
hook, mode or state outlives the Run.
"""
import copy
import io
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
    # Said so: the executed steps under them are "diverged" -- two in a row, then a re-profile is due
    # (Note [A lone mismatching step]) -- the later ones are not profiled, and the report counts them.
    assert [s.mode for s in run.step_stats] == (["diverged", "diverged"] if profiled_first else [])
    assert run.steps_not_profiled == (1 if profiled_first else 4)
    assert "ran plainly without being profiled" in run.report(file=io.StringIO()).table


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


def test_two_chained_models_each_with_a_run_leak_no_hooks():
    # Before the fix: the second model's pair was pushed above the first's and run.step() of the first
    # could not pop its own, which stayed on the global stack after both Runs ended.
    torch.manual_seed(0)
    m1, m2 = Small(), Small()
    r1, r2 = copy.deepcopy(m1), copy.deepcopy(m2)
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (m1, m2))
    q1, q2 = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (r1, r2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with optimize(m1, o1, budget=1.0, planner="offload_all_prefetch") as run1, \
                optimize(m2, o2, budget=1.0, planner="offload_all_prefetch") as run2:
            for step in range(4):
                x, y = _data(step)
                F.mse_loss(m2(m1(x)), y).backward()
                run1.step()
                run2.step()
    for step in range(4):
        x, y = _data(step)
        F.mse_loss(r2(r1(x)), y).backward()
        for q in (q1, q2):
            q.step()
            q.zero_grad(set_to_none=True)
    _no_hooks_left()
    for p, q in zip(list(m1.parameters()) + list(m2.parameters()), list(r1.parameters()) + list(r2.parameters())):
        assert torch.equal(p, q)
    assert [s.mode for s in run1.step_stats] == ["planned"] * 3
    assert all(s.offloaded > 0 for s in run1.step_stats)


def test_run_step_inside_the_callers_hooks_leaks_no_hooks():
    # Before the fix: run.step() found the caller's pair on top, gave up popping ours, and ours stayed
    # on the global stack for good (still packing after the Run ended).
    def step_fn(model, step, x, y):
        out = model(x)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            F.mse_loss(out, y).backward()
            run_box[0].step()

    run_box = []
    torch.manual_seed(0)
    model = Small()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with optimize(model, opt, budget=1.0, planner="offload_all_prefetch") as run:
        run_box.append(run)
        for step in range(4):
            step_fn(model, step, *_data(step))
    for step in range(4):
        _plain_step(ref, step, *_data(step))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    _no_hooks_left()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert [s.mode for s in run.step_stats] == ["planned"] * 3


class SparseActivation(nn.Module):
    """Saves a sparse COO tensor (no storage) as an activation."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(torch.sparse.mm(x.to_sparse(), torch.tanh(self.a.weight)))


def test_a_sparse_saved_activation_is_kept_and_the_step_still_runs_its_plan():
    # Before the fix: the executor's first pack of a storage-less tensor raised NotImplementedError
    # ("Cannot access storage of SparseTensorImpl") where plain PyTorch runs.
    run, caught = _compare(SparseActivation, _plain_step)
    assert [s.mode for s in run.step_stats] == ["planned"] * 3, caught
    assert all(s.offloaded > 0 for s in run.step_stats)
    _no_hooks_left()


def test_a_second_runs_forward_inside_the_first_runs_step_says_so():
    """Two models, each with its own Run, stepped in one loop iteration: the second Run's forward
    runs inside the first Run's open step; it runs plainly (gradients stay PyTorch's) and the
    warning names the cause and the fix, not the caller's own hooks."""
    import warnings as _w
    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    with optimize(a, torch.optim.SGD(a.parameters(), lr=0.1), budget=None) as ra, \
            optimize(b, torch.optim.SGD(b.parameters(), lr=0.1), budget=None) as rb:
        with _w.catch_warnings(record=True) as caught:
            _w.simplefilter("always")
            for _ in range(2):
                x = torch.randn(4, 8)
                (a(x).sum() + b(x).sum()).backward()
                ra.step()
                rb.step()
    messages = [str(w.message) for w in caught]
    assert any("another memsched Run's step is open" in m for m in messages), messages


def test_a_forward_using_torch_func_says_why_it_fails_under_memsched():
    """torch.func transforms inside forward refuse any saved-tensor hooks: PyTorch's error carries a
    note naming memsched and what to do (Note [Forwards that refuse saved-tensor hooks])."""
    class Pinn(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

        def forward(self, x):
            du = torch.func.vmap(torch.func.grad(lambda xi: self.net(xi).squeeze()))(x)
            return self.net(x) + du.sum(1, keepdim=True)

    model = Pinn()
    with optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=None):
        with pytest.raises(RuntimeError, match="saved tensor hooks") as err:
            model(torch.randn(4, 2)).sum().backward()
    assert any("memsched.optimize()" in n for n in getattr(err.value, "__notes__", []))
