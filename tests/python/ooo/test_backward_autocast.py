"""Layer calls under torch.autocast are deferred in the autocast dtype once every use of their parameters
was such a call in one autocast region, and train bitwise as plain PyTorch (Note [Deferred calls under
autocast] in python/memsched/ooo/backward.py). Before, every autocast call went through autograd: a model
trained in bf16 autocast deferred nothing."""
import contextlib
import copy

import pytest
import torch
import torch.nn as nn

from memsched import MemschedError, models
from memsched.ooo import OutOfOrderBackward

CFG = models._TransformerCfg(vocab=64, d_model=32, heads=2, layers=3, seq=16)


def _tokens(k):
    return torch.randint(0, CFG.vocab, (8, CFG.seq + 1), generator=torch.Generator().manual_seed(k))


@contextlib.contextmanager
def _maybe_ooo(model, opt, ooo_kw, **extra):
    """OutOfOrderBackward(model, ...) installed around the block (ooo_kw None: plain PyTorch); yields (end_pass,
    the OutOfOrderBackward or None), end_pass ending one backward pass as the caller's loop would (stepping and
    zeroing the optimizer when it is due)."""
    ooo = OutOfOrderBackward(model, optimizer=opt, **extra, **ooo_kw).install() if ooo_kw is not None else None
    passes = [0]

    def end_pass(accumulation=1):
        passes[0] += 1
        due = ooo.step() if ooo is not None else passes[0] % accumulation == 0
        if due:
            opt.step()
            opt.zero_grad(set_to_none=True)

    try:
        yield end_pass, ooo
    finally:
        if ooo is not None:
            ooo.remove()


def _decoder_steps(model, opt, ooo_kw, steps=4, accumulation=1):
    with _maybe_ooo(model, opt, ooo_kw, grad_accumulation_steps=accumulation) as (end_pass, ooo):
        for k in range(steps * accumulation):
            tok = _tokens(k)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = models.loss_fn("transformer", model(tok[:, :-1]), tok[:, 1:])
            loss.backward()
            end_pass(accumulation)
        return ooo.report() if ooo is not None else None


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_decoder_under_bf16_autocast_defers_and_trains_as_plain(fuse, accumulation):
    torch.manual_seed(0)
    plain = models.Transformer(CFG)
    model = copy.deepcopy(plain)
    _decoder_steps(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), None, accumulation=accumulation)
    report = _decoder_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), {"fuse_optimizer": fuse},
                            accumulation=accumulation)
    assert report["deferred_items"] > 0  # from the second iteration on
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p, q), f"{name}: max |diff| {(p - q).abs().max().item():.3g}"


class ConvNet(nn.Module):
    def __init__(self, twice=False):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)
        self.twice = twice

    def forward(self, x):
        h = torch.relu(self.c1(x))
        h = torch.relu(self.c2(h))
        if self.twice:  # the same layer twice in one region: both share its weight's cached cast
            h = torch.relu(self.c2(h))
        return self.head(h.mean((2, 3)))


def _conv_steps(model, opt, ooo_kw, regions="one", steps=4, cache=True):
    with _maybe_ooo(model, opt, ooo_kw) as (end_pass, ooo):
        for k in range(steps):
            g = torch.Generator().manual_seed(k)
            x, c = torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 5, generator=g)
            if regions == "one":
                with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
                    y = model(x)
            else:  # the head in a region of its own, the convs in another
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    h = torch.relu(model.c2(torch.relu(model.c1(x)))).mean((2, 3))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = model.head(h) + model.head(h * 0.5)
            (y.float() * c).sum().backward()
            end_pass()
        return ooo.report() if ooo is not None else None


@pytest.mark.parametrize("case", ["one_region", "a_layer_twice", "two_regions", "cache_off"])
def test_conv_and_linear_under_autocast_train_as_plain(case):
    torch.manual_seed(0)
    plain = ConvNet(twice=case == "a_layer_twice")
    model = copy.deepcopy(plain)
    kw = dict(regions="two" if case == "two_regions" else "one", cache=case != "cache_off")
    _conv_steps(plain, torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9), None, **kw)
    report = _conv_steps(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), {}, **kw)
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p, q), f"{name}: max |diff| {(p - q).abs().max().item():.3g}"
    # two regions: the convs are deferred, the head (its cast differs between the regions) is not;
    # autocast's cache off: no cached cast to tell a region by, nothing deferred
    assert (report["deferred_items"] > 0) == (case != "cache_off")


def test_a_use_outside_the_region_after_deferral_is_refused_then_trains_as_plain():
    """Iterations 1-2 call the head only inside autocast (deferred in bf16 from the second on); iteration 3
    also calls it outside: refused in forward, before anything changes, and the retry trains as plain."""
    torch.manual_seed(0)
    plain = ConvNet()
    model = copy.deepcopy(plain)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, model)]
    xs = [torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(k)) for k in range(3)]

    def step(m, opt, x, extra):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x).float()
        if extra:
            y = y + m.head(torch.ones(1, 8))
        y.square().sum().backward()

    for k, x in enumerate(xs):
        step(plain, opts[0], x, k == 2)
        opts[0].step()
        opts[0].zero_grad(set_to_none=True)
    with OutOfOrderBackward(model, optimizer=opts[1]) as ooo:
        for k, x in enumerate(xs):
            if k == 2:
                with pytest.raises(MemschedError, match=r"parameter head\.weight was deferred in autocast's dtype"):
                    step(model, opts[1], x, True)
                opts[1].zero_grad(set_to_none=True)
            step(model, opts[1], x, k == 2)
            assert ooo.step()
            opts[1].step()
            opts[1].zero_grad(set_to_none=True)
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p, q), f"{name}: max |diff| {(p - q).abs().max().item():.3g}"


def test_each_iterations_gradients_under_bf16_autocast_equal_plains(device):
    """Every deferred iteration's gradients against plain's. On CUDA the default executor ('stream') runs
    the dW of the calls deferred in bf16 (by the C++ fast path from the second iteration on) on the side
    stream: equal up to cuBLAS's choice of algorithm for a separate dW call (bf16 rounding, as
    test_stream_executor_matches_plain_on_cuda); on CPU bitwise."""
    torch.manual_seed(0)
    plain = models.Transformer(CFG).to(device)
    model = copy.deepcopy(plain)
    with OutOfOrderBackward(model) as ooo:
        assert ooo.report()["executor"] == ("stream" if device == "cuda" else "inline")
        for k in range(3):
            tok = _tokens(k).to(device)
            for m in (plain, model):
                with torch.autocast(device, dtype=torch.bfloat16):
                    loss = models.loss_fn("transformer", m(tok[:, :-1]), tok[:, 1:])
                loss.backward()
            assert ooo.step()
            if device == "cuda":
                torch.cuda.synchronize()
            for (name, p), q in zip(plain.named_parameters(), model.parameters()):
                if device == "cuda":
                    torch.testing.assert_close(q.grad, p.grad, rtol=2e-2, atol=1e-4, msg=f"iteration {k}: {name}")
                else:
                    assert torch.equal(q.grad, p.grad), f"iteration {k}: {name}"
            plain.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            if k == 0:
                assert ooo.report()["deferred_items"] == 0  # the first iteration learns the autocast region
        assert ooo.report()["deferred_items"] > 0  # deferred in bf16 from the second iteration on
