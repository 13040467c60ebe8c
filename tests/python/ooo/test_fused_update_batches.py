"""Update batches of the fused update (Note [Update batches] in memsched/ooo/backward.py): complete
step units wait until their gradients reach update_batch_bytes and are updated in one C++ call.
Parameters and optimizer state stay bitwise plain PyTorch's, the calls drop, and the gradients alive
at once stay within the batch; the default is 0 (one unit at a time) on CPU."""
import copy
import warnings

import pytest
import torch

from memsched import MemschedError, models
from memsched.ooo import OutOfOrderBackward
from ooo_helpers import GuardedNet, assert_same_state, batches, guarded_loop, plain_loop

OPTIMIZERS = {
    "adamw_default": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam_fused_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, fused=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),  # the Python path, batched too
}
STEPS = 3


def _fused(model, opt, name, data, accumulation=1, **kw):
    with OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True, grad_accumulation_steps=accumulation,
                            **kw) as ooo:
        for x, y in data:
            models.loss_fn(name, model(x), y).backward()
            ooo.step()
    return ooo.report()


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("config", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", ["mlp", "transformer", "cnn"])
def test_batched_updates_equal_plain_bitwise_with_fewer_calls(name, config, accumulation):
    make = OPTIMIZERS[config]
    ref = models.build_model(name, seed=1)
    ref_opt = make(ref.parameters())
    data = batches(name, STEPS * accumulation)
    plain_loop(ref, ref_opt, name, data, accumulation=accumulation)
    param_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    calls = {}
    for batch in (0, param_bytes // 4, param_bytes * 2):
        model = models.build_model(name, seed=1)
        opt = make(model.parameters())
        report = _fused(model, opt, name, data, accumulation=accumulation, update_batch_bytes=batch)
        assert report["update_batch_bytes"] == batch
        assert report["fused_updates"] == STEPS * len(list(model.parameters()))
        assert_same_state(ref, ref_opt, model, opt)
        assert all(p.grad is None for p in model.parameters())
        calls[batch] = report["fused_calls_in_cpp"]
    if config.startswith("adam"):
        # every step after the first (torch creates the state in Python) runs in C++: per unit unbatched,
        # once per backward pass (one param group) with a batch larger than every gradient
        assert calls[0] // (STEPS - 1) >= 3  # the model's units
        assert calls[param_bytes * 2] == STEPS - 1
        assert STEPS - 1 <= calls[param_bytes // 4] <= calls[0]
        if name != "mlp":  # many small units: a quarter of the bytes holds several
            assert STEPS - 1 < calls[param_bytes // 4] < calls[0]


def test_gradients_alive_at_once_stay_within_the_batch():
    """One unit at a time keeps about one layer's gradient; a batch keeps at most its bytes plus the unit
    that filled it; the whole model's gradients only with a batch as large as they are."""
    name = "transformer"
    data = batches(name, STEPS)
    peaks = {}
    model = models.build_model(name, seed=1)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest_unit = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
                       for m in model.modules())
    for batch in (0, param_bytes // 4, param_bytes * 2):
        model = models.build_model(name, seed=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        peaks[batch] = _fused(model, opt, name, data, update_batch_bytes=batch)["peak_grad_bytes"]
    assert peaks[0] < peaks[param_bytes // 4] < peaks[param_bytes * 2]
    assert peaks[param_bytes // 4] <= param_bytes // 4 + 2 * largest_unit
    assert peaks[param_bytes * 2] >= 0.9 * param_bytes


def test_the_default_on_cpu_updates_each_unit_at_once():
    model = models.build_model("mlp", seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    report = _fused(model, opt, "mlp", batches("mlp", 2))
    assert report["update_batch_bytes"] == 0


def test_units_waiting_in_a_batch_are_not_stepped_by_a_backward_that_raises():
    """A backward pass that raises after a unit completed: unbatched, that unit keeps its update (and a
    warning says so: test_backward_failed_warning.py); waiting in a batch, it is not stepped, and the
    run equals a plain loop that skips the failed step, bit for bit, without a warning."""
    torch.manual_seed(0)
    base = GuardedNet(guard_at_loss=False)  # raises after its last layer's backward: that unit is complete
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    oa, ob = torch.optim.AdamW(a.parameters()), torch.optim.AdamW(b.parameters())
    guarded_loop(a, oa, lambda: (oa.step(), oa.zero_grad()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with OutOfOrderBackward(b, optimizer=ob, fuse_optimizer=True, update_batch_bytes="1GiB") as ooo:
            guarded_loop(b, ob, ooo.step)
    assert_same_state(a, oa, b, ob)


@pytest.mark.parametrize("value", [-1, "lots", 1.5])
def test_a_bad_update_batch_bytes_is_refused_by_name(value):
    model = models.build_model("mlp", seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(MemschedError, match="update_batch_bytes"):
        OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True, update_batch_bytes=value)


def test_a_byte_string_is_accepted():
    model = models.build_model("mlp", seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert OutOfOrderBackward(model, optimizer=opt, fuse_optimizer=True,
                              update_batch_bytes="1MiB").update_batch_bytes == 1 << 20


@pytest.mark.requires_cuda
def test_cuda_default_batches_and_trains_as_plain():
    """On a GPU the default batches units (an eighth of the parameters' bytes) and stays bitwise plain's."""
    name = "transformer"
    ref = models.build_model(name, seed=1).cuda()
    model = copy.deepcopy(ref)
    ref_opt, opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ref, model))
    data = [(x.cuda(), y.cuda()) for x, y in batches(name, STEPS)]
    plain_loop(ref, ref_opt, name, data)
    report = _fused(model, opt, name, data)
    torch.cuda.synchronize()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report["update_batch_bytes"] == param_bytes // 8
    assert report["fused_calls_in_cpp"] <= 10 * (STEPS - 1)
    assert_same_state(ref, ref_opt, model, opt)
