"""Out-of-order backward (memsched.ooo) on CPU: deferred weight gradients are
bitwise plain autograd's; patching is undone; contributions are counted; the
byte limit holds; clear errors."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched
from memsched import models
from memsched.ooo import OutOfOrderBackward
from ooo_helpers import assert_same_state, batches, ooo_loop, plain_loop, twin


def _grads(model):
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def _assert_grads_equal(ga, gb):
    assert ga.keys() == gb.keys()
    for n in ga:
        if ga[n] is None or gb[n] is None:
            assert ga[n] is None and gb[n] is None, n
        else:
            assert torch.equal(ga[n], gb[n]), f"{n}: max |diff| {(ga[n] - gb[n]).abs().max().item():.3g}"


class LinearShapes(nn.Module):
    """Linear on 2-D, 3-D and non-contiguous 4-D inputs, with and without bias."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 24)
        self.b = nn.Linear(24, 16, bias=False)
        self.c = nn.Linear(16, 8)

    def forward(self, x):  # x: [2, 3, 5, 12]
        h = torch.tanh(self.a(x.transpose(1, 2)))      # non-contiguous 4-D input
        h = self.b(h.reshape(-1, 5, 24))                # 3-D
        return self.c(h.reshape(-1, 16)).sum(0)         # 2-D


