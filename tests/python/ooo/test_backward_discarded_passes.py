"""A loop that drops a backward pass's gradients with zero_grad() before another backward pass of the same
step (Note [Backward passes whose gradients the loop discards] in ooo/backward.py): under
memsched.optimize(fuse_optimizer=True) the step after the first such step runs unfused, and a second one is
refused at its step boundary before its update; a one-off (a skipped first step) fuses again after it."""
import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched


def _base():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _two_pass_step(model, opt, x, y, boundary):
    F.cross_entropy(model(x), y).backward()  # a pass whose gradients are only looked at
    opt.zero_grad()
    F.cross_entropy(model(x * 0.5), y).backward()  # the pass the update uses
    boundary()
    opt.zero_grad()


@pytest.mark.parametrize("boundary", ["run.step", "optimizer.step"])
def test_two_backward_passes_with_zero_grad_between_are_refused_before_a_wrong_update(boundary):
    batches = _batches(3)
    plain, m = _base(), _base()
    po, mo = torch.optim.AdamW(plain.parameters(), lr=1e-2), torch.optim.AdamW(m.parameters(), lr=1e-2)
    _two_pass_step(plain, po, *batches[0], po.step)  # plain after the first step
    with memsched.optimize(m, mo, fuse_optimizer=True) as run:
        step = run.step if boundary == "run.step" else mo.step
        _two_pass_step(m, mo, *batches[0], step)
        for p, q in zip(plain.parameters(), m.parameters()):
            assert torch.equal(p, q)  # the profiled step updates after backward: plain's
        state = copy.deepcopy(mo.state_dict())
        with pytest.raises(memsched.MemschedError, match=r"dropped with zero_grad\(\) before another backward "
                                                         r"pass.*was not applied.*fuse_optimizer=False"):
            _two_pass_step(m, mo, *batches[1], step)
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q), "the refused step changed the model"
    assert mo.state_dict()["state"][0]["step"] == state["state"][0]["step"]


def _zero_head_step(model, opt, x, y, boundary):
    F.cross_entropy(model(x), y).backward()
    model[2].zero_grad()  # drops the head's gradients: plain PyTorch's step leaves the head unchanged
    boundary()
    opt.zero_grad()


@pytest.mark.parametrize("from_step", [0, 2])
def test_a_modules_zero_grad_between_backward_and_step_is_refused(from_step):
    """`loss.backward(); model.head.zero_grad(); optimizer.step()`: from the first step, the step after the
    first is refused before its update (it spoke of a second backward pass, which there is not); once the
    update fuses, the boundary is refused (silent before: 0.022 off plain), its update applied."""
    batches = _batches(5)
    plain, m = _base(), _base()
    po, mo = torch.optim.AdamW(plain.parameters(), lr=1e-2), torch.optim.AdamW(m.parameters(), lr=1e-2)
    with memsched.optimize(m, mo, fuse_optimizer=True):
        for i, (x, y) in enumerate(batches):
            step = _zero_head_step if i >= from_step else _plain_step
            step(plain, po, x, y, po.step)
            if from_step == 0 and i == 1:
                with pytest.raises(memsched.MemschedError, match=r"called zero_grad\(\).*between the backward pass "
                                                                 r"and the step boundary.*was not applied"):
                    step(m, mo, x, y, mo.step)
                break
            if from_step == 2 and i == 2:
                with pytest.raises(memsched.MemschedError, match=r"zero_grad\(\).*ran after the backward pass whose "
                                                                 r"fused optimizer update.*stays applied"):
                    step(m, mo, x, y, mo.step)
                return
            step(m, mo, x, y, mo.step)
            for p, q in zip(plain.parameters(), m.parameters()):
                assert torch.equal(p, q), i
    if from_step == 0:  # refused before the second step's update: as plain after the first
        _base_after = _base()
        o = torch.optim.AdamW(_base_after.parameters(), lr=1e-2)
        _zero_head_step(_base_after, o, *batches[0], o.step)
        for p, q in zip(_base_after.parameters(), m.parameters()):
            assert torch.equal(p, q)


def _plain_step(model, opt, x, y, boundary):
    F.cross_entropy(model(x), y).backward()
    boundary()
    opt.zero_grad()


class _MultiTask(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU())
        self.heads = nn.ModuleList([nn.Linear(64, 4), nn.Linear(64, 3)])

    def forward(self, x, task):
        return self.heads[task](self.body(x))


@pytest.mark.parametrize("zero_at", [range(6), (3,)], ids=["every-step", "a-fused-step"])
def test_zero_grad_of_a_module_without_gradients_between_backward_and_step_trains_as_plain(zero_at):
    """A multi-task loop zeroes the head this step did not use: nothing to drop, a no-op in plain PyTorch.
    It was refused (found by a helper reviewing the zero_grad refusals)."""
    def train(model, run_kwargs):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with memsched.optimize(model, opt, **run_kwargs) if run_kwargs else contextlib.nullcontext():
            for i, (x, y) in enumerate(_batches(6)):
                task = i % 2
                F.cross_entropy(model(x, task), y % 3).backward()
                if i in zero_at:
                    model.heads[1 - task].zero_grad()
                opt.step()
                opt.zero_grad()

    plain, m = _MultiTask(), _MultiTask()
    train(plain, None)
    train(m, dict(fuse_optimizer=True))
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q)


def test_a_pass_dropped_after_the_first_steps_is_refused_at_the_next_forward_naming_it():
    """SAM after a warm-up under the fused update: its ascent pass runs fused (the update is applied), and
    the second forward was refused speaking of accumulation, metrics and GANs only (found by a helper
    following the README). It now names the dropped pass and fuse_optimizer=False."""
    batches = _batches(4)
    m = _base()
    mo = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with memsched.optimize(m, mo, fuse_optimizer=True) as run:
        for x, y in batches[:2]:
            _plain_step(m, mo, x, y, mo.step)
        x, y = batches[2]
        F.cross_entropy(m(x), y).backward()
        mo.zero_grad()
        with pytest.raises(memsched.MemschedError, match=r"zero_grad\(\) ran after that update.*SAM's ascent "
                                                         r"pass.*fuse_optimizer=False"):
            m(x * 0.5)
        run.step()
