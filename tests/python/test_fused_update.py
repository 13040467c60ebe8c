"""Fused optimizer update (memsched.ooo with fuse_optimizer=True) on CPU: after
five steps parameters and optimizer state are bitwise those of a plain loop;
gradient accumulation fuses on the last micro-step only; LR schedulers work;
global norm clipping is refused with guidance; gradient memory."""
import copy

import pytest
import torch
import torch.nn as nn

import memsched
from memsched import models
from memsched.ooo import OutOfOrderBackward, ParamStepper
from ooo_helpers import OPTIMIZERS, assert_same_state, batches, ooo_loop, plain_loop, twin


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_five_fused_steps_equal_plain_loop_bitwise(name, opt_name):
    a, oa, b, ob = twin(name, opt_name)
    data = batches(name, 5)
    plain_loop(a, oa, name, data)
    ooo = ooo_loop(b, ob, name, data, fuse=True)
    assert_same_state(a, oa, b, ob)
    r = ooo.report()
    n_params = len(list(b.parameters()))  # tied weight counted once
    assert r["fused_updates"] == 5 * n_params
    assert all(p.grad is None for p in b.parameters())  # gradients freed by the fused update


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_gradient_accumulation_fuses_on_last_micro_step_only(name):
    a, oa, b, ob = twin(name, "adamw")
    data = batches(name, 6)
    plain_loop(a, oa, name, data, accumulation=3)
    before = [p.detach().clone() for p in b.parameters()]
    with OutOfOrderBackward(b, optimizer=ob, fuse_optimizer=True, grad_accumulation_steps=3) as ooo:
        for k, (x, y) in enumerate(data):
            models.loss_fn(name, b(x), y).backward()
            assert ooo.step() is False
            if k == 0:  # first micro-step: nothing updated, gradients accumulate
                assert all(torch.equal(p, q) for p, q in zip(b.parameters(), before))
                assert all(p.grad is not None for p in b.parameters())
            if k == 2:  # last micro-step: updated, gradients freed
                assert not any(torch.equal(p, q) for p, q in zip(b.parameters(), before))
                assert all(p.grad is None for p in b.parameters())
    assert_same_state(a, oa, b, ob)
    assert ooo.report()["fused_updates"] == 2 * len(list(b.parameters()))


def test_lr_schedulers_keep_working():
    a, oa, b, ob = twin("mlp", "sgd_momentum")
    sa = torch.optim.lr_scheduler.LambdaLR(oa, lambda k: 1.0 / (1 + k))
    sb = torch.optim.lr_scheduler.LambdaLR(ob, lambda k: 1.0 / (1 + k))
    data = batches("mlp", 5)
    plain_loop(a, oa, "mlp", data, scheduler=sa)
    ooo_loop(b, ob, "mlp", data, scheduler=sb)
    assert ob.param_groups[0]["lr"] == pytest.approx(0.05 / 6)
    assert_same_state(a, oa, b, ob)


