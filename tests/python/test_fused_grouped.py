"""The fused update's grouped path (ParamStepper.step_params through torch's functional optimizer,
See Note [Grouped step through torch's functional optimizer]): bitwise equal to plain PyTorch after
3 optimizer steps for SGD / Adam / AdamW and their options, with gradient accumulation 1, 2 and 4,
an LR scheduler changing lr between steps, and an optimizer.state_dict() that equals plain's and
loads; step hooks and a replaced step() take the Optimizer.step() view path."""
import copy

import pytest
import torch
import torch.nn as nn

from memsched import models
from memsched.ooo import OutOfOrderBackward, ParamStepper
from ooo_helpers import assert_same_state, batches, ooo_loop, plain_loop

CONFIGS = {
    "sgd_momentum_nesterov_wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                                          weight_decay=1e-2),
    "sgd_dampening_maximize": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, dampening=0.1, maximize=True),
    "sgd_plain": lambda p: torch.optim.SGD(p, lr=0.05),
    "adam_amsgrad_wd": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=1e-2),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.95)),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw_amsgrad_maximize": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True, maximize=True),
}


def _twin(name, make):
    a = models.build_model(name, seed=1)
    b = copy.deepcopy(a)
    return a, make(a.parameters()), b, make(b.parameters())


def _assert_same_state_dict(oa, ob):
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        assert sa["state"][k].keys() == sb["state"][k].keys()
        for key, v in sa["state"][k].items():
            w = sb["state"][k][key]
            if torch.is_tensor(v):
                assert v.dtype == w.dtype and v.device == w.device and torch.equal(v, w), (k, key)
            else:
                assert v == w, (k, key)


def _no_view_path(stepper):
    def refuse(*a, **k):
        raise AssertionError("the Optimizer.step() view path ran; the grouped functional path was expected")
    stepper._view_step = refuse


@pytest.mark.parametrize("accumulation", [1, 2, 4])
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_grouped_fused_update_equals_plain_bitwise(name, config, accumulation):
    a, oa, b, ob = _twin(name, CONFIGS[config])
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=1, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=1, gamma=0.5)
    data = batches(name, 3 * accumulation)
    plain_loop(a, oa, name, data, accumulation=accumulation, scheduler=sa)
    calls = []
    with OutOfOrderBackward(b, optimizer=ob, fuse_optimizer=True, grad_accumulation_steps=accumulation) as ooo:
        _no_view_path(ooo._stepper)
        orig = ooo._stepper.step_params
        ooo._stepper.step_params = lambda ps: (calls.append(len(ps)), orig(ps))
        for k, (x, y) in enumerate(data):
            models.loss_fn(name, b(x), y).backward()
            assert ooo.step() is False
            if (k + 1) % accumulation == 0:
                sb.step()
    assert ob.param_groups[0]["lr"] == oa.param_groups[0]["lr"] != ob.defaults["lr"]  # the schedule ran
    assert_same_state(a, oa, b, ob)
    _assert_same_state_dict(oa, ob)
    n = len(list(b.parameters()))
    assert ooo.report()["fused_updates"] == 3 * n
    # weight and bias of a layer in one call; Adam/AdamW: after the first step (which creates
    # torch's state) the update runs in C++ (test_fused_native.py)
    native = ooo.report()["fused_updates_in_cpp"]
    assert sum(calls) + native == 3 * n and max(calls) >= 2
    assert native == (0 if config.startswith("sgd") else 2 * n)
    assert all(p.grad is None for p in b.parameters())


@pytest.mark.parametrize("config", ["sgd_momentum_nesterov_wd", "adam_amsgrad_wd", "adamw"])
def test_state_dict_of_a_fused_run_loads_and_training_continues_bitwise(config):
    make = CONFIGS[config]
    a, oa, b, ob = _twin("transformer", make)
    data = batches("transformer", 6)
    plain_loop(a, oa, "transformer", data[:3])
    ooo_loop(b, ob, "transformer", data[:3], fuse=True)
    _assert_same_state_dict(oa, ob)
    # a checkpoint of the fused run loads into a fresh optimizer, and on into a plain run
    c = copy.deepcopy(b)
    oc = make(c.parameters())
    oc.load_state_dict(copy.deepcopy(ob.state_dict()))  # load_state_dict keeps same-device tensors: no sharing
    plain_loop(a, oa, "transformer", data[3:])
    plain_loop(c, oc, "transformer", data[3:])
    ooo_loop(b, ob, "transformer", data[3:], fuse=True)
    assert_same_state(a, oa, b, ob)
    assert_same_state(a, oa, c, oc)


