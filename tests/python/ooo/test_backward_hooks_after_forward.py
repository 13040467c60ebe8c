"""Gradient hooks a caller registers on a parameter between the forward pass and its backward
(Note [Parameters with gradient hooks] in ooo/backward.py). A layer whose forward already ran
deferred cannot hand its weight gradient to autograd any more: the backward pass is refused with a
MemschedError naming the parameter and the fix, before any gradient or parameter changed; the hook
registered before the next forward then sees the whole gradient and training is bitwise plain's.
A post-accumulate-grad hook registered after the forward on a parameter autograd handles runs
before the fused update, as in plain PyTorch."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched

HOOKS = {
    "tensor_hook": lambda p: p.register_hook(lambda g: g * 0.5),
    "post_accumulate_hook": lambda p: p.register_post_accumulate_grad_hook(
        lambda q: torch.nn.utils.clip_grad_value_(q, 1e-3)),
}
FLAGS = {"ooo": dict(ooo=True), "fused": dict(fuse_optimizer=True)}


def _batch(s):
    g = torch.Generator().manual_seed(300 + s)
    return torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 5))


@pytest.mark.parametrize("flags", sorted(FLAGS))
@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_hook_registered_after_forward_on_a_deferred_layer_is_refused_up_front(hook, flags):
    m = _net()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    with memsched.optimize(m, opt, **FLAGS[flags]) as run:
        for s in range(2):
            x, y = _batch(s)
            F.cross_entropy(m(x), y).backward()
            run.step()
        before = [p.detach().clone() for p in m.parameters()]
        state = {k: v.clone() for k, v in opt.state[m[0].weight].items()}
        x, y = _batch(2)
        loss = F.cross_entropy(m(x), y)
        handle = HOOKS[hook](m[0].weight)
        with pytest.raises(memsched.MemschedError, match=r"0\.weight.*after the forward.*before the forward"):
            loss.backward()
        del loss
        for p, q in zip(before, m.parameters()):
            assert torch.equal(p, q)
            assert q.grad is None
        assert all(torch.equal(v, opt.state[m[0].weight][k]) for k, v in state.items())
        handle.remove()


def _train(m, opt, hook, run=None):
    handles = []
    for s in range(4):
        x, y = _batch(s)
        if s == 2:  # from now on the hook is in place before the forward pass
            handles.append(HOOKS[hook](m[0].weight))
        F.cross_entropy(m(x), y).backward()
        if run is not None:
            run.step()
        else:
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("flags", sorted(FLAGS))
@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_after_the_refusal_a_hook_registered_before_forward_trains_as_plain(hook, flags):
    a, b = _net(), _net()
    oa, ob = torch.optim.AdamW(a.parameters(), lr=0.1), torch.optim.AdamW(b.parameters(), lr=0.1)
    _train(a, oa, hook)
    with memsched.optimize(b, ob, **FLAGS[flags]) as run:
        x, y = _batch(99)
        loss = F.cross_entropy(b(x), y)
        h = HOOKS[hook](b[0].weight)
        with pytest.raises(memsched.MemschedError):
            loss.backward()
        del loss
        h.remove()
        ob.zero_grad()
        _train(b, ob, hook, run)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{n}: max |diff| {(p - q).abs().max().item():.3g}"


@pytest.mark.parametrize("flags", sorted(FLAGS))
def test_post_accumulate_hook_after_forward_on_an_autograd_parameter_runs_before_the_update(flags):
    a, b = _net(), _net()
    oa, ob = torch.optim.AdamW(a.parameters(), lr=0.1), torch.optim.AdamW(b.parameters(), lr=0.1)
    seen_a, seen_b = [], []

    def loop(m, opt, seen, run=None):
        for s in range(3):
            x, y = _batch(s)
            loss = F.cross_entropy(m(x), y)

            def clip(q):
                seen.append(q.grad.clone())
                torch.nn.utils.clip_grad_value_(q, 1e-3)

            # LayerNorm's: parameters autograd handles; the second to accumulate completes the fused unit
            hs = [p.register_post_accumulate_grad_hook(clip) for p in m[1].parameters()]
            loss.backward()
            for h in hs:
                h.remove()
            if run is not None:
                run.step()
            else:
                opt.step()
                opt.zero_grad()

    loop(a, oa, seen_a)
    with memsched.optimize(b, ob, **FLAGS[flags]) as run:
        loop(b, ob, seen_b, run)
    assert len(seen_a) == len(seen_b) == 6
    assert all(torch.equal(g, h) for g, h in zip(seen_a, seen_b))
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{n}: max |diff| {(p - q).abs().max().item():.3g}"
