"""Refusals of the out-of-order backward name their real cause, before any parameter changes."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched
from memsched import MemschedError


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 5))


@pytest.mark.parametrize("make", [lambda p: torch.optim.Adagrad(p), lambda p: torch.optim.LBFGS(p)],
                         ids=["Adagrad", "LBFGS"])
def test_unsupported_fused_optimizer_refused_by_optimize(make):
    m = _model()
    with pytest.raises(MemschedError, match=r"optimizer: fuse_optimizer=True supports torch.optim.SGD"):
        memsched.optimize(m, make(m.parameters()), fuse_optimizer=True)  # not only at `with`
    memsched.optimize(m, make(m.parameters()), ooo=True)  # unfused: any optimizer


def test_gradient_penalty_refusal_names_double_backward():
    m = _model()
    before = [p.detach().clone() for p in m.parameters()]
    x, y = torch.randn(8, 16, requires_grad=True), torch.randint(0, 5, (8,))
    with memsched.optimize(m, torch.optim.AdamW(m.parameters()), ooo=True):
        out = m(x)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        with pytest.raises(MemschedError, match=r"double backward.*create_graph=True"):
            (F.cross_entropy(out, y) + gx.pow(2).mean()).backward()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))
