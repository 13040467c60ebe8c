"""A patched Linear's common call is decided and applied in C++ (Note [Fast path of a patched layer call] in
csrc/torch/layer_fast_path.h): only the first call of an iteration, which begins it, and the calls the fast
path declines (autocast, a column-major input, a weight frozen or hooked mid-forward, a parameter whose
first use this iteration went through autograd, a queueing executor) run the Python path -- and every one of
them trains bitwise as plain PyTorch."""
import copy

import pytest
import torch
import torch.nn as nn

from memsched import MemschedError
from memsched.ooo import OutOfOrderBackward
from memsched.ooo import backward as ooo_backward
from ooo_helpers import weighted_sum_steps

D = 16
STEPS = 3


class Chain(nn.Module):
    """Four Linear layers with LayerNorms (autograd-handled parameters, counted by a forward pre-hook);
    `twist` changes how the third layer is called once per forward."""

    def __init__(self, twist=None):
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])
        self.norms = nn.ModuleList([nn.LayerNorm(D) for _ in range(4)])
        self.twist = twist

    def forward(self, x):
        h = x
        for k, (lin, norm) in enumerate(zip(self.lins, self.norms)):
            if k == 2 and self.twist == "autocast":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = lin(h).float()
            elif k == 2 and self.twist == "column_major":
                y = lin(h.t().contiguous().t())
            elif k == 2 and self.twist == "frozen_bias":
                lin.bias.requires_grad_(False)
                y = lin(h)
                lin.bias.requires_grad_(True)
            elif k == 2 and self.twist == "autograd_first":
                y = lin(h.t().contiguous().t()) + lin(h)  # the column-major call fixes the kind: autograd
            elif k == 2 and self.twist == "3d":
                y = lin(h.view(2, -1, D)).reshape(-1, D)
            else:
                y = lin(h)
            h = norm(torch.tanh(y))
        return h


def _count_python_decisions(monkeypatch, method="_deferred_indices"):
    """Counts the calls of OutOfOrderBackward.<method>, the Python path's decision of a layer call."""
    calls = [0]
    original = getattr(ooo_backward.OutOfOrderBackward, method)

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ooo_backward.OutOfOrderBackward, method, counting)
    return calls


def _train_both(twist, **ooo_kw):
    torch.manual_seed(0)
    plain = Chain(twist)
    model = copy.deepcopy(plain)
    p_opt = torch.optim.AdamW(plain.parameters(), lr=0.05)
    m_opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    inputs = lambda g: torch.randn(8, D, generator=g)  # noqa: E731
    weighted_sum_steps(plain, p_opt, inputs, None, steps=STEPS)
    weighted_sum_steps(model, m_opt, inputs, ooo_kw, steps=STEPS)
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p, q), f"{name}: max |diff| {(p - q).abs().max().item():.3g}"


def test_common_linear_calls_skip_the_python_decision(monkeypatch):
    """Of 4 Linear calls per iteration only the first (which begins the iteration) decides in Python."""
    calls = _count_python_decisions(monkeypatch)
    _train_both(None)
    assert calls[0] == STEPS


def test_three_dimensional_contiguous_inputs_take_the_fast_path(monkeypatch):
    calls = _count_python_decisions(monkeypatch)
    _train_both("3d")
    assert calls[0] == STEPS


@pytest.mark.parametrize("twist", ["autocast", "column_major", "frozen_bias", "autograd_first"])
def test_calls_the_fast_path_declines_run_the_python_path_and_train_as_plain(monkeypatch, twist):
    calls = _count_python_decisions(monkeypatch)
    _train_both(twist)
    # the first call of each iteration, and the twisted call (twice for autograd_first: the second call
    # of a parameter whose kind is autograd); the autocast call goes to autograd in the first iteration only,
    # then it is deferred in the autocast dtype (Note [Deferred calls under autocast]), decided in Python
    # without _deferred_indices
    assert calls[0] == (STEPS + 1 if twist == "autocast" else STEPS * (3 if twist == "autograd_first" else 2))


