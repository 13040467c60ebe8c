"""Refusals of the out-of-order backward name their real cause, before any parameter changes."""
import copy

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
        with pytest.raises(MemschedError, match=r"create_graph=True \(double backward") as caught:
            (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)  # refused here, at once
        assert "a functional call" not in str(caught.value)  # not blamed on a functional use
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))


def test_fused_second_backward_over_retained_graph_names_its_cause():
    m = _model()
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    with memsched.optimize(m, torch.optim.AdamW(m.parameters()), fuse_optimizer=True):
        out = m(x)
        F.cross_entropy(out, y).backward(retain_graph=True)
        with pytest.raises(MemschedError, match=r"second backward pass over a graph whose backward already ran") \
                as caught:
            out.pow(2).mean().backward()
    assert "plain PyTorch raises the same" not in str(caught.value)  # plain PyTorch does not raise here


class _TiedHead(nn.Module):
    """An embedding whose weight the output projection reuses through autograd (F.linear), so autograd's
    gradient of a parameter arrives first in backward, before any deferred layer's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))

    def forward(self, tokens):
        return F.linear(self.body(self.emb(tokens)), self.emb.weight)


@pytest.mark.parametrize("fuse", [False, True])
def test_second_backward_over_retained_graph_is_refused_when_autograd_reaches_a_parameter_first(fuse):
    """A tied embedding's gradient hook began a new iteration in the second pass, so the deferred layers
    met a fresh count and raised a raw 'enqueue: ... more contributions than forward uses counted'."""
    m = _TiedHead()
    tokens = torch.randint(0, 11, (4, 6))
    with memsched.OutOfOrderBackward(m, optimizer=torch.optim.AdamW(m.parameters()), fuse_optimizer=fuse):
        loss = m(tokens).logsumexp(-1).mean()
        loss.backward(retain_graph=True)
        # fused: the first pass stepped the tied weight the projection saved; PyTorch's own version check
        # stopped the second pass ("modified by an inplace operation") before any memsched code ran, until the
        # first pass guarded its retained graph (Note [A retained graph after a fused update])
        with pytest.raises(MemschedError, match=r"second backward pass over a graph whose backward already ran") \
                as caught:
            (loss * 0.5).backward()
    assert "enqueue" not in str(caught.value) and "plain PyTorch raises the same" not in str(caught.value)


def test_fused_second_backward_through_a_tied_head_under_optimize_names_its_cause():
    """The same through memsched.optimize, with Embedding and Linear modules tied (found by fuzzing): the raw
    PyTorch in-place error at the profiled step, now the out-of-order refusal."""
    torch.manual_seed(0)
    m = nn.ModuleDict(dict(emb=nn.Embedding(11, 4), head=nn.Linear(4, 11, bias=False)))
    m["head"].weight = m["emb"].weight
    x, y = torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 5))
    with memsched.optimize(m, torch.optim.AdamW(m.parameters(), lr=1e-2), ooo=True, fuse_optimizer=True):
        loss = F.cross_entropy(m["head"](m["emb"](x)).reshape(-1, 11), y.reshape(-1))
        loss.backward(retain_graph=True)
        with pytest.raises(MemschedError, match=r"second backward pass over a graph whose backward already ran"):
            loss.backward()


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("pattern", ["retain_graph", "two_forwards"])
def test_a_refused_backward_over_an_ended_graph_changes_no_gradient(fuse, pattern):
    """A LayerNorm after the last Linear: autograd accumulates its gradient before any deferred item, and
    the refusal came only at the first deferred item, after the LayerNorm's gradient was added a second
    time (2G where the first pass left G). Training on afterwards matches plain PyTorch bitwise."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.LayerNorm(4))

    data = [torch.randn(5, 8, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    plain, m = make(), make()
    popt, mopt = torch.optim.SGD(plain.parameters(), lr=0.1), torch.optim.SGD(m.parameters(), lr=0.1)
    for x in data:
        plain(x).pow(2).sum().backward()
        popt.step()
        popt.zero_grad()
    with memsched.OutOfOrderBackward(m, optimizer=mopt, fuse_optimizer=fuse) as ooo:
        for k, x in enumerate(data):
            if k == 1 and pattern == "retain_graph":
                loss = m(x).pow(2).sum()
                loss.backward(retain_graph=True)
                again = loss
            elif k == 1:
                loss, again = m(x).pow(2).sum(), m(2 * x).pow(2).sum()
                loss.backward()
            else:
                m(x).pow(2).sum().backward()
            if k == 1:
                grads = [None if p.grad is None else p.grad.clone() for p in m.parameters()]
                if fuse and pattern == "two_forwards":
                    # the first pass updated the LayerNorm in place: PyTorch's own version check stops the
                    # second one at its first node, before memsched sees it
                    refusal = pytest.raises(RuntimeError, match=r"modified by an inplace operation")
                else:
                    refusal = pytest.raises(MemschedError, match=r"second backward pass over a graph whose "
                                                                 r"backward already ran")
                with refusal:
                    again.backward()
                for p, g in zip(m.parameters(), grads):
                    assert (p.grad is None) == (g is None) and (g is None or torch.equal(p.grad, g))
                del loss, again
            if ooo.step():
                mopt.step()
            mopt.zero_grad()
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q), f"max |diff| {(p - q).abs().max().item():.3g}"


@pytest.mark.parametrize("fuse", [False, True])
def test_two_forwards_then_a_backward_of_each_names_that_pattern(fuse):
    """l1 = m(x); l2 = m(2x); l1.backward(); l2.backward(): l2's graph never ran a backward, and the refusal
    spoke only of a retained graph (found by a helper probing module patterns)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    with memsched.OutOfOrderBackward(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), fuse_optimizer=fuse,
                                     grad_accumulation_steps=2):
        l1, l2 = m(x).sum(), m(2 * x).sum()
        l1.backward()
        with pytest.raises(MemschedError, match=r"or the backward of a forward made before the last backward pass "
                                                r"ran \(two forwards, then a backward of each\)"):
            l2.backward()


def test_a_retained_graph_without_a_second_pass_over_it_trains_as_plain():
    """retain_graph=True where no later pass reuses the graph (code that always passes it): the guard of a
    retained graph refuses nothing that plain PyTorch runs."""
    plain, m = _model(), _model()
    popt, mopt = torch.optim.AdamW(plain.parameters(), lr=1e-2), torch.optim.AdamW(m.parameters(), lr=1e-2)
    data = [(torch.randn(8, 16, generator=torch.Generator().manual_seed(k)), torch.randint(0, 5, (8,)))
            for k in range(3)]
    for x, y in data:
        F.cross_entropy(plain(x), y).backward(retain_graph=True)
        popt.step()
        popt.zero_grad(set_to_none=True)
    with memsched.OutOfOrderBackward(m, optimizer=mopt, fuse_optimizer=True) as ooo:
        for x, y in data:
            F.cross_entropy(m(x), y).backward(retain_graph=True)
            assert ooo.step() is False
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q), f"max |diff| {(p - q).abs().max().item():.3g}"


@pytest.mark.parametrize("fuse", [False, True])
def test_a_first_layers_weight_changed_in_place_before_backward_trains_as_plain(fuse):
    """Plain PyTorch saves a Linear's weight only for its input's gradient, so a first layer's weight (its
    input needs none) may change in place between forward and backward (a weight constraint); the deferred
    Linear saved it anyway and raised 'modified by an inplace operation ... plain PyTorch raises the same'."""
    plain, m = _model(), _model()
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    popt, mopt = torch.optim.SGD(plain.parameters(), lr=0.1), torch.optim.SGD(m.parameters(), lr=0.1)

    def step(model, after):
        loss = F.cross_entropy(model(x), y)
        with torch.no_grad():
            model[0].weight.mul_(0.5)
        loss.backward()
        after()

    for _ in range(2):
        step(plain, lambda: (popt.step(), popt.zero_grad()))
    with memsched.OutOfOrderBackward(m, optimizer=mopt, fuse_optimizer=fuse) as ooo:
        for _ in range(2):
            step(m, lambda: (ooo.step() and mopt.step(), mopt.zero_grad()))
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q)


def test_a_later_layers_weight_changed_in_place_before_backward_raises_as_plain():
    m = _model()
    x = torch.randn(8, 16)
    with memsched.OutOfOrderBackward(m):
        out = m(x)
        with torch.no_grad():
            m[2].weight.mul_(0.5)  # its input (the GELU's output) needs a gradient: plain saved the weight
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_a_model_with_no_eligible_layer_is_said_so():
    """Hugging Face GPT-2's Conv1D (or any matmul on a bare Parameter) is no nn.Linear: ooo deferred nothing,
    silently."""
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 3))

        def forward(self, x):
            return x @ self.w

    with pytest.warns(RuntimeWarning, match="found no eligible layer.*defers no weight gradient"):
        memsched.OutOfOrderBackward(Bare()).install().remove()


def _gan_steps(G, D, step_g, step_d, zero_g, zero_d, freeze):
    for s in range(3):
        g = torch.Generator().manual_seed(10 + s)
        x, z = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        zero_d()
        (F.softplus(-D(x)).mean() + F.softplus(D(G(z).detach())).mean()).backward()
        step_d()
        zero_g()
        D.requires_grad_(not freeze)
        F.softplus(-D(G(z))).mean().backward()
        step_g()
        D.requires_grad_(True)


@pytest.mark.parametrize("freeze", [False, True])
def test_a_gan_loop_with_two_fused_updates_names_the_freeze_or_trains_as_plain(freeze):
    """The generator's loss backpropagates through the discriminator D, and plain PyTorch discards D's
    gradients of that pass at D's next zero_grad(); with a fused update on D, that pass updated D. Its next
    backward is refused naming the freeze; with D frozen during the generator's step both train as plain."""
    torch.manual_seed(0)
    Gp = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    Dp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    G, D = copy.deepcopy(Gp), copy.deepcopy(Dp)
    og, od = torch.optim.Adam(Gp.parameters(), lr=1e-2), torch.optim.Adam(Dp.parameters(), lr=1e-2)
    _gan_steps(Gp, Dp, og.step, od.step, og.zero_grad, od.zero_grad, freeze)
    og, od = torch.optim.Adam(G.parameters(), lr=1e-2), torch.optim.Adam(D.parameters(), lr=1e-2)
    with memsched.OutOfOrderBackward(D, optimizer=od, fuse_optimizer=True) as ood, \
            memsched.OutOfOrderBackward(G, optimizer=og, fuse_optimizer=True) as oog:
        steps = (lambda: oog.step() and og.step(), lambda: ood.step() and od.step(), og.zero_grad, od.zero_grad)
        if not freeze:
            with pytest.raises(MemschedError, match=r"a GAN's generator loss through the discriminator.*freeze its "
                                                    r"parameters \(requires_grad_\(False\)\)"):
                _gan_steps(G, D, *steps, freeze)
            return
        _gan_steps(G, D, *steps, freeze)
    for a, b in zip(list(Gp.parameters()) + list(Dp.parameters()), list(G.parameters()) + list(D.parameters())):
        assert torch.equal(a, b)


