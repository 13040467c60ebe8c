"""A loop that skips step() after a backward pass whose fused update already ran (Note [A step the loop
skipped after a fused update] in ooo/backward.py): the next forward is refused, before anything changes,
naming the skipped step and step() as the way on; after step() training goes on from the updated
parameters (bitwise the plain run whose failing step did update)."""
import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def _batch(s):
    g = torch.Generator().manual_seed(s)
    return torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)


def _plain(skip):
    """Plain PyTorch stepping after every backward but the batches in `skip`."""
    m = _net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for s in range(6):
        if s in skip:
            continue
        x, y = _batch(s)
        F.cross_entropy(m(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return m


@pytest.mark.parametrize("entry", ["optimize", "OutOfOrderBackward"])
def test_a_forward_after_a_skipped_step_is_refused_and_step_goes_on(entry):
    m = _net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    if entry == "optimize":
        ctx = memsched.optimize(m, optimizer=opt, fuse_optimizer=True)
    else:
        ctx = memsched.OutOfOrderBackward(m, optimizer=opt, fuse_optimizer=True)
    with ctx as run:
        def step():
            if entry == "optimize":
                run.step()
            elif run.step():
                opt.step()

        for s in range(6):
            x, y = _batch(s)
            if s == 3:  # the loop skipped step() after batch 2's backward (its error, caught) and zeroed
                opt.zero_grad(set_to_none=True)
                before = copy.deepcopy(m.state_dict())
                with pytest.raises(memsched.MemschedError) as info:
                    m(x)
                assert "If the loop skipped step() after that pass" in str(info.value)
                assert "call step() (run.step()) there" in str(info.value)
                for n, v in m.state_dict().items():
                    assert torch.equal(v, before[n]), n  # refused before anything changed
                step()  # the way on the message names
                continue
            F.cross_entropy(m(x), y).backward()
            if s != 2:
                step()
    # batch 2's update happened during its backward; batch 3 was refused
    for (n, a), b in zip(m.named_parameters(), _plain(skip={3}).parameters()):
        assert torch.equal(a, b), n


def test_a_skipped_first_step_under_optimize_with_the_fused_update_trains_as_plain():
    """The loop catches an error between backward and optimizer.step() at its first, profiled step (which
    updates after backward, unfused) and zeroes the gradients at the next iteration, as plain PyTorch drops
    them: the next optimizer.step() was refused as an accumulation mismatch ('2 backward passes ... expects
    1') though no fused update had run. The step after it runs unfused too, in case the loop drops a pass at
    every step (Note [Backward passes whose gradients the loop discards]); later steps fuse again."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(4)]

    def train(model, run_kwargs):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with memsched.optimize(model, opt, **run_kwargs) if run_kwargs else contextlib.nullcontext() as run:
            for i, (x, y) in enumerate(data):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                if i == 0:
                    continue  # a bad batch the loop skips
                opt.step()
        return run

    plain, m = copy.deepcopy(base), copy.deepcopy(base)
    train(plain, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the profiled step spans the skipped one: a mismatch, re-profiled)
        run = train(m, dict(budget=0.7, fuse_optimizer=True))
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q)
    # batch 1 (profiled) and 2 (unfused after the dropped pass) update after backward; batch 3 fuses
    assert run.ooo_.report()["fused_updates"] == len(list(m.parameters()))
