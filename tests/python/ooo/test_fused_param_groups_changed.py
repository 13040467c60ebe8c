"""Param groups edited in place between steps under the fused update (fuse_optimizer=True): a
parameter moved from one existing group to another, two parameters swapped between groups (every
group keeps its size), a group's ``params`` list replaced, a parameter removed. Plain
``optimizer.step()`` reads the groups at every call, so from then on the parameter is stepped with
its new group's lr (a removed one not at all); so must the fused update -- the grouped Python path
(SGD) and the C++ Adam plan (Note [Adam plan for the C++ update] in ooo/fused.py) alike.
Parameters and optimizer state stay bitwise plain PyTorch's."""
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
    "sgd_momentum": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
}


def _move(opt):
    """The last Linear's bias goes from group 1 (lr 1e-3) to group 0 (lr 1e-2)."""
    opt.param_groups[0]["params"].append(opt.param_groups[1]["params"].pop())


def _swap(opt):
    """Group 0's first bias and group 1's weight trade places: both groups keep their sizes."""
    g0, g1 = opt.param_groups[0]["params"], opt.param_groups[1]["params"]
    g0[1], g1[0] = g1[0], g0[1]


def _new_lists(opt):
    """Both groups get new ``params`` lists: the first Linear's bias joins group 1."""
    g0, g1 = opt.param_groups[0]["params"], opt.param_groups[1]["params"]
    opt.param_groups[0]["params"] = [g0[0]]
    opt.param_groups[1]["params"] = [g0[1]] + list(g1)


def _remove(opt):
    """The last Linear's bias leaves the optimizer: plain steps it no more (its .grad accumulates)."""
    opt.param_groups[1]["params"].pop()


EDITS = {"move": _move, "swap": _swap, "new_lists": _new_lists, "remove": _remove}


def _make(opt_name, model):
    ps = list(model.parameters())
    return OPTIMIZERS[opt_name]([{"params": ps[:2], "lr": 1e-2}, {"params": ps[2:], "lr": 1e-3}])


def _twins(opt_name):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    return a, _make(opt_name, a), b, _make(opt_name, b)


def _train(m, opt, edit, step):
    for s in range(STEPS):
        if s == 2:
            edit(opt)
        x, y = _batch(s)
        F.cross_entropy(m(x), y).backward()
        step()


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_parameter_moved_to_another_group_is_stepped_with_its_new_group(edit, opt_name):
    a, oa, b, ob = _twins(opt_name)
    _train(a, oa, EDITS[edit], lambda: (oa.step(), oa.zero_grad()))
    with OutOfOrderBackward(b, ob, fuse_optimizer=True) as ooo:
        _train(b, ob, EDITS[edit], ooo.step)
        if opt_name != "sgd_momentum":
            assert ooo.report()["fused_updates_in_cpp"] > 0
    assert_plain(a, oa, b, ob)


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw"])
def test_a_parameter_moved_to_another_group_under_optimize(opt_name):
    a, oa, b, ob = _twins(opt_name)
    _train(a, oa, _move, lambda: (oa.step(), oa.zero_grad()))
    with memsched.optimize(b, optimizer=ob, fuse_optimizer=True) as run:
        _train(b, ob, _move, run.step)
    assert_plain(a, oa, b, ob)