def test_a_queueing_executor_decides_every_call_in_python(monkeypatch):
    """Items may complete out of arrival order there: the Python path keeps a reused parameter's order."""
    calls = _count_python_decisions(monkeypatch)
    _train_both(None, executor="inline", max_deferred_bytes=1 << 20)
    assert calls[0] == STEPS * 4


def test_a_gradient_hook_added_during_forward_sends_later_calls_to_python(monkeypatch):
    """A caller's hook on a weight makes its layer's calls autograd's (Note [Parameters with gradient hooks]),
    also when it is added between two calls of one forward, before any call of that layer."""
    seen = []
    torch.manual_seed(0)
    model = Chain()
    plain = copy.deepcopy(model)

    class Hooking(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            h = self.inner.lins[0](x)
            if not seen:
                self.inner.lins[3].weight.register_hook(lambda g: seen.append(g.clone()))
            return self.inner.lins[3](self.inner.lins[2](self.inner.lins[1](h)))

    plain_seen = []
    plain.lins[3].weight.register_hook(lambda g: plain_seen.append(g.clone()))
    x = torch.randn(8, D)
    wrapped = Hooking(model)
    with OutOfOrderBackward(wrapped) as ooo:
        wrapped(x).square().sum().backward()
        assert ooo.step()
    plain.lins[3](plain.lins[2](plain.lins[1](plain.lins[0](x)))).square().sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], plain_seen[0])
    for p, q in zip(plain.parameters(), model.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad)


class Convs(nn.Module):
    """Conv1d/2d/3d with BatchNorm (autograd-handled parameters); `channels_last` feeds the 2-D conv a
    channels_last input once per forward, which the fast path leaves to Python (Note [Conv weight
    gradients in the weight's layout])."""

    def __init__(self, channels_last=False):
        super().__init__()
        self.c1 = nn.Conv1d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, stride=(1, 2), padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.c3 = nn.Conv3d(4, 2, (1, 3, 3), dilation=(1, 2, 1), groups=2)
        self.channels_last = channels_last

    def forward(self, x):
        h = torch.tanh(self.c1(x))                     # [N, 4, 64]
        h = h.view(h.size(0), 4, 8, 8)
        if self.channels_last:
            h = h.contiguous(memory_format=torch.channels_last)
        h = torch.relu(self.bn(self.c2(h)))            # [N, 4, 8, 4]
        return self.c3(h.unsqueeze(2).expand(-1, -1, 3, -1, -1).contiguous())


@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_calls_take_the_fast_path_unless_their_input_is_not_contiguous(monkeypatch, channels_last):
    calls = _count_python_decisions(monkeypatch)
    torch.manual_seed(0)
    plain = Convs(channels_last)
    model = copy.deepcopy(plain)
    inputs = lambda g: torch.randn(2, 3, 64, generator=g)  # noqa: E731
    weighted_sum_steps(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), inputs, None, steps=STEPS)
    weighted_sum_steps(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), inputs, {}, steps=STEPS)
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p, q), f"{name}: max |diff| {(p - q).abs().max().item():.3g}"
    assert calls[0] == STEPS * (2 if channels_last else 1)


def test_calls_deferred_in_autocast_dtype_take_the_fast_path(monkeypatch):
    """Under autocast only the first iteration's call decides in Python (through autograd, learning that the
    layer is used in one region); from the second on the C++ fast path casts and defers it (Note [Deferred
    calls under autocast]), bitwise plain's."""
    calls = _count_python_decisions(monkeypatch, "_cast_call")
    _train_both("autocast")
    assert calls[0] == 1


def test_a_second_autocast_region_declined_by_the_fast_path_is_refused_by_name():
    """The fast path takes a call only in its parameter's region of this iteration; a call in a second region
    goes to Python, which refuses the parameter already deferred in autocast's dtype, by name."""
    torch.manual_seed(0)
    lin = nn.Linear(D, D)
    x = torch.randn(8, D)
    with OutOfOrderBackward(lin) as ooo:
        for _ in range(2):  # learns one region, then defers in bf16 (in C++)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = lin(x)
            y.float().square().sum().backward()
            assert ooo.step()
        assert ooo.report()["deferred_items"] > 0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin(x)
        with pytest.raises(MemschedError, match=r"parameter weight was deferred in autocast's dtype"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                lin(x)