class ConvShapes(nn.Module):
    """Conv1d/2d/3d with groups, stride, dilation, padding, with and without bias."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(4, 8, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(4, 8, 3, padding=2, dilation=2, groups=2, bias=False)
        self.c3 = nn.Conv3d(4, 6, 2, stride=1)

    def forward(self, x1, x2, x3):
        return (self.c1(x1).square().sum() + torch.relu(self.c2(x2)).sum() + self.c3(x3).tanh().sum())


def test_linear_gradients_are_bitwise_plain_autograd():
    torch.manual_seed(0)
    a = LinearShapes()
    b = copy.deepcopy(a)
    x = torch.randn(2, 3, 5, 12)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a(xa).sum().backward()
    with OutOfOrderBackward(b) as ooo:
        b(xb).sum().backward()
    # a: a non-contiguous 4-D input with a bias runs through autograd (Note [Linear inputs that at::linear
    # reduces in another order] in ooo/backward.py); b and c are deferred
    assert ooo.report()["deferred_items"] == 2
    _assert_grads_equal(_grads(a), _grads(b))
    assert torch.equal(xa.grad, xb.grad)  # dX chain


def test_conv_gradients_are_bitwise_plain_autograd():
    torch.manual_seed(0)
    a = ConvShapes()
    b = copy.deepcopy(a)
    xs = [torch.randn(2, 4, 11), torch.randn(2, 4, 9, 9), torch.randn(2, 4, 5, 5, 5)]
    xa = [x.clone().requires_grad_() for x in xs]
    xb = [x.clone().requires_grad_() for x in xs]
    a(*xa).backward()
    with OutOfOrderBackward(b) as ooo:
        b(*xb).backward()
    assert ooo.report()["deferred_items"] == 3 and ooo.report()["eligible_layers"] == 3
    _assert_grads_equal(_grads(a), _grads(b))
    for u, v in zip(xa, xb):
        assert torch.equal(u.grad, v.grad)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_unfused_gradients_and_steps_match_plain(name):
    a, oa, b, ob = twin(name, "adamw")
    data = batches(name, 3)
    plain_loop(a, oa, name, data)
    ooo_loop(b, ob, name, data, fuse=False)
    assert_same_state(a, oa, b, ob)


def test_grads_exist_when_backward_returns_and_accumulate_like_autograd():
    a, _, b, _ = twin("transformer", "adam")
    data = batches("transformer", 2)
    for x, y in data:  # two backward passes without zero_grad: .grad accumulates
        models.loss_fn("transformer", a(x), y).backward()
    with OutOfOrderBackward(b) as ooo:
        for x, y in data:
            models.loss_fn("transformer", b(x), y).backward()
            assert all(p.grad is not None for p in b.parameters())  # no step() needed to see them
    _assert_grads_equal(_grads(a), _grads(b))
    assert ooo.report()["iterations"] == 2


def test_patching_is_undone_on_exit_and_on_error():
    model = models.build_model("mlp")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    x, y = models.example_batch("mlp", 4)
    with OutOfOrderBackward(model):
        assert all("forward" in m.__dict__ for m in linears)
    assert not any("forward" in m.__dict__ for m in linears)
    with pytest.raises(ZeroDivisionError):
        with OutOfOrderBackward(model):
            models.loss_fn("mlp", model(x), y).backward()
            1 / 0
    assert not any("forward" in m.__dict__ for m in linears)
    # An instance-level forward the user set is restored, not dropped.
    custom = linears[0].forward
    linears[0].forward = custom
    with OutOfOrderBackward(model):
        assert linears[0].forward is not custom
    assert linears[0].__dict__["forward"] is custom
    del linears[0].__dict__["forward"]
    # A failing install leaves nothing behind either.
    with pytest.raises(memsched.MemschedError, match="SGD, Adam and AdamW"):
        OutOfOrderBackward(model, optimizer=torch.optim.RMSprop(model.parameters()), fuse_optimizer=True).install()
    assert not any("forward" in m.__dict__ for m in linears)
    assert all(len(p._post_accumulate_grad_hooks or {}) == 0 for p in model.parameters())


class TwiceAndTied(nn.Module):
    """One Linear called twice; two Linears sharing a weight; an Embedding tied to a Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.twice = nn.Linear(8, 8)
        self.l1 = nn.Linear(8, 8, bias=False)
        self.l2 = nn.Linear(8, 8, bias=False)
        self.l2.weight = self.l1.weight
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx)
        h = torch.tanh(self.twice(torch.tanh(self.twice(h))))
        h = self.l2(torch.relu(self.l1(h)))
        return self.head(h)


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_parameters_used_several_times_update_once_after_all_contributions(opt_name):
    torch.manual_seed(0)
    a = TwiceAndTied()
    b = copy.deepcopy(a)
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, lr=1e-2)}[opt_name]
    oa, ob = make(a.parameters()), make(b.parameters())
    data = [torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(s)) for s in range(5)]
    for idx in data:
        F.cross_entropy(a(idx).reshape(-1, 10), idx.reshape(-1)).backward()
        oa.step()
        oa.zero_grad()
    steps = []
    with OutOfOrderBackward(b, optimizer=ob, fuse_optimizer=True) as ooo:
        orig = ooo._stepper.step_params
        ooo._stepper.step_params = lambda ps: (steps.extend(ps), orig(ps))
        for idx in data:
            F.cross_entropy(b(idx).reshape(-1, 10), idx.reshape(-1)).backward()
            ooo.step()
    assert_same_state(a, oa, b, ob)
    # each parameter stepped exactly once per iteration: 4 unique parameters
    # (emb/head weight, twice.weight, twice.bias, l1/l2 weight)
    # (Adam: the first iteration in Python, which creates torch's state; then in C++)
    native = ooo.report()["fused_updates_in_cpp"]
    assert len(steps) + native == 5 * 4 and len({id(p) for p in steps}) == 4
    assert native == (16 if opt_name == "adam" else 0)
    r = ooo.report()
    # per iteration: twice x2 (w+b items), l1, l2 -> 4 deferred items; head, tied to the
    # embedding, runs plainly (Note [Tied parameters] in ooo/backward.py)
    assert r["deferred_items"] == 20 and r["fused_updates"] == 20
    assert all(p.grad is None for p in b.parameters())


