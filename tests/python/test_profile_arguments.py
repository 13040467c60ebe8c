"""memsched.profile checks optimizer and device before installing anything: an optimizer that is not
one was an AttributeError from inside the session, and device was any string (a CPU trace labelled
'cuda' on a machine without one made GPU presets trust CPU op times)."""
import pytest
import torch

import memsched


def _step():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    return m, (lambda: m(torch.randn(2, 4)).sum().backward())


@pytest.mark.parametrize("optimizer", [5, "adam", object()])
def test_optimizer_must_be_an_optimizer(optimizer):
    m, step = _step()
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        memsched.profile(step, model=m, optimizer=optimizer)
    assert not m._forward_hooks and not m._forward_pre_hooks


@pytest.mark.parametrize("device", ["nope", "", "cuda:x", 1.5, None.__class__])
def test_device_must_be_a_torch_device(device):
    m, step = _step()
    with pytest.raises(ValueError, match="device must be a torch device"):
        memsched.profile(step, model=m, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_without_cuda_is_refused():
    m, step = _step()
    with pytest.raises(ValueError, match="torch.cuda.is_available"):
        memsched.profile(step, model=m, device="cuda")


def test_valid_device_and_optimizer_still_profile():
    m, step = _step()
    t = memsched.profile(step, model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), device="cpu")
    assert t.device == "cpu" and any(o.phase == "optimizer" for o in t.ops)
