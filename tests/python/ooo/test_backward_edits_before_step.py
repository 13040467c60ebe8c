"""Edits between loss.backward() and the step boundary under the fused update (Note [Edits between
backward and the step boundary] in ooo/backward.py): the update already ran during backward with
the hyper-parameters and parameter values of then, so a learning rate set after backward, a
scheduler stepped before the optimizer, or a parameter edited in place there trains differently
from plain PyTorch. memsched warns once, naming the change; a loop that makes its changes before
backward gets no warning and trains as plain."""
import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import memsched


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batches(n=3):
    g = torch.Generator().manual_seed(5)
    return [torch.randn(4, 8, generator=g) for _ in range(n)]


def _late_edit_warnings(edit, fuse=True):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memsched.optimize(model, opt, ooo=True, fuse_optimizer=fuse) as run:
            for k, x in enumerate(_batches()):
                model(x).square().sum().backward()
                edit(model, opt, sched, k)
                run.step()
                if edit is _scheduler_after_step:
                    sched.step()
    return [str(w.message) for w in caught if "between the backward pass and the step boundary" in str(w.message)]


def _set_lr(model, opt, sched, k):
    opt.param_groups[0]["lr"] = 1e-2 * (k + 1)  # a warm-up written between backward and step


def _scheduler_first(model, opt, sched, k):
    sched.step()  # before the optimizer's step (the first fused update is step 2's: the profiled step's is not)


def _clamp(model, opt, sched, k):
    with torch.no_grad():
        model[0].weight.clamp_(-0.1, 0.1)


def _scheduler_after_step(model, opt, sched, k):
    pass  # the scheduler steps after run.step(): the usual order


@pytest.mark.parametrize("edit, named", [(_set_lr, "lr 0.01 -> 0.02"), (_scheduler_first, "lr 0.005 -> 0.0025"),
                                         (_clamp, "parameter 0.weight was modified in place")],
                         ids=["lr-set-after-backward", "scheduler-before-optimizer", "clamp-after-backward"])
def test_an_edit_after_the_fused_update_warns_once_naming_it(edit, named):
    caught = _late_edit_warnings(edit)
    assert len(caught) == 1, caught
    assert named in caught[0] and "fuse_optimizer=False" in caught[0]


@pytest.mark.parametrize("edit", [_scheduler_after_step, _set_lr], ids=["usual-order", "without-fusion"])
def test_no_warning_where_the_step_sees_the_edit(edit):
    caught = _late_edit_warnings(edit, fuse=edit is _scheduler_after_step)
    assert caught == []


def test_a_second_optimizer_stepping_other_parameters_after_backward_is_not_warned_and_trains_as_plain():
    """The head trained by its own SGD, stepped between backward and the boundary as in plain PyTorch: the
    fused update never steps it, yet its version change was reported as a late edit of a parameter the
    update had already stepped 'with the values of before'."""
    def train(model, run=None):
        body = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
        head = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
        with memsched.optimize(model, body, ooo=True, fuse_optimizer=True) if run else contextlib.nullcontext() as r:
            for x in _batches():
                model(x).square().sum().backward()
                head.step()
                head.zero_grad()
                if r is not None:
                    r.step()
                else:
                    body.step()
                    body.zero_grad()

    ref, model = _model(), _model()
    train(ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, run=True)
    assert not [w for w in caught if "step boundary" in str(w.message)], [str(w.message) for w in caught]
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n


def test_a_scheduler_stepped_after_the_boundary_trains_as_plain():
    """The warning-free order is the one whose parameters equal plain PyTorch's."""
    ref = _model()
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x in _batches():
        ref(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with memsched.optimize(model, opt, ooo=True, fuse_optimizer=True) as run:
        for x in _batches():
            model(x).square().sum().backward()
            run.step()
            sched.step()
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n


def test_optimizer_step_hooks_under_the_fused_update_warn_once():
    """They run once per stepped layer on a one-layer view of the group (a hook halving the lr halved the
    view's: 1e-2 off plain, with no word); said once, at the first fused backward pass."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memsched.optimize(model, opt, ooo=True, fuse_optimizer=True) as run:
            for x in _batches():
                model(x).square().sum().backward()
                run.step()
    named = [str(w.message) for w in caught if "step hooks" in str(w.message)]
    assert len(named) == 1 and "once per layer" in named[0], named
    assert len(calls) > len(_batches())  # (the profiled step's own optimizer.step(), then per layer)