def test_a_metric_forward_between_the_fused_update_and_step_is_refused_with_grad_and_warned_without():
    """Logging a held-out loss between backward and step: with gradients enabled its backward would be a
    second one after the update (the refusal spoke of 'a backward pass began', at a forward); under no_grad
    it reads the updated parameters where plain PyTorch reads the old ones (1.553 where plain logged 1.610),
    which is said once. Training itself stays bitwise plain's."""
    plain, m = _model(), _model()
    popt, mopt = torch.optim.AdamW(plain.parameters(), lr=1e-2), torch.optim.AdamW(m.parameters(), lr=1e-2)
    data = [(torch.randn(8, 16, generator=torch.Generator().manual_seed(k)), torch.randint(0, 5, (8,)))
            for k in range(3)]
    for x, y in data:
        F.cross_entropy(plain(x), y).backward()
        popt.step()
        popt.zero_grad()
    with memsched.OutOfOrderBackward(m, optimizer=mopt, fuse_optimizer=True) as ooo:
        for k, (x, y) in enumerate(data):
            F.cross_entropy(m(x), y).backward()
            if k == 0:
                before = [p.detach().clone() for p in m.parameters()]
                with pytest.raises(MemschedError, match=r"a forward pass with gradients enabled began after 1 "
                                                        r"backward pass.*This forward changed nothing.*torch.no_grad\(\)"):
                    m(x)
                assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))
                with pytest.warns(RuntimeWarning, match=r"it reads the updated parameters") as caught:
                    with torch.no_grad():
                        m(x)
                        m(x)
                assert len([w for w in caught if "updated parameters" in str(w.message)]) == 1  # once
            ooo.step()
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q), f"max |diff| {(p - q).abs().max().item():.3g}"


