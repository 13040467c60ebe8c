"""A Linear under out-of-order backward is handed the [rows, in] matrix at::linear itself multiplies and
gives back at::linear's output form (Note [Linear calls the deferred path gives at::linear's own rows] in
python/memsched/ooo/backward.py): column-major inputs, a frozen weight under a non-contiguous output
gradient, in-place ops on the output, and a weight that is not a contiguous matrix train bitwise as in
plain PyTorch."""
import copy

import pytest
import torch
import torch.nn as nn

from ooo_helpers import weighted_sum_steps


class Net(nn.Module):
    """pre (trainable, so input gradients reach parameters) -> a layout -> lin -> a post-op."""

    def __init__(self, layout, post, d, out, bias, dtype):
        super().__init__()
        self.pre = nn.Linear(4, 24 * d, dtype=dtype)
        self.lin = nn.Linear(d, out, bias=bias, dtype=dtype)
        self.layout, self.post, self.d = layout, post, d

    def forward(self, z):
        t = torch.tanh(self.pre(z)).reshape(-1)  # 96 * d values
        d = self.d
        x = {"column_major": lambda: t[:3 * d].view(d, 3).t(),  # [3, d], strides (1, 3)
             "one_by_one": lambda: t[:1],  # 1-D with in_features 1: at::linear's [1, 1] matrix
             "3d": lambda: t[:24 * d].view(4, 6, d),
             "1d": lambda: t[:d]}[self.layout]()
        y = self.lin(x)
        if self.post == "inplace":
            y = y.mul_(1.5)
        elif self.post == "transposed_grad":
            y = y.transpose(0, 1).contiguous()  # the output gradient arrives as a transposed view
        elif self.post == "chain":
            y = self.lin(torch.tanh(y))
        return y


CASES = {
    # (layout, post, in, out, bias, dtype, freeze_weight, weight_transposed, optimizer)
    "column_major_input": ("column_major", "chain", 33, 33, True, torch.float32, False, False, "adam"),
    "column_major_input_no_bias": ("column_major", "none", 33, 17, False, torch.float32, False, False, "sgd"),
    "1d_in_features_1": ("one_by_one", "none", 1, 64, False, torch.float32, False, False, "sgd"),
    "inplace_after_3d_with_bias": ("3d", "inplace", 8, 16, True, torch.float32, False, False, "sgd"),
    "inplace_after_1d_with_bias": ("1d", "inplace", 8, 16, True, torch.float32, False, False, "sgd"),
    "frozen_weight_transposed_grad": ("3d", "transposed_grad", 64, 17, True, torch.float64, True, False, "sgd"),
    "transposed_weight_fused_adamw": ("3d", "none", 16, 8, False, torch.float64, False, True, "adamw_fused"),
}

OPTS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
        "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True)}


def _train(model, make_opt, under):
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    return weighted_sum_steps(model, opt, lambda g: torch.randn(4, 4, generator=g, dtype=model.pre.weight.dtype),
                              dict(fuse_optimizer=under == "fuse") if under else None, keep_grads=True)


@pytest.mark.parametrize("under", ["ooo", "fuse"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_linear_trains_bitwise_as_plain(case, under):
    layout, post, d, out, bias, dtype, freeze, transposed, opt = CASES[case]
    torch.manual_seed(0)
    plain = Net(layout, post, d, out, bias, dtype)
    if transposed:
        plain.lin.weight = nn.Parameter(plain.lin.weight.detach().t().contiguous().t())
    plain.lin.weight.requires_grad_(not freeze)
    model = copy.deepcopy(plain)
    want = _train(plain, OPTS[opt], None)
    got = _train(model, OPTS[opt], under)
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p, q), f"max |diff| {(p - q).abs().max().item():.3g}"
    if under == "ooo":  # gradients, and their layout (AccumulateGrad's contract), before each step
        for gw, gg in zip(want, got):
            for a, b in zip(gw, gg):
                assert (a is None) == (b is None)
                if a is not None:
                    assert torch.equal(a, b) and a.stride() == b.stride()


@pytest.mark.parametrize("path", ["fast", "python"])  # python: a queueing executor decides every call there
@pytest.mark.parametrize("edit", ["no_grad_relu_", "relu_", "none"])
@pytest.mark.parametrize("autocast", [False, True])
def test_an_in_place_edit_of_a_flattened_linears_output_gets_plains_gradients(edit, autocast, path):
    """at::linear returns a view of addmm's output for a 3-D input with a bias; an in-place op on it
    rebases that view (with grad) or regenerates its grad_fn (under no_grad), so addmm's backward gets the
    base's contiguous gradient. The deferred Function returned no view, kept the output gradient's
    transposed layout (a residual stream that is a transposed view) and summed the bias gradient in
    another order: 1e-6 off (found by fuzzing). It now returns at::linear's own view of its output
    (Note [Linear calls the deferred path gives at::linear's own rows]), in the C++ fast path, under
    autocast and in Python."""
    from memsched.ooo import OutOfOrderBackward
    torch.manual_seed(0)
    plain = nn.ModuleDict(dict(ln=nn.LayerNorm(8), lin=nn.Linear(8, 8), head=nn.Linear(8, 11, bias=False)))
    model = copy.deepcopy(plain)
    xs = [torch.randn(1, 8, 8, generator=torch.Generator().manual_seed(k)) for k in range(3)]

    def loss(m, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            h = x.transpose(1, 2)  # the residual stream: a transposed view
            z = m["lin"](m["ln"](h))  # a contiguous 3-D input
            if edit == "no_grad_relu_":
                with torch.no_grad():
                    z.relu_()
            elif edit == "relu_":
                z.relu_()
            out = m["head"](h + z)
        return out.float().pow(2).sum()

    grads = []
    ooo_kw = {} if path == "fast" else dict(executor="inline", max_deferred_bytes=1 << 20)
    for m, ooo_kw in ((plain, None), (model, ooo_kw)):
        ooo = OutOfOrderBackward(m, **ooo_kw).install() if ooo_kw is not None else None
        try:
            for x in xs:
                loss(m, x).backward()
                if ooo is not None:
                    assert ooo.step()
                grads.append([p.grad.clone() for p in m.parameters()])
                m.zero_grad(set_to_none=True)
            if ooo is not None:
                assert ooo.report()["deferred_items"] > 0
        finally:
            if ooo is not None:
                ooo.remove()
    n = len(xs)
    for k, (want, got) in enumerate(zip(grads[:n], grads[n:])):
        for (name, _), a, b in zip(plain.named_parameters(), want, got):
            assert torch.equal(a, b), f"iteration {k}, {name}: max |diff| {(a - b).abs().max().item():.3g}"
