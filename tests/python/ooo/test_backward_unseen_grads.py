"""Gradients no backward pass of the out-of-order backward delivered (Note [Gradients the fused
update did not see] in ooo/backward.py): zero gradients of unused parameters under
zero_grad(set_to_none=False), and gradients from torch.autograd.grad set by hand. Parameters and
optimizer step counts bitwise equal to plain PyTorch after 3 AdamW steps."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched


class Branchy(nn.Module):
    """A layer used on even steps, one on odd steps, one never: unused parameters per step."""

    def __init__(self):
        super().__init__()
        self.a, self.even, self.odd, self.never = (nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16),
                                                   nn.Linear(16, 16))
        self.c = nn.Linear(16, 4)
        self.step = 0

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = (self.even if self.step % 2 == 0 else self.odd)(h)
        self.step += 1
        return self.c(h)


def _batch(s):
    g = torch.Generator().manual_seed(s)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def _assert_plain(a, oa, b, ob):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{n}: max |diff| {(p - q).abs().max().item():.3g}"
        assert oa.state[p].get("step") == ob.state[q].get("step"), n


def _twins():
    torch.manual_seed(0)
    base = Branchy()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    return a, torch.optim.AdamW(a.parameters(), lr=1e-2), b, torch.optim.AdamW(b.parameters(), lr=1e-2)


@pytest.mark.parametrize("prefill", [False, True], ids=["grads_none_at_start", "zero_grads_at_start"])
@pytest.mark.parametrize("loop", ["optimizer_step", "run_step"])
def test_fused_steps_zero_gradients_as_plain(loop, prefill):
    a, oa, b, ob = _twins()
    if prefill:  # a zero .grad on every parameter, "never" included
        for p in list(a.parameters()) + list(b.parameters()):
            p.grad = torch.zeros_like(p)
    for s in range(3):
        F.cross_entropy(a(_batch(s)[0]), _batch(s)[1]).backward()
        oa.step()
        oa.zero_grad(set_to_none=False)
    with memsched.optimize(b, ob, fuse_optimizer=True) as run:
        for s in range(3):
            F.cross_entropy(b(_batch(s)[0]), _batch(s)[1]).backward()
            if loop == "run_step":
                run.step()
            else:
                ob.step()
            ob.zero_grad(set_to_none=False)
    _assert_plain(a, oa, b, ob)
    # Steps 2 and 3 ran the C++ Adam update (Note [Adam update in C++]) next to the leftovers' Python one.
    assert run.ooo_.report()["fused_updates_in_cpp"] > 0


def test_fused_set_to_none_leaves_unused_parameters_alone():
    a, oa, b, ob = _twins()
    for s in range(3):
        F.cross_entropy(a(_batch(s)[0]), _batch(s)[1]).backward()
        oa.step()
        oa.zero_grad()
    with memsched.optimize(b, ob, fuse_optimizer=True):
        for s in range(3):
            F.cross_entropy(b(_batch(s)[0]), _batch(s)[1]).backward()
            ob.step()
            ob.zero_grad()
    _assert_plain(a, oa, b, ob)
    assert "step" not in ob.state[b.never.weight]


@pytest.mark.parametrize("loop", ["optimizer_step", "run_step"])
@pytest.mark.parametrize("flags", [dict(ooo=True), dict(fuse_optimizer=True)], ids=["ooo", "fused"])
def test_autograd_grad_set_by_hand_is_stepped(flags, loop):
    a, oa, b, ob = _twins()

    def one_step(m, opt, s, run=None):
        params = [p for p in m.parameters()]
        grads = torch.autograd.grad(F.cross_entropy(m(_batch(s)[0]), _batch(s)[1]), params, allow_unused=True)
        for p, g in zip(params, grads):
            p.grad = g
        if run is not None:
            run.step()
        else:
            opt.step()
            opt.zero_grad()

    for s in range(3):
        one_step(a, oa, s)
    with memsched.optimize(b, ob, **flags) as run:
        for s in range(3):
            one_step(b, ob, s, run if loop == "run_step" else None)
    _assert_plain(a, oa, b, ob)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_optimizer_parameters_outside_the_model_are_stepped_by_the_fused_update(accumulation):
    # was: a learned temperature in the optimizer but not in the model was never updated (run.step() skips
    # optimizer.step() after a fused update, and the fused update stepped only the model's parameters)
    def setup():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        temperature = nn.Parameter(torch.tensor(1.5))
        return model, temperature, torch.optim.AdamW(list(model.parameters()) + [temperature], lr=0.1)

    def loss(model, temperature, s):
        x, y = _batch(s)
        return F.cross_entropy(model(x) / temperature, y) / accumulation

    model, temperature, opt = setup()
    for step in range(3):
        for micro in range(accumulation):
            loss(model, temperature, step * accumulation + micro).backward()
        opt.step()
        opt.zero_grad()
    twin, twin_temperature, twin_opt = setup()
    with memsched.optimize(twin, twin_opt, fuse_optimizer=True, grad_accumulation_steps=accumulation) as run:
        for step in range(3):
            for micro in range(accumulation):
                loss(twin, twin_temperature, step * accumulation + micro).backward()
                run.step()
    assert torch.equal(temperature, twin_temperature) and twin_temperature.item() != 1.5
    assert twin_temperature.grad is None
    _assert_plain(model, opt, twin, twin_opt)
    assert opt.state[temperature]["step"] == twin_opt.state[twin_temperature]["step"]


@pytest.mark.parametrize("how", ["add_param_group", "append_to_group", "swap"])
def test_optimizer_parameters_outside_the_model_found_again_when_groups_change(how):
    # _step_outside keeps the optimizer's parameters outside the model from one pass to the next and looks
    # again only when a group's parameters changed: one added between steps (a new group, or appended to
    # a group's list in place, or one of the model's replaced by it at the same position) is stepped by the
    # fused update from the step it joins, as plain optimizer.step() steps it
    def setup():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        temperature = nn.Parameter(torch.tensor(1.5))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        return model, temperature, opt

    def join(model, temperature, opt):
        if how == "add_param_group":
            opt.add_param_group({"params": [temperature]})
        elif how == "append_to_group":
            opt.param_groups[0]["params"].append(temperature)
        else:  # the last layer's bias leaves the optimizer, the temperature takes its place
            opt.param_groups[0]["params"][-1] = temperature

    def loss(model, temperature, s):
        x, y = _batch(s)
        return F.cross_entropy(model(x) / temperature, y)

    model, temperature, opt = setup()
    for step in range(4):
        if step == 2:
            join(model, temperature, opt)
        loss(model, temperature, step).backward()
        opt.step()
        opt.zero_grad()
    twin, twin_temperature, twin_opt = setup()
    with memsched.optimize(twin, twin_opt, fuse_optimizer=True) as run:
        for step in range(4):
            if step == 2:
                join(twin, twin_temperature, twin_opt)
            loss(twin, twin_temperature, step).backward()
            run.step()
    assert twin_temperature.item() != 1.5
    assert torch.equal(temperature, twin_temperature)
    assert opt.state[temperature]["step"] == twin_opt.state[twin_temperature]["step"]
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), f"{n}: max |diff| {(p - q).abs().max().item():.3g}"