def test_the_usual_loop_around_a_bare_fused_out_of_order_backward_is_told_to_call_its_step():
    """backward(); optimizer.step(); optimizer.zero_grad() around a bare OutOfOrderBackward(fuse_optimizer=
    True): the next forward was refused with talk of accumulation, GANs and skipped steps; it never said that
    the bare object's step boundary is its own step()."""
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with memsched.OutOfOrderBackward(m, optimizer=opt, fuse_optimizer=True):
        m(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        with pytest.raises(MemschedError, match=r"the step boundary is its step\(\), not optimizer.step\(\).*"
                                                r"Call ooo.step\(\) after each backward pass"):
            m(torch.randn(4, 16))


@pytest.mark.parametrize("fuse", [False, True])
def test_the_backward_of_a_forward_made_before_install_trains_as_plain(fuse):
    """A forward before entering memsched.optimize, its backward inside: the layers ran unpatched, so every
    gradient comes through autograd, and the pass begins the iteration at its first one (it was refused
    with a message about retain_graph and two forwards, then as a backward over an ended graph)."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.LayerNorm(4))

    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    plain, m = make(), make()
    popt, mopt = torch.optim.SGD(plain.parameters(), lr=0.1), torch.optim.SGD(m.parameters(), lr=0.1)
    plain(x).pow(2).sum().backward()
    popt.step()
    loss = m(x).pow(2).sum()
    with memsched.OutOfOrderBackward(m, optimizer=mopt, fuse_optimizer=fuse) as ooo:
        loss.backward()
        if ooo.step():
            mopt.step()
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q)
