"""Adversarial regression tests for out-of-order backward and the fused update
(python/memsched/ooo): each case compares parameters and optimizer state
bitwise with a plain PyTorch loop, or checks that a case memsched refuses is
refused before any parameter changes."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched
from memsched.ooo import OutOfOrderBackward


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def _inputs(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 4, generator=g) for _ in range(n)]


def _same(a, oa, b, ob):
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
        sa, sb = oa.state.get(p, {}), ob.state.get(q, {})
        assert sa.keys() == sb.keys(), n
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), (n, k)


def _compare(make_model, make_opt, loss_fn, steps=3, pre=None):
    torch.manual_seed(0)
    a = make_model()
    b = copy.deepcopy(a)
    oa, ob = make_opt(a), make_opt(b)
    xs = _inputs(steps)
    for k, x in enumerate(xs):
        if pre is not None:
            pre(a, k)
        loss_fn(a, x).backward()
        oa.step()
        oa.zero_grad()
    with OutOfOrderBackward(b, optimizer=ob, fuse_optimizer=True) as ooo:
        for k, x in enumerate(xs):
            if pre is not None:
                pre(b, k)
            loss_fn(b, x).backward()
            ooo.step()
    _same(a, oa, b, ob)


@pytest.mark.parametrize("before", [False, True])
def test_weight_used_outside_its_layer_is_refused_before_it_is_updated(before):
    # Was: the deferred contribution made fc.weight final and the fused update
    # stepped it with the layer's gradient alone; the regulariser's gradient
    # only raised afterwards. Now AccumulateGrad must run first (the gate).
    torch.manual_seed(0)
    m = Two()
    w0 = m.l1.weight.detach().clone()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def loss(x):
        if before:
            r = F.linear(x, m.l1.weight).sum()
            return m(x).square().sum() + r
        return m(x).square().sum() + (m.l1.weight.T @ m.l1.weight).sum()

    with OutOfOrderBackward(m, optimizer=opt, fuse_optimizer=True) as ooo:
        with pytest.raises(memsched.MemschedError, match="l1.weight.*outside the layer"):
            loss(_inputs(1)[0]).backward()
        with pytest.raises(memsched.MemschedError, match="did not finish"):
            ooo.step()
    # other parameters may have had their (correct) update before the error
    assert torch.equal(m.l1.weight, w0)
    assert opt.state.get(m.l1.weight, {}) == {}


def test_parameter_frozen_after_install_is_not_updated():
    # Was: a layer whose weight got requires_grad=False after install still
    # computed a deferred dW and the fused update stepped the frozen weight.
    def pre(m, k):
        m.l1.weight.requires_grad_(k != 1)
        m.l2.bias.requires_grad_(k == 0)

    _compare(Two, lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
             lambda m, x: m(x).square().sum(), steps=3, pre=pre)


def test_parameter_unfrozen_after_install_is_refused():
    # Was: silently never updated (not indexed at install, fused update skipped it).
    torch.manual_seed(0)
    m = Two()
    m.l1.weight.requires_grad_(False)
    w0 = m.l1.weight.detach().clone()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    with OutOfOrderBackward(m, optimizer=opt, fuse_optimizer=True) as ooo:
        m(torch.randn(3, 4)).sum().backward()
        ooo.step()
        m.l1.weight.requires_grad_(True)
        with pytest.raises(memsched.MemschedError, match="l1.weight requires grad.*install"):
            m(torch.randn(3, 4)).sum()
    assert torch.equal(m.l1.weight, w0)


class Sym(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).T


def _parametrized():
    m = Two()
    nn.utils.parametrize.register_parametrization(m.l1, "weight", Sym())
    m.l2 = nn.utils.parametrizations.weight_norm(m.l2)
    return m


def test_parametrized_weights_stay_plain_and_train_like_autograd():
    # Was: the parametrized Linear looked eligible (its class keeps
    # nn.Linear.forward); its computed weight had no index, so DeferredLinear
    # returned no gradient for it and the parametrization never trained.
    _compare(_parametrized, lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1),
             lambda m, x: m(x).square().sum())
    with OutOfOrderBackward(_parametrized()) as ooo:
        assert ooo.report()["eligible_layers"] == 0


def test_legacy_weight_norm_stays_plain():
    def make():
        torch.manual_seed(0)
        m = Two()
        m.l1 = torch.nn.utils.weight_norm(m.l1)  # weight recomputed by a forward pre-hook
        return m

    a, b = make(), make()
    oa, ob = torch.optim.Adam(a.parameters(), lr=0.01), torch.optim.Adam(b.parameters(), lr=0.01)
    for x in _inputs(3):
        a(x).square().sum().backward()
        oa.step()
        oa.zero_grad()
    with OutOfOrderBackward(b, optimizer=ob, fuse_optimizer=True) as ooo:
        assert ooo.report()["eligible_layers"] == 1  # l2 only
        for x in _inputs(3):
            b(x).square().sum().backward()
            ooo.step()
    _same(a, oa, b, ob)


@pytest.mark.parametrize("case", ["shared_segments", "inside_and_outside"])
def test_reentrant_checkpoint_with_fused_update_is_refused_before_any_update(case):
    # Was: the later use finished l1.weight, the fused update stepped it, and
    # the earlier segment's recomputation only then raised (a wrong update).
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m = Two()
    before = [p.detach().clone() for p in m.parameters()]
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    x = torch.randn(3, 4, requires_grad=True)
    with OutOfOrderBackward(m, optimizer=opt, fuse_optimizer=True):
        with pytest.raises(memsched.MemschedError, match="use_reentrant=True.*use_reentrant=False"):
            h = checkpoint(m.l1, x, use_reentrant=True)
            h = checkpoint(m.l1, h, use_reentrant=True) if case == "shared_segments" else m.l1(h)
            m.l2(h).sum().backward()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))
    assert opt.state == {}


def test_weight_used_inside_and_outside_a_nonreentrant_checkpoint_is_refused_clearly():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m = Two()
    w0 = m.l1.weight.detach().clone()
    with OutOfOrderBackward(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), fuse_optimizer=True):
        with pytest.raises(memsched.MemschedError, match="l1.weight is used by a forward that runs during backward"):
            h = checkpoint(m.l1, torch.randn(3, 4), use_reentrant=False)
            m.l2(m.l1(h)).sum().backward()
    assert torch.equal(m.l1.weight, w0)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv1d(2, 3, 3, padding=1)
        self.l = nn.Linear(4, 2)

    def forward(self, x):
        return self.l(torch.tanh(self.c(x)))


@pytest.mark.parametrize("drop", [False, True])
def test_graph_recorded_inside_and_run_backward_after_exit_is_plain(drop):
    # Was: backward after remove() still deferred and ran the fused update
    # (the parameters moved without optimizer.step()); with the
    # OutOfOrderBackward collected, backward raised ReferenceError.
    torch.manual_seed(0)
    a = ConvNet()
    b = copy.deepcopy(a)
    ob = torch.optim.Adam(b.parameters(), lr=0.01)
    x = torch.randn(5, 2, 4)
    a(x).square().sum().backward()
    ooo = OutOfOrderBackward(b, optimizer=ob, fuse_optimizer=True).install()
    loss = b(x).square().sum()
    ooo.remove()
    if drop:
        del ooo
    loss.backward()
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n  # not updated
        assert torch.equal(p.grad, q.grad), n  # plain autograd's gradient
    assert ob.state == {}


@pytest.mark.parametrize("fuse", [False, True])
def test_autograd_grad_inside_the_context_is_plain_and_leaves_grad_alone(fuse):
    # Was: torch.autograd.grad(out, x) ran the deferred dW into .grad and (fused)
    # stepped the parameters in place; without fusion the next backward raised.
    torch.manual_seed(0)
    a = ConvNet()
    b = copy.deepcopy(a)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(b.parameters(), lr=0.1,
                                                                                    momentum=0.9)

    def step(m, opt, ooo):
        x = torch.randn(5, 2, 4, generator=torch.Generator().manual_seed(3), requires_grad=True)
        out = m(x).square().sum()
        gx, gw, gb = torch.autograd.grad(out, (x, m.c.weight, m.l.bias), retain_graph=True)
        (out + gx.square().sum().detach()).backward()
        if ooo is None or ooo.step():
            opt.step()
            opt.zero_grad()
        return gx, gw, gb

    plain = [step(a, oa, None) for _ in range(2)]
    with OutOfOrderBackward(b, optimizer=ob, fuse_optimizer=fuse) as ooo:
        got = [step(b, ob, ooo) for _ in range(2)]
    for p_, g_ in zip(plain, got):
        for u, v in zip(p_, g_):
            assert torch.equal(u, v)
    _same(a, oa, b, ob)


def test_second_backward_over_one_graph_is_refused_with_a_clear_message():
    # Was: "enqueue: call begin_iteration() before the forward pass" from the scheduler.
    torch.manual_seed(0)
    m = Two()
    with OutOfOrderBackward(m):
        loss = m(torch.randn(3, 4)).sum()
        loss.backward(retain_graph=True)
        with pytest.raises(memsched.MemschedError, match="second backward pass.*own forward"):
            loss.backward()


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.enc(self.inp(x.reshape(1, 3, 4)))


def test_multihead_attention_out_proj_used_functionally_trains_like_autograd():
    # Was refused: MultiheadAttention passes out_proj.weight/bias to
    # F.multi_head_attention_forward and never calls out_proj, whose only owner
    # is an eligible Linear. With no counted use there is no deferred part.
    _compare(Encoder, lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
             lambda m, x: m(x).square().sum())


def test_parameter_added_after_install_is_refused():
    # See Note [Parameters added or unfrozen after install]: the per-iteration walk runs only
    # after a registration, so a module attached after install must still be found.
    torch.manual_seed(0)
    m = Two()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    with OutOfOrderBackward(m, optimizer=opt, fuse_optimizer=True) as ooo:
        m(torch.randn(3, 4)).sum().backward()
        ooo.step()
        m.extra = nn.Linear(2, 2)
        with pytest.raises(memsched.MemschedError, match="extra.weight was added to the model.*install"):
            m(torch.randn(3, 4)).sum()
