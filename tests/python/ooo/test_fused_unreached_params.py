"""Parameters that a step's backward pass does not reach, under the fused update (Note [Gradients
the fused update did not see] in ooo/backward.py). Plain ``optimizer.step()`` updates every
parameter whose .grad is not None: after zeroing in place (``optimizer.zero_grad(set_to_none=False)``,
``model.zero_grad(set_to_none=False)``, ``p.grad = torch.zeros_like(p)``) a branch this step does
not use is still stepped -- momentum, Adam's moments, AdamW's weight decay. Under
``fuse_optimizer=True`` parameters and optimizer state after 4 steps equal plain PyTorch's bitwise,
with and without gradient accumulation; a loop whose zeroing memsched cannot see (by hand, in place)
is refused before its next backward pass changes anything."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched
from memsched.ooo import OutOfOrderBackward

OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}
STEPS = 4


class Branchy(nn.Module):
    """Layer `even` is used on even steps, `odd` on odd ones (a step is `period` backward passes),
    `never` never: every step leaves parameters unreached."""

    def __init__(self, period=1):
        super().__init__()
        self.period = period
        self.a, self.even, self.odd, self.never = (nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16),
                                                   nn.Linear(16, 16))
        self.c = nn.Linear(16, 4)
        self.calls = 0

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = (self.even if (self.calls // self.period) % 2 == 0 else self.odd)(h)
        self.calls += 1
        return self.c(h)


def _batch(s):
    g = torch.Generator().manual_seed(100 + s)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def _zero_by_hand(model):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()


def _zeros_like_by_hand(model):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


# How the loop zeroes after each optimizer step. Plain PyTorch holds a zero .grad afterwards.
ZEROING = {
    "optimizer_keyword": lambda m, opt: opt.zero_grad(set_to_none=False),
    "optimizer_positional": lambda m, opt: opt.zero_grad(False),
    "optimizer_class_call": lambda m, opt: torch.optim.Optimizer.zero_grad(opt, set_to_none=False),
    "model": lambda m, opt: m.zero_grad(set_to_none=False),
    "model_positional": lambda m, opt: m.zero_grad(False),
    "submodules": lambda m, opt: [c.zero_grad(set_to_none=False) for c in m.children()],
    "zeros_like_by_hand": lambda m, opt: _zeros_like_by_hand(m),
}


def _twins(opt_name, accumulation=1):
    torch.manual_seed(0)
    base = Branchy(accumulation)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    for p in list(a.parameters()) + list(b.parameters()):  # zero .grads, as after zero_grad(set_to_none=False)
        p.grad = torch.zeros_like(p)
    return a, OPTIMIZERS[opt_name](a.parameters()), b, OPTIMIZERS[opt_name](b.parameters())


def _train(m, opt, zeroing, accumulation, step=None):
    """The plain loop; `step` replaces optimizer.step() (None: the optimizer's own, routed through
    memsched.optimize when it is active)."""
    for s in range(STEPS * accumulation):
        x, y = _batch(s)
        F.cross_entropy(m(x), y).backward()
        if (s + 1) % accumulation == 0:
            (step or opt.step)()
            ZEROING[zeroing](m, opt)


def assert_plain(a, oa, b, ob):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{n}: max |diff| {(p - q).abs().max().item():.3g}"
        sa, sb = oa.state[p], ob.state[q]
        assert sa.keys() == sb.keys(), n
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), (n, k)


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("zeroing", sorted(ZEROING))
def test_unreached_parameters_are_stepped_as_plain(zeroing, opt_name, accumulation):
    a, oa, b, ob = _twins(opt_name, accumulation)
    _train(a, oa, zeroing, accumulation)
    assert oa.state[a.never.weight]  # plain stepped the never-used layer (weight decay, momentum)
    with memsched.optimize(b, ob, fuse_optimizer=True, grad_accumulation_steps=accumulation):
        _train(b, ob, zeroing, accumulation)
    assert_plain(a, oa, b, ob)


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("zeroing", ["optimizer_keyword", "model", "zeros_like_by_hand"])
def test_out_of_order_backward_alone_steps_unreached_parameters_as_plain(zeroing, accumulation):
    a, oa, b, ob = _twins("adamw", accumulation)
    _train(a, oa, zeroing, accumulation)
    with OutOfOrderBackward(b, ob, fuse_optimizer=True, grad_accumulation_steps=accumulation) as ooo:
        for s in range(STEPS * accumulation):
            x, y = _batch(s)
            F.cross_entropy(b(x), y).backward()
            ooo.step()
            if (s + 1) % accumulation == 0:
                ZEROING[zeroing](b, ob)
    assert_plain(a, oa, b, ob)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_zeroing_memsched_cannot_see_is_refused_before_the_next_backward(accumulation):
    _, _, b, ob = _twins("adamw", accumulation)
    with memsched.optimize(b, ob, fuse_optimizer=True, grad_accumulation_steps=accumulation):
        for k in range(2):  # the profiled step, updated at ob.step(), then the first fused one
            for s in range(accumulation):
                x, y = _batch(s)
                F.cross_entropy(b(x), y).backward()
            ob.step()
            _zero_by_hand(b)  # plain holds zeros now; after the fused update .grad is None: no-op
        before = [p.detach().clone() for p in b.parameters()]
        x, y = _batch(accumulation)
        loss = F.cross_entropy(b(x), y)
        with pytest.raises(memsched.MemschedError, match=r"zero_grad\(set_to_none=False\).*p\.grad\.zero_\(\)"):
            loss.backward()
        del loss
        for p, q in zip(before, b.parameters()):  # refused before anything changed
            assert torch.equal(p, q)
            assert q.grad is None
