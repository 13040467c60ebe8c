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


def test_gradient_penalty_refused_naming_double_backward():
    m = _model()
    before = [p.detach().clone() for p in m.parameters()]
    x, y = torch.randn(8, 16, requires_grad=True), torch.randint(0, 5, (8,))
    with memsched.optimize(m, torch.optim.AdamW(m.parameters()), ooo=True):
        out = m(x)
        with pytest.raises(RuntimeError, match=r"create_graph=True \(double backward") as caught:
            (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)  # refused here, at once
        assert "a functional call" not in str(caught.value)  # not blamed on a functional use
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))


def test_fused_second_backward_over_retained_graph_names_its_cause():
    m = _model()
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    with memsched.optimize(m, torch.optim.AdamW(m.parameters()), fuse_optimizer=True):
        out = m(x)
        F.cross_entropy(out, y).backward(retain_graph=True)
        with pytest.raises(RuntimeError, match=r"second backward pass over a graph whose backward already ran") \
                as caught:
            out.pow(2).mean().backward()
    assert "plain PyTorch raises the same" not in str(caught.value)  # plain PyTorch does not raise here
