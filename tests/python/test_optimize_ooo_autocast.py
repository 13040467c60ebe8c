"""memsched.optimize with out-of-order backward under bf16 autocast: the profiled step after which ooo begins
deferring autocast calls (Note [Deferred calls under autocast] in python/memsched/ooo/backward.py) is not
planned from -- its trace holds autograd's saves, which the deferred steps do not make -- and the next step is
profiled instead. Before, every such Run had two plain steps (a mismatch warning) and spent a re-profile."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import memsched


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64, bias=False))


def _steps(model, opt, run=None, steps=5):
    for k in range(steps):
        x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(k))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        if run is not None:
            run.step()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("fuse", [False, True])
def test_ooo_under_autocast_profiles_again_once_and_then_runs_the_plan(fuse):
    plain, model = _model(), _model()
    _steps(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no mismatch warning
        with memsched.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), budget=0.7, ooo=True,
                               fuse_optimizer=fuse) as run:
            _steps(model, None, run)
    assert (run.steps_profiled, run.steps_planned, run.steps_plain) == (2, 3, 0)
    assert run.cast_warmup_profiles_ == 1 and run.reprofiles == 0
    assert run.ooo_.report()["deferred_items"] > 0
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_run_report_says_what_out_of_order_backward_did(capsys):
    model = _model()
    with memsched.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), budget=0.7, ooo=True,
                           fuse_optimizer=True) as run:
        _steps(model, None, run, steps=3)
    run.report()
    out = capsys.readouterr().out
    # an item per layer call (weight and bias together), from the second backward pass on: 2 + 2
    assert "out-of-order backward (inline executor): 2 eligible layers, 4 weight-gradient items deferred over " \
           "3 backward passes; " in out
    assert "fused parameter updates" in out and "the first profile was dropped" in out
