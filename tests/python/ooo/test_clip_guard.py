"""Clipping under the fused update (python/memsched/ooo/clip_guard.py, Note [Clipping and fused updates]):
every torch.nn.utils clipping call that would clip nothing of the parameters the fused update already
stepped is refused, not silently skipped; where it still sees the whole gradient it clips as usual."""
import pytest
import torch
import torch.nn as nn

import memsched
from memsched.ooo import OutOfOrderBackward


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(32, 8, generator=g)


def test_clip_grad_value_after_the_fused_update_is_refused_not_silently_partial():
    # model[2].bias is outside the optimizer, so it keeps its gradient: clip_grad_value_ clipped that one
    # alone, after the others were stepped unclipped (with none left, torch raised an internal error)
    model = _model()
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "2.bias"], lr=0.05)
    original = torch.nn.utils.clip_grad_value_
    with OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True) as ooo:
        model(_batch(0)).square().mean().backward()
        with pytest.raises(memsched.MemschedError, match="clip_grad_value_.*register_post_accumulate_grad_hook"):
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        torch.nn.utils.clip_grad_value_(model[2].bias, 1e-3)  # not the fused update's: clipped as usual
        assert model[2].bias.grad.abs().max() <= 1e-3
        ooo.step()
    assert torch.nn.utils.clip_grad_value_ is original and torch.nn.utils.clip_grad.clip_grad_value_ is original


def test_clip_grads_with_norm_after_the_fused_update_is_refused():
    # get_total_norm over the freed gradients is 0 and clip_grads_with_norm_ clipped nothing
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    original = torch.nn.utils.clip_grads_with_norm_
    with OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True) as ooo:
        model(_batch(0)).square().mean().backward()
        params = list(model.parameters())
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        with pytest.raises(memsched.MemschedError, match="clip_grads_with_norm_.*fuse_optimizer=False"):
            torch.nn.utils.clip_grads_with_norm_(params, 0.1, norm)
        ooo.step()
    assert torch.nn.utils.clip_grads_with_norm_ is original


def test_clip_grad_norm_bound_by_name_before_install_is_refused_not_silently_skipped():
    """`from torch.nn.utils import clip_grad_norm_` binds torch's own function before memsched patches the
    module attribute: it clipped the freed gradients, nothing, and trained unclipped (7.6e-2 off plain
    after 5 SGD steps). Its second half, a module global, refuses now; after remove() it clips again."""
    from torch.nn.utils import clip_grad_norm_  # as a script's imports bind it, before any install

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with memsched.optimize(model, opt, ooo=True, fuse_optimizer=True) as run:
        for i in range(2):  # the profiled step, then a fused one
            model(_batch(i)).square().mean().backward()
            if i == 0:
                run.step()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(memsched.MemschedError, match=r"clip_grad_norm_ on parameters.*fuse_optimizer=False"):
            clip_grad_norm_(model.parameters(), 0.05)
        assert clip_grad_norm_(model.parameters(), float("inf")) == 0  # measuring only is not refused
        run.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # the refusal changed nothing
    model(_batch(3)).square().mean().backward()
    assert clip_grad_norm_(model.parameters(), 0.05) > 0.05  # torch's own again, outside the `with`
    assert torch.nn.utils.clip_grad._clip_grads_with_norm_ is torch.nn.utils.clip_grads_with_norm_


def test_clip_grad_value_before_the_last_micro_step_clips_as_plain():
    """With accumulation the gradients of the micro-steps before the last are still there: clipped as in
    plain PyTorch, bitwise."""
    def train(fused):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ooo = OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True, grad_accumulation_steps=2) \
            if fused else None
        if ooo is not None:
            ooo.install()
        try:
            for i in range(4):
                model(_batch(i)).square().mean().backward()
                if i % 2 == 0:
                    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
                if ooo is not None:
                    ooo.step()
                elif i % 2 == 1:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        finally:
            if ooo is not None:
                ooo.remove()
        return model

    plain, fused = train(False), train(True)
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), fused.parameters()))
