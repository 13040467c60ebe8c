"""budget=None's keep-all plan runs its steps without saved-tensor hooks (Note [A plan with nothing
to do] in memsched/offload/executor.py): plain PyTorch's saves, speed and checks, while every plan
that could move something keeps them."""
import io
import sys
import warnings

import pytest
import torch
import torch.nn as nn

from memsched import models
from memsched.optimize import optimize


class _SeesHooks(nn.Module):
    """A small MLP that records, at each forward, whether saved-tensor default hooks are pushed."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 4)
        self.seen = []

    def forward(self, x):
        self.seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
        return self.b(torch.tanh(self.a(x)))


def _train(options, steps=4, model=None, device="cpu"):
    torch.manual_seed(0)
    model = (model if model is not None else _SeesHooks()).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, 8).to(device)
    with optimize(model, opt, **options) as run:
        for _ in range(steps):
            model(x).square().mean().backward()
            run.step()
    return model, run


def test_budget_none_steps_push_no_hooks_and_train_bitwise_like_plain(device):
    model, run = _train(dict(budget=None), device=device)
    torch.manual_seed(0)
    ref = _SeesHooks().to(device)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(16, 8).to(device)
    for _ in range(4):
        ref(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert run.executor.hookless and run.plan is None
    assert model.seen[1:] == [False, False, False]  # the first step is profiled
    assert [s.mode for s in run.step_stats] == ["planned"] * 3 and not any(s.hooked for s in run.step_stats)
    assert run.mismatches == 0 and run.steps_planned == 3
    if device == "cuda":  # the allocator's peak is still measured
        assert all(s.peak_bytes > 0 for s in run.step_stats)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("options", [dict(budget=1 << 40), dict(budget=1.0), dict(budget="100%"),
                                     dict(budget=None, timeline=True)],
                         ids=["bytes", "fraction", "percent", "timeline"])
def test_a_budget_or_a_timeline_keeps_the_hooks(options):
    """A budget must see a step that grows to re-plan within it; a timeline samples per saved tensor."""
    model, run = _train(options)
    assert not run.executor.hookless
    assert model.seen[1:] == [True, True, True]
    assert all(s.hooked and s.activations > 0 for s in run.step_stats)


def test_the_report_says_the_saved_activations_were_not_measured():
    _, run = _train(dict(budget=None))
    text = run.report(file=io.StringIO()).table
    row = next(line for line in text.splitlines() if "peak saved activations" in line)
    assert row.rstrip().rstrip("|").rstrip().endswith("-")
    assert "not measured: a keep-all plan runs without saved-tensor hooks" in text


def test_callers_own_saved_tensor_hooks_work_inside_a_step():
    """With no pair of ours on the stack, save_on_cpu (or checkpoint) around the model is the caller's
    business: the step runs with it, is not a mismatch, and trains as plain PyTorch does."""
    torch.manual_seed(0)
    model = models.build_model("mlp", "small", seed=0)
    ref = models.build_model("mlp", "small", seed=0)
    x, y = models.example_batch("mlp", 4, "small")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "does not match" / "ran plainly" warning
        with optimize(model, opts[0], budget=None) as run:
            for i in range(3):
                if i == 0:
                    models.loss_fn("mlp", model(x), y).backward()
                else:
                    with torch.autograd.graph.save_on_cpu():
                        loss = models.loss_fn("mlp", model(x), y)
                    loss.backward()
                run.step()
    for _ in range(3):
        models.loss_fn("mlp", ref(x), y).backward()
        opts[1].step()
        opts[1].zero_grad(set_to_none=True)
    assert run.mismatches == 0 and run.steps_planned == 2
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.requires_cuda
def test_a_step_that_outgrows_the_device_is_re_profiled(monkeypatch):
    """budget=None keeps all within 90% of the device (Note [Budgets]); a keep-all step above that
    is a mismatch, and two in a row re-profile (Note [A lone mismatching step])."""
    # `import memsched.optimize as m` binds the attribute memsched.optimize -- the function, which
    # shadows its module -- so patching it raised AttributeError; the module is in sys.modules.
    opt_module = sys.modules["memsched.optimize"]
    model = _SeesHooks().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8, device="cuda")
    with optimize(model, opt, budget=None) as run:
        model(x).sum().backward()
        run.step()
        assert run.executor.hookless
        monkeypatch.setattr(opt_module, "_DEVICE_MEMORY_FRACTION", 1e-12)  # every step now "outgrows" it
        with pytest.warns(RuntimeWarning, match="above .* of the device's memory"):
            for _ in range(2):
                model(x).sum().backward()
                run.step()
    assert [s.mode for s in run.step_stats] == ["diverged", "diverged"]
    assert run.mismatches == 2 and run.reprofiles == 1


def test_the_logged_step_figures_leave_out_the_uncounted_saved_activation_peak():
    """A framework callback logs step_figures(run): a keep-all step without hooks counted no saves, so no
    measured saved-activation peak is logged (a 0 would read as 'no memory'); a hooked step's is."""
    from memsched.integrations._common import step_figures
    _, run = _train(dict(budget=None))
    figures = step_figures(run)
    assert "memsched/activation_peak_bytes" not in figures and figures["memsched/planned_step"] == 1.0
    _, hooked = _train(dict(budget=1.0))
    assert step_figures(hooked)["memsched/activation_peak_bytes"] > 0
