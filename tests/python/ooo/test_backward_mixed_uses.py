"""A parameter's contributions are summed in the order autograd sums them when its layer is called both
ways in one iteration (some calls deferred, some through autograd) and when a queueing executor holds
several of its items (Note [One kind of use per parameter and iteration] in
python/memsched/ooo/backward.py). Three contributions are enough to tell another order."""
import copy

import pytest
import torch
import torch.nn as nn

from memsched import MemschedError
from memsched.ooo import OutOfOrderBackward
from ooo_helpers import weighted_sum_steps

D = 33


class Reused(nn.Module):
    """One Linear called on several inputs: "r" row-major [3, D], "c" column-major [3, D] (autograd's
    math), "a" row-major under autocast (autograd's), "8"/"2"/"4" row-major with that many rows."""

    def __init__(self, calls):
        super().__init__()
        self.pre = nn.Linear(4, 12 * D * len(calls))
        self.lin = nn.Linear(D, D)
        self.calls = calls

    def forward(self, z):
        t = torch.tanh(self.pre(z)).reshape(-1)
        acc = 0
        for j, c in enumerate(self.calls):
            seg = t[j * 12 * D:(j + 1) * 12 * D]
            if c == "c":
                x = seg[:3 * D].view(D, 3).t()
            elif c.isdigit():
                x = seg[:int(c) * D].view(int(c), D)
            else:
                x = seg[:3 * D].view(3, D)
            if c == "a":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = self.lin(x).float()
            else:
                y = self.lin(x * (j + 1))
            acc = acc + y.sum(0)
        return acc


def _train(model, under, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    weighted_sum_steps(model, opt, lambda g: torch.randn(4, 4, generator=g),
                       dict(fuse_optimizer=under == "fuse", **kw) if under else None, steps=2)


def _assert_trains_as_plain(calls, under, **kw):
    torch.manual_seed(0)
    plain = Reused(calls)
    model = copy.deepcopy(plain)
    _train(plain, None)
    _train(model, under, **kw)
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p, q), f"max |diff| {(p - q).abs().max().item():.3g}"


@pytest.mark.parametrize("under", ["ooo", "fuse"])
@pytest.mark.parametrize("calls", ["rrc", "rcr", "crr", "arr"])
def test_deferred_and_autograd_calls_of_one_layer_sum_in_autograds_order(calls, under):
    _assert_trains_as_plain(calls, under)


@pytest.mark.parametrize("executor, limit", [("inline", "64MiB"), ("thread", None)])
@pytest.mark.parametrize("calls", ["824", "4281"])
def test_a_queueing_executor_completes_a_parameters_items_in_arrival_order(calls, executor, limit):
    _assert_trains_as_plain(calls, "fuse", executor=executor, max_deferred_bytes=limit)


def test_autograd_grad_asking_for_the_weight_of_a_mixed_layer_gets_plain_gradients():
    torch.manual_seed(0)
    plain = Reused("rrc")
    model = copy.deepcopy(plain)
    z = torch.randn(4, 4)
    want = torch.autograd.grad(plain(z).square().sum(), [plain.lin.weight, plain.lin.bias])
    with OutOfOrderBackward(model):
        got = torch.autograd.grad(model(z).square().sum(), [model.lin.weight, model.lin.bias])
    assert all(torch.equal(a, b) for a, b in zip(want, got))


class UnderAutocast(nn.Module):
    """One Linear called in groups separated by "|": "r" outside autocast, "A" inside one autocast region
    per group (whose calls share autocast's weight cast)."""

    def __init__(self, groups):
        super().__init__()
        self.pre = nn.Linear(4, 4 * D * 6)
        self.lin = nn.Linear(D, D)
        self.groups = groups

    def forward(self, z):
        t = torch.tanh(self.pre(z)).reshape(-1)
        acc, j = 0, 0
        for group in self.groups.split("|"):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=group.startswith("A")):
                for _ in group:
                    acc = acc + self.lin(t[j * 3 * D:(j + 1) * 3 * D].view(3, D)).float().sum(0)
                    j += 1
        return acc


@pytest.mark.parametrize("groups", ["r|A", "A|rr", "AA|r"])
def test_calls_inside_and_outside_autocast_train_as_plain(groups):
    torch.manual_seed(0)
    plain = UnderAutocast(groups)
    model = copy.deepcopy(plain)
    _train(plain, None)
    _train(model, "fuse")
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p, q), f"max |diff| {(p - q).abs().max().item():.3g}"


def test_a_deferred_weight_used_again_under_autocast_beyond_two_contributions_is_refused():
    """r|AA: the two autocast calls share one weight cast, whose node sums them in bfloat16; memsched
    cannot split them as they arrive, and a _Tap per call summed them in float32 (5e-3 off)."""
    model = UnderAutocast("r|AA")
    with OutOfOrderBackward(model):
        with pytest.raises(MemschedError, match="inside torch.autocast"):
            model(torch.randn(4, 4))


_THREAD_MIXED = r"""
import torch, torch.nn as nn
from memsched.ooo import OutOfOrderBackward
torch.manual_seed(0)
layers = nn.ModuleList([nn.Linear(512, 512) for _ in range(4)])
norms = nn.ModuleList([nn.LayerNorm(512) for _ in range(4)])  # autograd parameters: their hooks take the lock
model = nn.ModuleList([layers, norms])
with OutOfOrderBackward(model, executor="thread"):
    for step in range(3):
        h = torch.randn(8, 512)
        for lin, ln in zip(layers, norms):
            a = lin(h)  # deferred
            h = ln(torch.tanh(a + lin(h.t().contiguous().t())))  # column-major: left to autograd
        h.square().sum().backward()
print("done")
"""


def test_thread_executor_with_deferred_and_autograd_calls_of_one_layer_finishes():
    """A _Tap's gradient (a tensor with a Python object) in the worker's pending sum made the worker wait
    for the GIL under the runtime's lock while the engine thread held the GIL waiting for that lock."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", _THREAD_MIXED], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().endswith("done"), r.stderr[-2000:]


def test_thread_executor_refuses_a_third_use_mixing_deferred_and_autograd_calls():
    torch.manual_seed(0)
    model = Reused("rrc")
    with OutOfOrderBackward(model, executor="thread"):
        with pytest.raises(MemschedError, match="executor='thread'"):
            model(torch.randn(4, 4))


def test_a_tapped_use_after_an_autocast_use_of_a_deferred_weight_is_refused():
    """r, a, c: the column-major call's gradient joined the deferred sum as it arrived, the autocast one's
    was added after it: not autograd's order for three contributions."""
    model = Reused("rac")
    with OutOfOrderBackward(model):
        with pytest.raises(MemschedError, match="inside torch.autocast"):
            model(torch.randn(4, 4))
