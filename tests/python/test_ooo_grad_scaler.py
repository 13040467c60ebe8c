"""GradScaler cannot be combined with a fused update (Note [GradScaler and
fused updates]): it is refused before anything is scaled or stepped, and works
again -- unchanged -- once memsched is removed or without fusion."""
import copy

import pytest
import torch
import torch.nn as nn

import memsched
from memsched.ooo import OutOfOrderBackward


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_scaler_refused_with_fused_update_before_any_step():
    model = _model()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True):
        loss = model(torch.randn(4, 8)).sum()
        with pytest.raises(memsched.MemschedError, match="fuse_optimizer=False with a GradScaler"):
            scaler.scale(loss)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # nothing was stepped
    assert torch.amp.GradScaler.scale.__module__ == "torch.amp.grad_scaler"  # restored on exit


def test_scaler_untouched_without_fusion_and_when_disabled():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=False):
        assert torch.amp.GradScaler.scale.__module__ == "torch.amp.grad_scaler"
        scaled = torch.amp.GradScaler("cpu").scale(torch.ones(2))
        assert torch.equal(scaled, torch.full((2,), 65536.0))
    with OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True):
        disabled = torch.amp.GradScaler("cpu", enabled=False)
        assert torch.equal(disabled.scale(torch.ones(2)), torch.ones(2))
