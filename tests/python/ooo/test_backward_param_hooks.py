"""Gradient hooks on parameters under the out-of-order backward (Note [Parameters with gradient
hooks] in ooo/backward.py): a tensor hook sees the whole gradient and a post-accumulate-grad hook
the accumulated .grad before a fused update, as in plain PyTorch -- registered before or after the
wrapper was installed. Parameters bitwise equal to plain PyTorch after 3 steps."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched


def _data():
    return [(torch.randn(8, 16, generator=torch.Generator().manual_seed(s)),
             torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(100 + s))) for s in range(3)]


def _scale(m):
    for p in m.parameters():
        p.register_hook(lambda g: g * 0.5)


def _scale_none_ok(m):
    for p in m.parameters():
        p.register_hook(lambda g: None if g is None else g * 0.5)


def _clip_value(m):  # what memsched's clip_grad_norm_ refusal recommends under fuse_optimizer=True
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(lambda q: torch.nn.utils.clip_grad_value_(q, 1e-3))


def _only_first_layer(m):
    m[0].weight.register_hook(lambda g: g * 0.25)


HOOKS = {"scale": _scale, "scale_none_ok": _scale_none_ok, "clip_value": _clip_value,
         "first_layer_only": _only_first_layer}
FLAGS = {"ooo": dict(ooo=True), "fused": dict(fuse_optimizer=True)}


def _train_both(hook, flags, when):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 5))
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    HOOKS[hook](a)
    oa, ob = torch.optim.AdamW(a.parameters(), lr=0.1), torch.optim.AdamW(b.parameters(), lr=0.1)
    for x, y in _data():
        F.cross_entropy(a(x), y).backward()
        oa.step()
        oa.zero_grad()
    if when == "before":
        HOOKS[hook](b)
    with memsched.optimize(b, ob, **FLAGS[flags]) as run:
        if when == "after":
            HOOKS[hook](b)
        for x, y in _data():
            F.cross_entropy(b(x), y).backward()
            run.step()
    return a, b


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("flags", sorted(FLAGS))
@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_parameter_hooks_see_plain_gradients(hook, flags, when):
    a, b = _train_both(hook, flags, when)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{n}: max |diff| {(p - q).abs().max().item():.3g}"


def test_layer_without_hooks_stays_deferred():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 5))
    _only_first_layer(m)
    opt = torch.optim.AdamW(m.parameters())
    with memsched.OutOfOrderBackward(m, opt, fuse_optimizer=True) as ooo:
        x, y = _data()[0]
        F.cross_entropy(m(x), y).backward()
        ooo.step()
        # layer 2 (weight and bias) and layer 1's bias deferred; layer 1 ran plainly: 2 items
        assert ooo.report()["deferred_items"] == 1
