"""Weight policies of asynchronous 1F1B: predict computes W - lr * s * d from the optimizer's own
state (SGD's momentum buffer; Adam/AdamW's bias-corrected step, with AdamW's decoupled decay), stash
copies, and both refuse nothing they can do; predict refuses optimizers without a smoothed gradient."""
import pytest
import torch

from memsched import MemschedError
from memsched.pipeline.weight_policy import make_policy


def _trained(opt_cls, **kw):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    opt = opt_cls([p], **kw)
    for _ in range(3):
        p.grad = torch.randn(5)
        opt.step()
    return p, opt


def test_predict_sgd_momentum_is_w_minus_lr_s_buffer():
    p, opt = _trained(torch.optim.SGD, lr=0.1, momentum=0.9)
    r = torch.nn.Parameter(torch.zeros(5))
    make_policy("predict", opt).load([p], [r], 3)
    torch.testing.assert_close(r.detach(), p.detach() - 0.1 * 3 * opt.state[p]["momentum_buffer"])


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_predict_adam_matches_one_adam_step_with_frozen_moments(cls):
    p, opt = _trained(cls, lr=0.01, weight_decay=0.1)
    r = torch.nn.Parameter(torch.zeros(5))
    make_policy("predict", opt).load([p], [r], 1)
    # the same step torch takes when the new gradient leaves m and v unchanged: g = m, g^2 = v
    st = opt.state[p]
    t = float(st["step"])
    b1, b2 = opt.param_groups[0]["betas"]
    d = (st["exp_avg"] / (1 - b1 ** t)) / ((st["exp_avg_sq"] / (1 - b2 ** t)).sqrt() + opt.param_groups[0]["eps"])
    if cls is torch.optim.AdamW:
        d = d + 0.1 * p.detach()
    torch.testing.assert_close(r.detach(), p.detach() - 0.01 * d)


def test_predict_before_any_step_is_the_current_weight_and_stash_copies():
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([p])
    for name in ("predict", "stash"):
        r = torch.nn.Parameter(torch.zeros(4))
        make_policy(name, opt).load([p], [r], 2)
        torch.testing.assert_close(r.detach(), p.detach(), rtol=0, atol=0)


def test_predict_refuses_optimizers_without_a_smoothed_gradient():
    p = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(MemschedError, match="momentum > 0"):
        make_policy("predict", torch.optim.SGD([p], lr=0.1))
    with pytest.raises(MemschedError, match="policy='stash'"):
        make_policy("predict", torch.optim.RMSprop([p]))
    with pytest.raises(MemschedError, match="policy"):
        make_policy("pipedream", torch.optim.RMSprop([p]))
