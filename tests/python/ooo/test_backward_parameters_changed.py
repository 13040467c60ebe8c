"""A layer's weight gradient is routed to the parameter it had when OutOfOrderBackward was installed, so a
weight tied to another layer's or replaced since is refused at the next forward, naming the layer and the
fix, before anything changes (Note [Parameters added or unfrozen after install] in
python/memsched/ooo/backward.py). Before, a mid-run tie trained silently wrong (5e-4 off after three steps)
and a replaced Parameter raised a raw TypeError."""
import pytest
import torch
import torch.nn as nn

from memsched import MemschedError
from memsched.ooo import OutOfOrderBackward


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _step(model, ooo, opt=None):
    model(torch.randn(3, 8)).square().sum().backward()
    if ooo.step() and opt is not None:
        opt.step()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("change, words", [
    (lambda m: setattr(m[2], "weight", m[0].weight),
     "layer '2': its parameter 'weight' is now a Parameter another layer owns (tied)"),
    (lambda m: setattr(m[2], "weight", nn.Parameter(m[2].weight.detach().clone())),
     "layer '2': its parameter 'weight' was replaced by another Parameter"),
])
@pytest.mark.parametrize("fuse", [False, True])
def test_a_parameter_changed_after_install_is_refused_before_anything_changes(change, words, fuse):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=fuse) as ooo:
        _step(model, ooo, opt)
        change(model)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(MemschedError, match=words.replace("(", r"\(").replace(")", r"\)")):
            model(torch.randn(3, 8))
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        with pytest.raises(MemschedError, match="install"):  # every later forward too, until installed again
            model(torch.randn(3, 8))


def test_a_parameter_added_after_install_is_named_as_new():
    model = _model()
    with OutOfOrderBackward(model) as ooo:
        _step(model, ooo)
        model.append(nn.Linear(4, 2))
        with pytest.raises(MemschedError, match=r"parameter 5\.weight was added to the model"):
            model(torch.randn(3, 8))


def test_training_after_installing_again_follows_the_new_tie():
    model = _model()
    plain = _model()
    for m in (model, plain):
        m[2].weight = m[0].weight
    with OutOfOrderBackward(model) as ooo:
        _step(model, ooo)
    plain(torch.randn(3, 8)).square().sum().backward()  # same seed order is not needed: compare gradients
    torch.manual_seed(1)
    x = torch.randn(3, 8)
    plain.zero_grad(set_to_none=True)
    plain(x).square().sum().backward()
    with OutOfOrderBackward(model) as ooo:
        model(x).square().sum().backward()
        for p, q in zip(plain.parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("fuse", [False, True])
def test_a_bias_set_to_none_after_install_trains_as_plain(fuse):
    """`layer.bias = None` registers no parameter (torch fires no registration hook): the layer just stops
    using its bias, as in plain PyTorch, where it crashed reading bias.requires_grad."""
    model, plain = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    xs = [torch.randn(3, 8) for _ in range(3)]
    with OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=fuse) as ooo:
        for k, x in enumerate(xs):
            if k == 1:
                model[4].bias = None
                plain[4].bias = None
            model(x).square().sum().backward()
            if ooo.step():
                opt.step()
            opt.zero_grad(set_to_none=True)
            plain(x).square().sum().backward()
            plain_opt.step()
            plain_opt.zero_grad(set_to_none=True)
    for p, q in zip(plain_opt.param_groups[0]["params"], opt.param_groups[0]["params"]):
        assert torch.equal(p, q)
