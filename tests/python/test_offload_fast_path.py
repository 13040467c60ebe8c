"""The executor's C++ saved-tensor hooks (Note [The saved-tensor fast path] in
csrc/torch/saved_tensor_path.h): labels, kept saves, version checks, executed-step identity
without module paths, and a graph that outlives its Run."""
import copy
import gc
import warnings

import pytest
import torch
import torch.nn as nn

from memsched import _C
from memsched.offload.executor import OffloadExecutor
from memsched.offload.host_buffers import HostBuffers
from memsched.optimize import optimize


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(2, 3),
    lambda: torch.zeros(2, 3, dtype=torch.bfloat16)[1:],        # a view: the base's shape
    lambda: torch.zeros((), dtype=torch.int64),
    lambda: torch.zeros(4, dtype=torch.bool).view(2, 2),
    lambda: torch.zeros(1, 5, dtype=torch.complex64).t(),
    lambda: torch.zeros(3, dtype=torch.float8_e4m3fn),
], ids=["f32", "bf16-view", "scalar", "bool-view", "c64-t", "fp8"])
def test_labels_follow_the_documented_format(make):
    t = make()
    owner = t._base if t._base is not None else t
    shape = "[" + ", ".join(str(s) for s in owner.shape) + "]"
    dtype = str(owner.dtype).replace("torch.", "")
    assert _C.activation_label(7, "block.0.attn", t) == f"act:7:block.0.attn:{shape}:{dtype}"


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(2, 3),
    lambda: torch.zeros(2, 3, dtype=torch.bfloat16)[1:],
    lambda: torch.zeros((), dtype=torch.int64),
    lambda: torch.zeros(1, 5, dtype=torch.complex64).t(),
], ids=["f32", "bf16-view", "scalar", "c64-t"])
def test_numbering_builds_the_same_label_on_demand(make):
    """See Note [Labels built on demand]: the label a step's numbering gives equals activation_label."""
    numbering = _C.ActivationNumbering()
    numbering.start_step()
    t = make()
    k, first, label = numbering.number(t, "block.0")
    assert first and label == _C.activation_label(k, "block.0", t)
    assert numbering.labels == [label]


class _CastsTo(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.dtype = torch.float32

    def forward(self, x):
        return self.fc(x).to(self.dtype).sigmoid().float()


@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_an_executed_step_whose_activation_changes_dtype_or_shape_leaves_the_plan(change):
    """The executed step's shapes and dtypes are compared with the trace's labels without building
    strings (Note [Labels built on demand]); a change of either is a mismatch that names both sides."""
    torch.manual_seed(0)
    model = _CastsTo()
    with warnings.catch_warnings(record=True) as caught, \
            optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=0.5, max_shape_plans=1,
                     planner="offload_all_prefetch") as run:
        warnings.simplefilter("always")
        for step in range(3):
            if step == 2:
                if change == "dtype":
                    model.dtype = torch.float64
                x = torch.randn(2 if change == "dtype" else 3, 4)
            else:
                x = torch.randn(2, 4)
            model(x).sum().backward()
            run.step()
    assert run.steps_planned == 1 and run.mismatches == 1
    want, got = ("float32", "float64") if change == "dtype" else ("[2, 4]", "[3, 4]")
    seen = [str(w.message) for w in caught if "does not match the profiled trace" in str(w.message)]
    assert len(seen) == 1 and want in seen[0] and got in seen[0], seen


@pytest.fixture
def hooks():
    model = nn.Linear(4, 4)
    ex = OffloadExecutor(model, "cpu", HostBuffers(False)).install()
    ex._begin_step()
    ex.in_step_ = True
    yield model, ex
    ex.in_step_ = False
    ex.remove()


def test_a_kept_save_is_no_python_container_and_unpacks_to_the_same_storage(hooks):
    model, ex = hooks
    x = torch.randn(3, 4, requires_grad=True) * 2
    packed = ex.pack_fn_(x)
    assert type(packed) is _C.KeptSave
    assert not gc.is_tracked(packed)          # See Note [Kept saves are not Python containers]
    out = ex.unpack_fn_(packed)
    assert out.grad_fn is None and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert torch.equal(out, x)
    assert ex.path.activations == 1 and ex.path.activation_bytes == x.untyped_storage().nbytes()
    assert ex.unpack_fn_(ex.pack_fn_(model.weight)) is model.weight  # a parameter: no ordinal, as is