def test_param_groups_with_their_own_hyperparameters():
    a = models.build_model("mlp")
    b = copy.deepcopy(a)

    def make(m):
        return torch.optim.Adam([{"params": m.layers.parameters(), "lr": 1e-3},
                                 {"params": m.head.parameters(), "lr": 1e-2, "amsgrad": True}])

    oa, ob = make(a), make(b)
    data = batches("mlp", 5)
    plain_loop(a, oa, "mlp", data)
    ooo_loop(b, ob, "mlp", data)
    assert_same_state(a, oa, b, ob)


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, dampening=0.1, maximize=True),
    lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True, weight_decay=0.01),
    lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.9)),
])
def test_param_stepper_equals_full_step(make):
    torch.manual_seed(0)
    ps_a = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
    ps_b = [nn.Parameter(p.detach().clone()) for p in ps_a]
    oa, ob = make(ps_a), make(ps_b)
    stepper = ParamStepper(ob)
    for k in range(3):
        grads = [torch.randn_like(p) for p in ps_a]
        for p, q, g in zip(ps_a, ps_b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        oa.step()
        for q in reversed(ps_b):  # order does not matter: parameters are independent
            stepper.step(q)
            assert q.grad is None
    for p, q in zip(ps_a, ps_b):
        assert torch.equal(p, q)
        for key in oa.state[p]:
            assert torch.equal(torch.as_tensor(oa.state[p][key]), torch.as_tensor(ob.state[q][key]))
    assert stepper.steps == 6
    assert ob.param_groups[0]["params"] == ps_b  # the real groups are back


def test_global_norm_clipping_cannot_be_fused():
    m = models.build_model("mlp")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(memsched.MemschedError, match="cannot be fused") as e:
        OutOfOrderBackward(m, optimizer=opt, fuse_optimizer=True, max_grad_norm=1.0)
    assert "clip_grad_norm_" in str(e.value) and "fuse_optimizer=False" in str(e.value)


def test_without_fusion_max_grad_norm_clips_before_the_callers_step():
    a, oa, b, ob = twin("mlp", "sgd_momentum")
    data = batches("mlp", 3)
    for x, y in data:
        models.loss_fn("mlp", a(x), y).backward()
        torch.nn.utils.clip_grad_norm_(a.parameters(), 0.05)
        oa.step()
        oa.zero_grad()
    ooo_loop(b, ob, "mlp", data, fuse=False, max_grad_norm=0.05)
    assert_same_state(a, oa, b, ob)


class DeepMlp(nn.Module):
    """8 equal Linear(64, 64) layers: each holds 64*64*4 + 64*4 = 16640 gradient bytes."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)])

    def forward(self, x):
        return self.layers(x)


def _plain_peak_grad_bytes(model, step):
    """Max over the step of bytes held by .grad, sampled after every accumulation."""
    peak = [0]

    def hook(_):
        peak[0] = max(peak[0], sum(q.grad.numel() * q.grad.element_size() for q in model.parameters()
                                   if q.grad is not None))

    handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()]
    step()
    for h in handles:
        h.remove()
    return peak[0]


def test_fused_update_holds_one_layers_gradient_at_a_time():
    torch.manual_seed(0)
    a = DeepMlp()
    b = copy.deepcopy(a)
    x = torch.randn(16, 64)
    oa = torch.optim.Adam(a.parameters())
    plain = _plain_peak_grad_bytes(a, lambda: a(x).square().mean().backward())
    assert plain == 8 * 16640  # every gradient alive when optimizer.step() runs
    oa.step()
    oa.zero_grad()
    a(x).square().mean().backward()
    with OutOfOrderBackward(b, optimizer=torch.optim.Adam(b.parameters()), fuse_optimizer=True) as ooo:
        # the first iteration is watched and updates at the end of backward (Note [The first fused
        # iteration watches its parameter reads] in ooo/backward.py), as plain PyTorch's step does
        b(x).square().mean().backward()
        assert ooo.report()["peak_grad_bytes"] == plain
        ooo.step()
        # independent of the executor's count: .grad bytes visible after each accumulation
        fused = _plain_peak_grad_bytes(b, lambda: b(x).square().mean().backward())
    # a layer's weight and bias are stepped together (one grouped call) once both AccumulateGrads
    # ran: one layer's gradient (64*64*4 + 64*4 bytes) is in .grad at a time
    assert fused == 16640
    assert ooo.report()["peak_grad_bytes"] == 16640
    assert ooo.report()["peak_grad_bytes"] <= 0.125 * plain
    oa.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("fuse", [False, True])
def test_stream_executor_matches_plain_on_cuda(fuse):
    """dW on a side stream (+ fused AdamW there): equal to plain up to cuBLAS
    algorithm choice for a separate dW call (rounding, not bitwise)."""
    dev = "cuda"
    a = models.build_model("transformer", device=dev)
    b = copy.deepcopy(a)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-3)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-3)
    data = [(x.to(dev), y.to(dev)) for x, y in batches("transformer", 5)]
    plain_loop(a, oa, "transformer", data)
    ooo = ooo_loop(b, ob, "transformer", data, fuse=fuse)
    assert ooo.report()["executor"] == "stream"
    torch.cuda.synchronize()
    assert_same_state(a, oa, b, ob, exact=False)


def test_clip_grad_norm_after_a_fused_backward_is_refused_not_silently_skipped():
    # See Note [Clipping and fused updates]: the gradients are already used and freed.
    a = models.build_model("mlp", seed=0)
    other = torch.nn.Linear(3, 3)
    other(torch.randn(2, 3)).sum().backward()
    opt = torch.optim.AdamW(a.parameters(), lr=1e-3)
    x, y = models.example_batch("mlp", 4, seed=0)
    original = torch.nn.utils.clip_grad_norm_
    with OutOfOrderBackward(a, optimizer=opt, fuse_optimizer=True) as ooo:
        models.loss_fn("mlp", a(x), y).backward()
        with pytest.raises(memsched.MemschedError, match="clip_grad_norm_.*fuse_optimizer=False"):
            torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)  # not ooo's: clipped as usual
        torch.nn.utils.clip_grad_norm_(a.parameters(), float("inf"))  # only measures (Trainer's grad_norm log)
        ooo.step()
    assert torch.nn.utils.clip_grad_norm_ is original and torch.nn.utils.clip_grad.clip_grad_norm_ is original
