"""A convolution under out-of-order backward leaves the weight gradient in the weight's layout, as
autograd's AccumulateGrad does, so torch's fused optimizer kernels read it in the right order (Note
[Conv weight gradients in the weight's layout] in python/memsched/ooo/backward.py)."""
import copy

import pytest
import torch
import torch.nn as nn

from ooo_helpers import weighted_sum_steps

CL = {2: torch.channels_last, 3: torch.channels_last_3d}

CASES = {
    # nd, dtype, input channels_last, weight channels_last, groups, batch
    "2d_float32_channels_last_input": (2, torch.float32, True, False, 2, 1),
    "3d_float64_channels_last_weight": (3, torch.float64, False, True, 1, 2),
}


class Net(nn.Module):
    def __init__(self, nd, dtype, x_cl, groups):
        super().__init__()
        conv = nn.Conv2d if nd == 2 else nn.Conv3d
        self.pre = conv(2, 4, 1, dtype=dtype)
        self.conv = conv(4, 6, 3, stride=2, padding=1, groups=groups, dtype=dtype)
        self.x_cl = CL[nd] if x_cl else None

    def forward(self, z):
        h = torch.tanh(self.pre(z))
        if self.x_cl is not None:
            h = h.contiguous(memory_format=self.x_cl)
        return self.conv(h)


def _train(model, nd, under):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    shape, dtype = (2, 2) + (6,) * nd, model.pre.weight.dtype
    return weighted_sum_steps(model, opt, lambda g: torch.randn(shape, generator=g, dtype=dtype),
                              dict(fuse_optimizer=under == "fuse") if under else None, keep_grads=True)


@pytest.mark.parametrize("under", ["ooo", "fuse"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_conv_weight_gradient_keeps_the_weights_layout(case, under):
    nd, dtype, x_cl, w_cl, groups, _ = CASES[case]
    torch.manual_seed(0)
    plain = Net(nd, dtype, x_cl, groups)
    if w_cl:
        plain.conv.to(memory_format=CL[nd])
    model = copy.deepcopy(plain)
    want = _train(plain, nd, None)
    got = _train(model, nd, under)
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p, q), f"max |diff| {(p - q).abs().max().item():.3g}"
    if under == "ooo":
        for gw, gg in zip(want, got):
            for a, b in zip(gw, gg):
                assert torch.equal(a, b) and a.stride() == b.stride(), (a.stride(), b.stride())


@pytest.mark.parametrize("fuse", [False, True])
def test_a_length_one_input_with_non_canonical_strides_gets_the_weights_layout(fuse):
    """x of shape [B, C, 1] made by transposing a [B, 1, C] tensor is contiguous (size-1 dimensions have
    no stride to check) with strides (C, 1, C); oneDNN then returns the Conv1d weight gradient in another
    layout, and AdamW(fused=True) read it in the weight's order: 0.67 off after four steps (found by
    fuzzing). The runtime stores it as AccumulateGrad does (Note [Deferred gradients in their parameter's
    layout] in csrc/torch/dw_runtime.h)."""
    from memsched.ooo import OutOfOrderBackward
    torch.manual_seed(0)
    plain = nn.Conv1d(16, 16, 3, padding=1, bias=False)
    model = copy.deepcopy(plain)
    xs = [torch.randn(2, 1, 16, generator=torch.Generator().manual_seed(k)).transpose(1, 2) for k in range(4)]
    assert xs[0].is_contiguous() and xs[0].stride() == (16, 1, 16)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, fused=True) for m in (plain, model)]
    for x in xs:
        plain(x).pow(2).mean().backward()
        opts[0].step()
        opts[0].zero_grad(set_to_none=True)
    with OutOfOrderBackward(model, optimizer=opts[1], fuse_optimizer=fuse) as ooo:
        for x in xs:
            model(x).pow(2).mean().backward()
            if not fuse:
                assert model.weight.grad.stride() == model.weight.stride()
            if ooo.step():
                opts[1].step()
            opts[1].zero_grad(set_to_none=True)
        assert ooo.report()["deferred_items"] > 0
    assert torch.equal(plain.weight, model.weight), f"max |diff| {(plain.weight - model.weight).abs().max().item():.3g}"