def test_a_kept_save_changed_in_place_raises_plain_pytorchs_error(hooks):
    _, ex = hooks
    x = torch.randn(3, 4, requires_grad=True) * 2
    packed = ex.pack_fn_(x)
    x.mul_(2)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: a saved tensor of shape \[3, 4\] "
                                           r"is at version 1; expected version 0"):
        ex.unpack_fn_(packed)


def test_a_step_that_modifies_a_saved_tensor_in_place_raises_like_plain_pytorch():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid())
    with optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=None) as run:
        for step in range(3):
            y = model(torch.randn(2, 4))
            if step == 2:
                y.mul_(2)  # sigmoid saved its output
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    y.sum().backward()
                break
            y.sum().backward()
            run.step()


class Twins(nn.Module):
    """Two identical blocks; `swap` routes the input through them in the other order."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.swap = False

    def forward(self, x):
        first, second = (self.b, self.a) if self.swap else (self.a, self.b)
        return second(first(x))


def _train(model, steps, run=None, opt=None, swap_from=None):
    torch.manual_seed(1)
    for i in range(steps):
        model.swap = swap_from is not None and i >= swap_from
        model(torch.randn(4, 8)).square().sum().backward()
        if run is not None:
            run.step()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)


def test_executed_steps_match_the_trace_without_module_paths():
    torch.manual_seed(0)
    model = Twins()
    twin = copy.deepcopy(model)
    _train(twin, 4, opt=torch.optim.AdamW(twin.parameters(), lr=0.1), swap_from=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a mismatch would warn
        with optimize(model, torch.optim.AdamW(model.parameters(), lr=0.1), budget=0.5,
                      planner="offload_all_prefetch") as run:
            _train(model, 4, run=run, swap_from=2)
    assert run.steps_planned == 3 and run.mismatches == 0
    assert run.step_stats[-1].offloaded > 0
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_a_graph_backpropagated_after_its_run_ended_gets_plain_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())
    twin = copy.deepcopy(model)
    x = torch.randn(4, 8)
    with optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), planner="offload_all_prefetch",
                  budget=0.5) as run:
        model(x).sum().backward()
        run.step()                    # profiled and planned
        loss = model(x).sum()         # executed: its saves are offloaded
        twin.load_state_dict(model.state_dict())
    del run
    gc.collect()
    loss.backward()                   # after the Run (and its hooks) are gone
    twin(x).sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_parameters_replaced_through_data_between_steps_are_not_activations():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    with optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=None) as run:
        for _ in range(3):
            model[0].weight.data = model[0].weight.data.clone()   # a new storage each step
            model(torch.randn(4, 8)).sum().backward()
            run.step()
    assert run.mismatches == 0
    assert run.step_stats[-1].activations == run.step_stats[0].activations


def test_the_profiled_step_raises_on_an_in_place_change_like_plain_pytorch():
    """The profiler's own hooks check versions too: step 0 (profiled) raises as plain PyTorch does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
    x = torch.randn(8, 16)
    with optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=None) as run:
        z = model(x).sigmoid()
        z.mul_(2)                                   # sigmoid saved its output
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.sum().backward()
        run.step()
        out = model(x)                              # profiled again (nothing was recorded)
        with torch.no_grad():
            model[2].weight.mul_(0.5)               # saved by the second Linear
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_saves_while_memscheds_pair_is_passing_through_are_version_checked():
    """run.step() inside the caller's saved_tensors_hooks leaves memsched's pair passing saves
    through until the next forward; those saves are still checked."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=None) as run:
        for _ in range(3):
            out = model(x)
            with torch.autograd.graph.save_on_cpu():
                nn.functional.mse_loss(out, y).backward()
                run.step()
            w = torch.ones(4, requires_grad=True)
            z = (w * 2).sigmoid()
            z.mul_(2)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                z.sum().backward()


def test_a_loss_computed_after_the_forward_backpropagates_after_the_run_ended():
    """The loss's saves are queued for their copy when the Run ends: they are issued, not dropped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), planner="offload_all_sync",
                  budget=1.0) as run:
        for _ in range(2):
            nn.functional.mse_loss(model(x), y).backward()
            run.step()
        twin = copy.deepcopy(model)
        loss = nn.functional.mse_loss(model(x), y)  # planned: the loss's saves are offloaded too
    loss.backward()
    nn.functional.mse_loss(twin(x), y).backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
