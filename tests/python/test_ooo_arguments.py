"""OutOfOrderBackward's arguments are checked at construction, naming the argument, and a second
instance on a model that already has one installed is refused (it would leave a dead patch behind)."""
import gc
import math

import pytest
import torch

import memsched
from memsched import OutOfOrderBackward


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("model", [None, 5, "model"])
def test_model_must_be_a_module(model):
    with pytest.raises(memsched.MemschedError, match="model: expected a torch.nn.Module"):
        OutOfOrderBackward(model)


@pytest.mark.parametrize("norm", [float("nan"), float("inf"), -1.0, 0, "1.0", True])
def test_max_grad_norm_must_be_a_positive_finite_number(norm):
    with pytest.raises(memsched.MemschedError, match="max_grad_norm"):
        OutOfOrderBackward(_net(), max_grad_norm=norm)


@pytest.mark.parametrize("steps", [1.5, "2", 0, -1, True, None])
def test_grad_accumulation_steps_must_be_a_whole_number(steps):
    with pytest.raises(memsched.MemschedError, match="grad_accumulation_steps"):
        OutOfOrderBackward(_net(), grad_accumulation_steps=steps)


@pytest.mark.parametrize("limit", [float("nan"), 1.5, -1, "abc", [1]])
def test_max_deferred_bytes_errors_name_the_argument(limit):
    with pytest.raises(memsched.MemschedError, match="max_deferred_bytes") as info:
        OutOfOrderBackward(_net(), max_deferred_bytes=limit)
    assert "budget" not in str(info.value)


@pytest.mark.parametrize("limit,expected", [("1KiB", 1024), (4096, 4096), (2048.0, 2048), (0, 0)])
def test_max_deferred_bytes_forms(limit, expected):
    assert OutOfOrderBackward(_net(), max_deferred_bytes=limit).max_deferred_bytes == expected


def test_nan_max_grad_norm_no_longer_silently_poisons_the_weights():
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(memsched.MemschedError):
        OutOfOrderBackward(m, optimizer=opt, max_grad_norm=math.nan)
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_second_instance_on_the_same_model_is_refused_and_leaves_no_dead_patch():
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    a = OutOfOrderBackward(m, optimizer=opt).install()
    b = OutOfOrderBackward(m, optimizer=opt)
    with pytest.raises(memsched.MemschedError, match="already patched by another OutOfOrderBackward"):
        b.install()
    a.remove()
    del a, b
    gc.collect()
    assert not any("forward" in mod.__dict__ for mod in m.modules())
    m(torch.randn(2, 8)).sum().backward()  # was: ReferenceError (weakly-referenced object no longer exists)


def test_reinstall_after_remove_still_works():
    m = _net()
    ooo = OutOfOrderBackward(m)
    for _ in range(2):
        with ooo:
            m(torch.randn(2, 8)).sum().backward()
            assert ooo.step()


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, "adam", "list"])
def test_optimizer_must_be_an_optimizer_instance(fuse, optimizer):
    # was: without fusion a class, a string or a list was accepted and silently never used
    net = _net()
    if optimizer == "list":
        optimizer = [torch.optim.SGD(net.parameters(), lr=0.1)]
    with pytest.raises(memsched.MemschedError, match=r"optimizer: expected a torch\.optim\.Optimizer instance"):
        OutOfOrderBackward(net, optimizer=optimizer, fuse_optimizer=fuse)
