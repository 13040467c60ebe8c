"""memsched's warnings point at the caller's line (Note [Warnings point at the caller's code]), whether
they are raised by a call of the caller's or from a hook torch runs several frames below it."""
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched
from memsched.optimize import optimize


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if "memsched" in str(w.message)]


def test_a_warning_from_a_call_of_the_callers_points_at_its_line():
    model = torch.compile(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    caught = _caught(lambda: optimize(model, opt, budget=None).__exit__(None, None, None))
    assert caught and all(w.filename == __file__ for w in caught), [(w.filename, w.lineno) for w in caught]


def test_a_warning_from_a_saved_tensor_hook_points_at_the_callers_line():
    """A step that does not match the plan is found in the pack hook, inside autograd; called through a
    wrapper module, a fixed stacklevel pointed into the wrapper's forward in torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with optimize(model, opt, budget=0.5, planner="dp", max_shape_plans=1) as run:
        for batch in (4, 4):
            model(torch.randn(batch, 8)).sum().backward()
            run.step()
        caught = _caught(lambda: nn.DataParallel(model)(torch.randn(6, 8)).sum().backward())
        run.step()
    mismatch = [w for w in caught if "does not match" in str(w.message)]
    assert mismatch and all(w.filename == __file__ for w in mismatch), [(w.filename, w.lineno) for w in caught]


def test_a_warning_from_a_forward_pre_hook_points_at_the_callers_line():
    """A forward under no_grad after the fused update and before step(), found in the root pre-hook: called
    through a wrapper module (DataParallel here, DDP or the caller's own), a fixed stacklevel pointed into
    the wrapper's forward in torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    with memsched.OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True) as ooo:
        F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            caught = _caught(lambda: nn.DataParallel(model)(x))
        ooo.step()
    assert [w for w in caught if "updated parameters" in str(w.message)]
    assert all(w.filename == __file__ for w in caught), [(w.filename, w.lineno) for w in caught]


def test_a_warning_raised_through_accelerates_step_points_at_the_callers_line():
    """The fused update's late-edit warning, at the step boundary reached through accelerate's
    AcceleratedOptimizer.step(), pointed into accelerate/optimizer.py (found by a helper)."""
    import pytest
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with optimize(model, opt, fuse_optimizer=True):
            for i in range(3):
                accelerator.backward(F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))))
                if i == 2:
                    opt.param_groups[0]["lr"] = 5e-3  # too late for this step's fused update: warned
                opt.step()
                opt.zero_grad()
    late = [w for w in caught if "between the backward pass and the step boundary" in str(w.message)]
    assert late and all(w.filename == __file__ for w in late), [(w.filename, w.lineno) for w in caught]
