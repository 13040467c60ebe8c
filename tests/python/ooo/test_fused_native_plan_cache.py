"""The C++ Adam update's per-parameter plan (Note [Adam plan for the C++ update] in ooo/fused.py) is
built once and kept from one backward pass to the next; what changes it -- a parameter whose state
torch creates later (a branch first used at a later step), optimizer.load_state_dict, a param group
added, an LR scheduler's new lr -- gets a fresh plan (or fresh hyper-parameters). Parameters and
optimizer state stay bitwise plain PyTorch's throughout."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from memsched.ooo import OutOfOrderBackward

from test_fused_unreached_params import Branchy, _batch, assert_plain


def _pair(make_opt, model=None):
    torch.manual_seed(0)
    base = model if model is not None else nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    return a, make_opt(a), b, make_opt(b)


def _step(m, s):
    x, y = _batch(s)
    F.cross_entropy(m(x), y).backward()


def _plain(a, oa, steps, between=None, scheduler=None):
    for s in range(steps):
        if between is not None:
            between(s, a, oa)
        _step(a, s)
        oa.step()
        oa.zero_grad()
        if scheduler is not None:
            scheduler.step()


def _fused(b, ob, steps, between=None, scheduler=None):
    """Trains under the fused update; returns plans_built after each step."""
    built = []
    with OutOfOrderBackward(b, ob, fuse_optimizer=True) as ooo:
        for s in range(steps):
            if between is not None:
                between(s, b, ob)
            _step(b, s)
            ooo.step()
            if scheduler is not None:
                scheduler.step()
            built.append(ooo._stepper.plans_built)
        assert ooo.report()["fused_updates_in_cpp"] > 0
    return built


@pytest.mark.parametrize("opt", ["adam", "adamw"])
def test_the_plan_is_built_once_in_steady_state(opt):
    make = {"adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
            "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)}[opt]
    a, oa, b, ob = _pair(make)
    _plain(a, oa, 6)
    # step 1: no state yet (torch creates it; nothing for C++); step 2: the plan; then kept
    assert _fused(b, ob, 6) == [1, 2, 2, 2, 2, 2]
    assert_plain(a, oa, b, ob)


def test_a_new_learning_rate_reaches_the_kept_plan():
    a, oa, b, ob = _pair(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1))
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=1, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=1, gamma=0.5)
    _plain(a, oa, 5, scheduler=sa)
    assert _fused(b, ob, 5, scheduler=sb)[-1] == 2
    assert_plain(a, oa, b, ob)


def test_a_branch_first_used_later_gets_a_fresh_plan():
    a, oa, b, ob = _pair(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), Branchy())
    _plain(a, oa, 5)
    # step 2 plans without `odd` (no state: stepped in Python, which creates it); step 3 plans
    # again with it; `never` never gets state and changes nothing
    assert _fused(b, ob, 5) == [1, 2, 3, 3, 3]
    assert_plain(a, oa, b, ob)


def test_a_loaded_state_dict_gets_a_fresh_plan():
    a, oa, b, ob = _pair(lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))
    saved = {}

    def between(s, m, opt):
        if s == 2:
            saved[id(m)] = copy.deepcopy(opt.state_dict())
        if s == 4:  # back to the state after step 2: the plan's old tensors must not be updated
            opt.load_state_dict(saved[id(m)])

    _plain(a, oa, 6, between)
    built = _fused(b, ob, 6, between)
    assert built[3] == 2 and built[4] == 3
    assert_plain(a, oa, b, ob)


def test_a_param_group_added_gets_a_fresh_plan():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    a, b = copy.deepcopy(base), copy.deepcopy(base)

    def make(m):
        return torch.optim.AdamW(m[0].parameters(), lr=1e-2)

    def between(s, m, opt):
        if s == 2:
            opt.add_param_group({"params": list(m[2].parameters()), "lr": 3e-3})

    oa, ob = make(a), make(b)
    _plain(a, oa, 5, between)
    built = _fused(b, ob, 5, between)
    assert built[2] < built[3]  # the new group's parameters got state at step 3: planned again
    assert_plain(a, oa, b, ob)
