"""memsched.optimize() checks every argument when called, before any step (issue 9): an unknown planner,
device, option or a bad number is refused there, naming the argument and what it accepts."""
import pytest
import torch
import torch.nn as nn

import memsched
from memsched import planning
from memsched.optimize import optimize


@pytest.fixture
def model():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize("budget", [None, "1GiB", 0.5])
def test_unknown_planner_is_refused_at_optimize(model, budget):
    # was: accepted, and failed only after the profiled step (never with budget=None)
    with pytest.raises(ValueError, match=r"planner: unknown planner 'foo'; known planners: ") as info:
        optimize(model, budget=budget, planner="foo")
    assert all(name in str(info.value) for name in planning.planner_names())


def test_every_known_planner_is_accepted(model):
    for name in planning.planner_names():
        assert optimize(model, planner=name).planner == name


@pytest.mark.parametrize("device,words", [("tpu:0", "device: "), ("nonsense", "device: "), (3.5, "device: ")])
def test_bad_device_is_named(model, device, words):
    with pytest.raises(ValueError, match=words):
        optimize(model, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_without_cuda_is_named(model):
    with pytest.raises(ValueError, match=r"device: 'cuda'.*is_available"):
        optimize(model, device="cuda")


@pytest.mark.parametrize("kwargs,words", [
    (dict(min_offload_bytes=-1), "min_offload_bytes: must not be negative"),
    (dict(min_offload_bytes="lots"), "min_offload_bytes: cannot read 'lots'"),
    (dict(min_offload_bytes=float("nan")), "min_offload_bytes: "),
    (dict(max_reprofiles=-1), "max_reprofiles: expected an int >= 0"),
    (dict(max_reprofiles=1.5), "max_reprofiles: expected an int >= 0"),
    (dict(max_reprofiles="2"), "max_reprofiles: expected an int >= 0"),
    (dict(device_model="tpu-v9"), "device_model: unknown preset 'tpu-v9'"),
])
def test_bad_options_are_named(model, kwargs, words):
    with pytest.raises(ValueError, match=words):
        optimize(model, **kwargs)


@pytest.mark.parametrize("kwargs,words", [
    (dict(fuse_optimizer=True), "fuse_optimizer=True needs optimizer="),
    (dict(fuse_optimizer=True, optimizer="adagrad"), "fuse_optimizer=True supports torch.optim.SGD, Adam and AdamW"),
    (dict(ooo=True, executor="gpu"), "executor must be 'auto', 'inline', 'thread' or 'stream'"),
    (dict(ooo=True, grad_accumulation_steps=0), "grad_accumulation_steps"),
])
@pytest.mark.parametrize("entry", ["optimize", "OutOfOrderBackward"])
def test_ooo_argument_errors_are_value_errors_and_memsched_errors(model, kwargs, words, entry):
    """optimize() promises a ValueError for a bad argument; OutOfOrderBackward's are MemschedErrors too
    (Note [Argument errors of both kinds] in errors.py)."""
    kwargs = dict(kwargs)
    if kwargs.get("optimizer") == "adagrad":
        kwargs["optimizer"] = torch.optim.Adagrad(model.parameters())
    if entry == "optimize":
        if "executor" in kwargs:
            pytest.skip("optimize() has no executor option")
        with pytest.raises(ValueError, match=words):
            optimize(model, **kwargs)
        return
    kwargs.pop("ooo", None)
    with pytest.raises(ValueError, match=words) as info:
        memsched.OutOfOrderBackward(model, **kwargs)
    assert isinstance(info.value, memsched.MemschedError)


@pytest.mark.parametrize("budget", [0, "0GiB", "0"])
def test_a_budget_of_zero_bytes_is_refused_at_optimize(model, budget):
    # was: accepted, and refused only after the profiled step
    with pytest.raises(ValueError, match=r"budget: 0 bytes holds no training step"):
        optimize(model, budget=budget)


def test_unknown_option_is_a_type_error_naming_it(model):
    with pytest.raises(TypeError, match=r"optimize\(\): unknown option 'max_reprofile'; known options: "
                                        r"min_offload_bytes, max_reprofiles, device_model"):
        optimize(model, max_reprofile=3)


def test_sizes_as_strings_are_read(model):
    run = optimize(model, min_offload_bytes="1MiB", max_reprofiles=0, device_model="cpu")
    assert run.min_offload_bytes == 2**20 and run.max_reprofiles == 0
    assert isinstance(memsched.load_device(run.device_model), memsched.DeviceModel)


def test_cuda_device_without_index_gets_the_current_one(monkeypatch):
    # tensors on CUDA report 'cuda:N', and torch.device('cuda:0') != torch.device('cuda'): a Run made
    # with device='cuda' compared its saves' devices with 'cuda' and offloaded none of them
    from memsched.optimize import Run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert Run._check_device("cuda") == torch.device("cuda", 1)
    assert Run._check_device("cuda:0") == torch.device("cuda", 0)
    assert Run._check_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD])
def test_optimizer_class_instead_of_instance_is_refused_at_optimize(model, cls):
    # was: accepted (a class has a step attribute), then a TypeError naming memsched.profile at the first forward
    with pytest.raises(TypeError, match=rf"optimizer: .*got the class torch\.optim\..*{cls.__name__}; pass an "
                                        rf"instance .*{cls.__name__}\(model\.parameters\(\)"):
        optimize(model, optimizer=cls, budget=0.5)


@pytest.mark.parametrize("kwargs", [{}, {"ooo": True}, {"fuse_optimizer": True}])
def test_an_uninitialized_lazy_module_is_named_before_anything_runs(kwargs):
    """A raw ValueError from torch ('Attempted to use an uninitialized parameter in untyped_storage') came
    from inside memsched's first step."""
    model = torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"model: parameter 0\.weight is not initialized yet.*run the model once"):
        memsched.optimize(model, opt, budget=0.5, **kwargs)
    with torch.no_grad():
        model(torch.randn(2, 5))  # initialized: accepted, and trains
    with memsched.optimize(model, opt, budget=0.5, **kwargs) as run:
        for _ in range(2):
            model(torch.randn(4, 5)).sum().backward()
            run.step()


def test_out_of_order_backward_names_an_uninitialized_lazy_module():
    model = torch.nn.Sequential(torch.nn.LazyLinear(8))
    with pytest.raises(memsched.MemschedError, match=r"model: parameter 0\.weight is not initialized yet"):
        memsched.OutOfOrderBackward(model)
