"""A Linear under out-of-order backward gives autograd's gradients bit for bit whatever the layout of its
input and of the gradient reaching its output (Note [Linear inputs that at::linear reduces in another
order] in python/memsched/ooo/backward.py)."""
import pytest
import torch
import torch.nn as nn

from memsched.ooo import OutOfOrderBackward


def _input(layout):
    g = torch.Generator().manual_seed(3)
    if layout == "2d":
        return torch.randn(512, 32, generator=g)
    if layout == "2d_transposed":
        return torch.randn(32, 512, generator=g).t()
    if layout == "3d":
        return torch.randn(32, 16, 32, generator=g)
    if layout == "3d_transposed":  # a [T, B, D] view of [B, T, D]: at::linear runs matmul + add_
        return torch.randn(16, 32, 32, generator=g).transpose(0, 1)
    return torch.randn(4, 8, 16, 32, generator=g).permute(1, 0, 2, 3)  # "4d_permuted"


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layout", ["2d", "2d_transposed", "3d", "3d_transposed", "4d_permuted"])
@pytest.mark.parametrize("grad_layout", ["contiguous", "transposed"])
def test_linear_gradients_are_autograds_bitwise(layout, grad_layout, bias):
    x0 = _input(layout)
    grads = []
    for deferred in (False, True):
        torch.manual_seed(0)
        lin = nn.Linear(32, 64, bias=bias)
        x = torch.empty_strided(x0.size(), x0.stride()).copy_(x0).requires_grad_(True)  # x0's layout
        ooo = OutOfOrderBackward(lin).install() if deferred else None
        try:
            out = lin(x)
            if grad_layout == "transposed":  # the output gradient arrives as a transposed view
                out = out.transpose(0, 1).contiguous()
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
            (out * w).sum().backward()
        finally:
            if ooo is not None:
                ooo.remove()
        grads.append([p.grad for p in lin.parameters()] + [x.grad])
    assert all(torch.equal(a, b) for a, b in zip(*grads)), [torch.equal(a, b) for a, b in zip(*grads)]
