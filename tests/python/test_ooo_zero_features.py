"""Out-of-order backward of a Linear layer with zero features (AdaptiveLogSoftmaxWithLoss makes them)."""
import copy

import torch
import torch.nn as nn

import memsched


def test_linear_with_zero_features_defers_its_weight_gradient_bitwise():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 0, bias=False), nn.Linear(0, 4))
    twin = copy.deepcopy(model)
    x = torch.randn(3, 6, requires_grad=True)
    opt = torch.optim.AdamW(twin.parameters(), lr=0.1)
    twin(x).pow(2).sum().backward()
    opt.step()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with memsched.OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True) as ooo:
        model(x).pow(2).sum().backward()
        ooo.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
