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


def test_a_scaler_subclass_with_its_own_scale_is_refused_too():
    """torch.distributed.fsdp's ShardedGradScaler defines its own scale(): the fused update stepped with
    gradients multiplied by the loss scale, without a word (found by a helper)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    model = _model()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True):
        with pytest.raises(memsched.MemschedError, match=r"GradScaler.scale\(\).*Nothing was scaled or stepped"):
            ShardedGradScaler("cpu", init_scale=1024.0).scale(model(torch.randn(4, 8)).sum())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert "scale" in ShardedGradScaler.__dict__ and ShardedGradScaler.scale.__module__.startswith("torch.")


@pytest.mark.parametrize("entry", ["OutOfOrderBackward", "optimize"])
def test_a_scale_bound_before_install_is_refused_at_unscale_naming_what_ran(entry):
    """`scale = scaler.scale` taken before the update was installed escapes the class patch: scaler.step()
    then failed with torch's 'No inf checks were recorded' after the fused update had stepped with scaled
    gradients. unscale_() now says so -- or, at memsched.optimize's first step (which updates after
    backward), that nothing was stepped."""
    model = _model()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scale = scaler.scale
    ctx = (OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True) if entry == "OutOfOrderBackward"
           else memsched.optimize(model, opt, fuse_optimizer=True))
    with pytest.raises(memsched.MemschedError, match=r"GradScaler.unscale_\(\).*bound before") as info:
        with ctx:
            scale(model(torch.randn(4, 8)).sum()).backward()
            scaler.step(opt)
    if entry == "OutOfOrderBackward":
        assert "already stepped the parameters" in str(info.value)
    else:
        assert "nothing was stepped" in str(info.value)
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k
