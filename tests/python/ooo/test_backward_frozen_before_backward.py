"""A parameter frozen after the forward and before backward (Note [A parameter frozen between its forward
and backward] in csrc/torch/dw_runtime.h): AccumulateGrad drops that pass's gradient, so .grad stays as it
was and the optimizer leaves the parameter alone; the out-of-order backward wrote the deferred gradient
and the fused update stepped it (0.019 off plain)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched
from test_backward_tied import Tied, _batches as _tied_batches

FLAGS = [dict(ooo=True), dict(fuse_optimizer=True), dict(ooo=True, grad_accumulation_steps=2),
         dict(fuse_optimizer=True, grad_accumulation_steps=2)]
IDS = ["ooo", "fused", "ooo-accumulate2", "fused-accumulate2"]


def _train(model, opt, batches, loss_of, freeze, step, accumulate):
    """Freezes `freeze(model)` between the forward and backward of micro-batch 2 (of the second step when
    accumulating, so the frozen parameter's .grad holds micro-batch 1's gradient); records every .grad."""
    grads = []
    for i, batch in enumerate(batches):
        loss = loss_of(model, batch) / accumulate
        frozen = freeze(model) if i == 2 else []
        for p in frozen:
            p.requires_grad_(False)
        loss.backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        for p in frozen:
            p.requires_grad_(True)
        if (i + 1) % accumulate == 0:
            step()
            opt.zero_grad()
    return grads


def _check(base, batches, loss_of, freeze, flags):
    accumulate = flags.get("grad_accumulation_steps", 1)
    plain, m = copy.deepcopy(base), copy.deepcopy(base)
    po, mo = torch.optim.AdamW(plain.parameters(), lr=1e-2), torch.optim.AdamW(m.parameters(), lr=1e-2)
    expected = _train(plain, po, batches, loss_of, freeze, po.step, accumulate)
    with memsched.optimize(m, mo, **flags) as run:
        got = _train(m, mo, batches, loss_of, freeze, run.step, accumulate)
    for step, (a, b) in enumerate(zip(expected, got)):
        for ga, gb in zip(a, b):
            # (the fused update may have consumed .grad: compare where memsched keeps it)
            if gb is not None or not flags.get("fuse_optimizer"):
                assert (ga is None) == (gb is None) and (ga is None or torch.equal(ga, gb)), step
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q), f"max |diff| {(p - q).abs().max().item():.3g}"


@pytest.mark.parametrize("flags", FLAGS, ids=IDS)
def test_a_layer_frozen_before_backward_gets_no_gradient_as_in_plain(flags):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(6)]
    _check(base, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]), lambda m: list(m[0].parameters()), flags)


@pytest.mark.parametrize("flags", FLAGS[:2], ids=IDS[:2])
def test_a_tied_weight_frozen_before_backward_keeps_its_gradient_as_in_plain(flags):
    """A weight with deferred and autograd uses (an embedding tied to a head): its autograd gradient's
    AccumulateGrad runs no post-accumulate hook once frozen, so nothing may be parked for one."""
    torch.manual_seed(0)
    base = Tied(3)
    batches = _tied_batches() + _tied_batches()
    _check(base, batches, lambda m, b: m(*b).pow(2).mean(), lambda m: [m.emb.weight], flags)