def test_output_that_never_reaches_the_loss_behaves_like_autograd():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)
            self.twice = nn.Linear(4, 4)

        def forward(self, x):
            self.unused(x)               # computed, never used
            self.twice(x)                 # one of its two calls is dropped
            return self.used(self.twice(x))

    torch.manual_seed(0)
    a = Branchy()
    b = copy.deepcopy(a)
    x = torch.randn(3, 4)
    a(x).sum().backward()
    with OutOfOrderBackward(b):
        b(x).sum().backward()
    _assert_grads_equal(_grads(a), _grads(b))
    assert b.unused.weight.grad is None


def test_no_grad_forward_inside_context_is_not_counted():
    a, oa, b, ob = twin("mlp", "sgd_momentum")
    data = batches("mlp", 3)
    plain_loop(a, oa, "mlp", data)
    with OutOfOrderBackward(b, optimizer=ob, fuse_optimizer=True) as ooo:
        for x, y in data:
            with torch.no_grad():
                b(x)  # evaluation in between: plain forward, nothing deferred
            models.loss_fn("mlp", b(x), y).backward()
            ooo.step()
    assert_same_state(a, oa, b, ob)


def test_byte_limit_bounds_the_deferred_bytes_and_keeps_results():
    a, oa, b, ob = twin("transformer", "adam")
    data = batches("transformer", 3)
    plain_loop(a, oa, "transformer", data)
    unlimited = ooo_loop(copy.deepcopy(a), OPTIMIZERS_ADAM(a), "transformer", data[:1], max_deferred_bytes="1GiB")
    assert unlimited.report()["limit_flushes"] == 0 and unlimited.report()["urgent_items"] == 0
    biggest = unlimited.report()["peak_deferred_bytes"]  # everything waited for the flush
    limit = biggest // 4
    ooo = ooo_loop(b, ob, "transformer", data, max_deferred_bytes=limit)
    assert_same_state(a, oa, b, ob)
    r = ooo.report()
    assert r["limit_flushes"] > 0
    # held bytes never exceed the limit by more than the one item just queued
    largest_item = 4 * 16 * 32 * 4 + 4 * 16 * 128 * 4  # fc2 of a block: input [4,16,128] + grad [4,16,32]
    assert r["peak_deferred_bytes"] <= limit + largest_item
    zero = ooo_loop(copy.deepcopy(a), OPTIMIZERS_ADAM(a), "transformer", data[:1], max_deferred_bytes=0)
    assert zero.report()["urgent_items"] == zero.report()["deferred_items"]
    assert zero.report()["peak_queued_items"] == 1
    # the inline executor's default without DDP is 0 (See Note [Executors])
    default = ooo_loop(copy.deepcopy(a), OPTIMIZERS_ADAM(a), "transformer", data[:1])
    assert default.report()["max_deferred_bytes"] == 0


def OPTIMIZERS_ADAM(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def test_functional_use_of_a_deferred_weight_is_refused():
    class Regularized(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x).sum() + self.fc.weight.square().sum()  # weight used outside its layer

    m = Regularized()
    with OutOfOrderBackward(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), fuse_optimizer=True):
        with pytest.raises(memsched.MemschedError, match="fc.weight.*outside the layer"):
            m(torch.randn(2, 4)).backward()


def test_thread_executor_is_bitwise_too():
    a, oa, b, ob = twin("transformer", "adamw")
    data = batches("transformer", 3)
    plain_loop(a, oa, "transformer", data)
    ooo = ooo_loop(b, ob, "transformer", data, executor="thread")
    assert ooo.report()["executor"] == "thread"
    assert_same_state(a, oa, b, ob)


def test_conv_with_string_padding_stays_plain_and_correct():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Conv2d(3, 4, 3, padding="same"), nn.ReLU(), nn.Conv2d(4, 2, 3, padding_mode="reflect",
                                                                             padding=1))
    b = copy.deepcopy(a)
    x = torch.randn(2, 3, 6, 6)
    a(x).sum().backward()
    with OutOfOrderBackward(b) as ooo:
        b(x).sum().backward()
    assert ooo.report()["eligible_layers"] == 0
    _assert_grads_equal(_grads(a), _grads(b))


