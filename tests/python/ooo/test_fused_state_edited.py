"""``optimizer.state`` edited by hand between steps under the fused update with Adam/AdamW (Note
[Adam plan for the C++ update] in ooo/fused.py): the moments reset as warm restarts do
(``state[p].clear()``, ``state[p] = {}``, ``del state[p]``), one state tensor replaced (exp_avg,
exp_avg_sq, max_exp_avg_sq, step), a state dict replaced by a copy. Plain torch.optim re-creates
the state or uses the new tensors at its next step; the C++ update's kept plan must not go on
updating the old ones. Parameters and optimizer state (what state_dict() saves) stay bitwise plain
PyTorch's."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched
from memsched.ooo import OutOfOrderBackward

from test_fused_unreached_params import _batch, assert_plain

STEPS = 5
OPTIMIZERS = {
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True),
}


def _clear(opt, p):
    opt.state[p].clear()


def _assign_empty(opt, p):
    opt.state[p] = {}


def _delete(opt, p):
    del opt.state[p]


def _replace(key, make):
    def edit(opt, p):
        if key in opt.state[p]:
            opt.state[p][key] = make(opt.state[p][key])
    return edit


def _assign_copy(opt, p):
    opt.state[p] = {k: v.clone() for k, v in opt.state[p].items()}


EDITS = {
    "clear": _clear,
    "assign_empty": _assign_empty,
    "delete": _delete,
    "exp_avg": _replace("exp_avg", torch.zeros_like),
    "exp_avg_sq": _replace("exp_avg_sq", lambda t: torch.full_like(t, 1e-4)),
    "max_exp_avg_sq": _replace("max_exp_avg_sq", lambda t: torch.full_like(t, 1e-4)),
    "step": _replace("step", lambda t: torch.tensor(0.0)),
    "assign_copy": _assign_copy,
}
# which parameters are edited: all of them, or only the last layer's weight
WHICH = {"all": lambda m: list(m.parameters()), "one": lambda m: [m[2].weight]}


def _twins(opt_name):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    return a, OPTIMIZERS[opt_name](a), b, OPTIMIZERS[opt_name](b)


def _train(m, opt, step, edit, which, at=(2,)):
    for s in range(STEPS):
        x, y = _batch(s)
        F.cross_entropy(m(x), y).backward()
        step()
        if s in at:  # after the step that made the kept plan current
            for p in WHICH[which](m):
                edit(opt, p)


@pytest.mark.parametrize("which", sorted(WHICH))
@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_state_edited_by_hand_is_used_as_plain_uses_it(opt_name, edit, which):
    if edit == "max_exp_avg_sq" and opt_name != "adam_amsgrad":
        pytest.skip("only amsgrad keeps max_exp_avg_sq")
    a, oa, b, ob = _twins(opt_name)
    _train(a, oa, lambda: (oa.step(), oa.zero_grad()), EDITS[edit], which)
    with OutOfOrderBackward(b, ob, fuse_optimizer=True) as ooo:
        _train(b, ob, ooo.step, EDITS[edit], which)
        assert ooo.report()["fused_updates_in_cpp"] > 0
    assert_plain(a, oa, b, ob)
    assert ob.state_dict()["state"].keys() == oa.state_dict()["state"].keys()


@pytest.mark.parametrize("edit", ["clear", "exp_avg", "step"])
def test_state_edited_twice_under_optimize(edit):
    a, oa, b, ob = _twins("adamw")
    _train(a, oa, lambda: (oa.step(), oa.zero_grad()), EDITS[edit], "all", at=(1, 3))
    with memsched.optimize(b, optimizer=ob, fuse_optimizer=True) as run:
        _train(b, ob, run.step, EDITS[edit], "all", at=(1, 3))
    assert_plain(a, oa, b, ob)


def test_the_plan_is_kept_without_edits_and_built_again_after_one():
    a, oa, b, ob = _twins("adamw")
    built = []
    _train(a, oa, lambda: (oa.step(), oa.zero_grad()), _replace("exp_avg", torch.zeros_like), "one")
    with OutOfOrderBackward(b, ob, fuse_optimizer=True) as ooo:
        def step():
            ooo.step()
            built.append(ooo._stepper.plans_built)
        _train(b, ob, step, _replace("exp_avg", torch.zeros_like), "one")
    # step 1: no state yet; step 2: the plan; step 3 kept; the edit after step 3: built again, then kept
    assert built == [1, 2, 2, 3, 3]
    assert_plain(a, oa, b, ob)