def test_lambda_lr_per_group_and_no_scheduler_warning():
    def make(m):
        return torch.optim.AdamW([{"params": m.layers.parameters()},
                                  {"params": m.head.parameters(), "lr": 3e-2, "weight_decay": 0.0}], lr=1e-2)

    a = models.build_model("mlp", seed=2)
    b = copy.deepcopy(a)
    oa, ob = make(a), make(b)
    sa = torch.optim.lr_scheduler.LambdaLR(oa, [lambda k: 1.0 / (1 + k), lambda k: 0.9 ** k])
    sb = torch.optim.lr_scheduler.LambdaLR(ob, [lambda k: 1.0 / (1 + k), lambda k: 0.9 ** k])
    data = batches("mlp", 3)
    plain_loop(a, oa, "mlp", data, scheduler=sa)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would raise
        ooo_loop(b, ob, "mlp", data, scheduler=sb)
    assert_same_state(a, oa, b, ob)
    _assert_same_state_dict(oa, ob)


@pytest.mark.parametrize("kind", ["instance", "global"])
def test_step_hooks_run_on_the_view_path_bitwise(kind):
    a, oa, b, ob = _twin("mlp", CONFIGS["adamw"])
    pre, post = [], []
    if kind == "instance":
        hs = [ob.register_step_pre_hook(lambda o, args, kw: pre.append(len(o.param_groups[0]["params"]))),
              ob.register_step_post_hook(lambda o, args, kw: post.append(1))]
    else:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        hs = [register_optimizer_step_pre_hook(
                  lambda o, args, kw: pre.append(len(o.param_groups[0]["params"])) if o is ob else None),
              register_optimizer_step_post_hook(lambda o, args, kw: post.append(1) if o is ob else None)]
    try:
        data = batches("mlp", 3)
        plain_loop(a, oa, "mlp", data)
        ooo_loop(b, ob, "mlp", data, fuse=True)
    finally:
        for h in hs:
            h.remove()
    assert_same_state(a, oa, b, ob)
    n = len(list(b.parameters()))
    # once per grouped call, each seeing a view with the parameters of that call
    assert len(pre) == len(post) > 0 and sum(pre) == 3 * n and max(pre) == 2


def test_a_replaced_step_is_called():
    a, oa, b, ob = _twin("mlp", CONFIGS["sgd_momentum_nesterov_wd"])
    calls = []
    stock = ob.step

    def step(*args, **kw):
        calls.append(1)
        return stock(*args, **kw)

    ob.step = step
    data = batches("mlp", 3)
    plain_loop(a, oa, "mlp", data)
    ooo_loop(b, ob, "mlp", data, fuse=True)
    assert_same_state(a, oa, b, ob)
    assert len(calls) > 0


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    lambda p: torch.optim.Adam(p, lr=0.01, foreach=True, amsgrad=True),
    lambda p: torch.optim.AdamW(p, lr=torch.tensor(0.01), foreach=False),
    lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
])
def test_step_params_honours_explicit_foreach_and_fused(make):
    torch.manual_seed(0)
    ps_a = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(2, 2))]
    ps_b = [nn.Parameter(p.detach().clone()) for p in ps_a]
    oa, ob = make(ps_a), make(ps_b)
    stepper = ParamStepper(ob)
    _no_view_path(stepper)
    for _ in range(3):
        for p, q in zip(ps_a, ps_b):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        oa.step()
        stepper.step_params(ps_b[:2])
        stepper.step_params(ps_b[2:])
    for p, q in zip(ps_a, ps_b):
        assert torch.equal(p, q)
    _assert_same_state_dict(oa, ob)
    assert stepper.steps == 9 and stepper.calls == 6