def test_bad_arguments_are_named():
    m = nn.Linear(2, 2)
    with pytest.raises(memsched.MemschedError, match="needs optimizer"):
        OutOfOrderBackward(m, fuse_optimizer=True)
    with pytest.raises(memsched.MemschedError, match="grad_accumulation_steps"):
        OutOfOrderBackward(m, grad_accumulation_steps=0)
    with pytest.raises(memsched.MemschedError, match="max_deferred_bytes"):
        OutOfOrderBackward(m, max_deferred_bytes=-1)
    with pytest.raises(memsched.MemschedError, match="executor"):
        OutOfOrderBackward(m, executor="gpu")
    with pytest.raises(memsched.MemschedError, match="CUDA"):
        OutOfOrderBackward(m, executor="stream").install()
    assert OutOfOrderBackward(m, max_deferred_bytes="1KiB").max_deferred_bytes == 1024


def test_memsched_optimize_with_ooo_and_fusion_matches_plain():
    from memsched.optimize import optimize

    a, oa, b, ob = twin("transformer", "adamw")
    data = batches("transformer", 5)
    plain_loop(a, oa, "transformer", data)
    with optimize(b, optimizer=ob, ooo=True, fuse_optimizer=True) as run:
        for x, y in data:
            models.loss_fn("transformer", b(x), y).backward()
            run.step()
    assert_same_state(a, oa, b, ob)
    assert not any("forward" in m.__dict__ for m in b.modules())


def test_backward_that_raises_part_way_is_reported_and_recovered():
    a, oa, b, ob = twin("mlp", "adam")
    data = batches("mlp", 3)
    plain_loop(a, oa, "mlp", data[1:])  # the failed step is skipped

    def boom(_):
        raise ValueError("boom")

    with OutOfOrderBackward(b, optimizer=ob) as ooo:
        x, y = data[0]
        h = b.layers(x)
        h.register_hook(boom)
        with pytest.raises(ValueError, match="boom"):
            models.loss_fn("mlp", b.head(h), y).backward()
        with pytest.raises(memsched.MemschedError, match="did not finish"):
            ooo.step()
        ob.zero_grad(set_to_none=True)
        for x, y in data[1:]:
            models.loss_fn("mlp", b(x), y).backward()
            assert ooo.step()
            ob.step()
            ob.zero_grad(set_to_none=True)
    assert_same_state(a, oa, b, ob)


def test_activation_checkpointing_inside_ooo_matches_plain():
    from torch.utils.checkpoint import checkpoint

    class Ckpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
            self.out = nn.Linear(8, 2)

        def forward(self, x):
            return self.out(checkpoint(self.inner, x, use_reentrant=False))

    torch.manual_seed(0)
    a = Ckpt()
    b = copy.deepcopy(a)
    oa, ob = torch.optim.AdamW(a.parameters()), torch.optim.AdamW(b.parameters())
    xs = [torch.randn(4, 8) for _ in range(3)]
    for x in xs:
        a(x).square().sum().backward()
        oa.step()
        oa.zero_grad()
    with OutOfOrderBackward(b, optimizer=ob, fuse_optimizer=True) as ooo:
        for x in xs:
            b(x).square().sum().backward()
            ooo.step()
    assert_same_state(a, oa, b, ob)


def test_install_twice_in_a_row_and_reinstall_after_remove():
    a, oa, b, ob = twin("mlp", "sgd_momentum")
    data = batches("mlp", 4)
    plain_loop(a, oa, "mlp", data)
    ooo = OutOfOrderBackward(b, optimizer=ob, fuse_optimizer=True)
    for half in (data[:2], data[2:]):
        with ooo:
            with pytest.raises(memsched.MemschedError, match="already installed"):
                ooo.install()
            for x, y in half:
                models.loss_fn("mlp", b(x), y).backward()
                ooo.step()
        assert ooo.report()["iterations"] == 2  # counters are per installation
    assert_same_state(a, oa, b, ob)
