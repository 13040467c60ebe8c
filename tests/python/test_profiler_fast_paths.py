"""The profiler's fast paths (Note [Profiler overhead]) give what the plain code gives.

Each shortcut taken for speed is compared against the straightforward
torch / saved_tensors code it replaces: one module-tree walk vs torch's
three, global-hook module paths vs per-module hooks, the flat record_op
call vs the separate builder events.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memsched
from memsched import _C, models
from memsched.profiler.module_paths import ModulePathStack
from memsched.profiler.recorder import _tensors
from memsched.profiler.session import _walk
from memsched.saved_tensors import ModuleStack


class _Shared(torch.nn.Module):
    """A module reached twice, a None bias, a None buffer, a buffer shared by two modules."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(2, 2)
        self.b = self.a
        self.c = torch.nn.Linear(2, 2, bias=False)
        self.c.register_buffer("none", None)
        self.register_buffer("r", torch.zeros(2))
        self.c.register_buffer("r_again", self.r)
        self.bn = torch.nn.BatchNorm1d(2)

    def forward(self, x):
        return self.bn(self.c(self.b(self.a(x))))


def _all_models():
    return [models.build_model(n, "small") for n in models.MODEL_NAMES] + [_Shared()]


@pytest.mark.parametrize("model", _all_models(), ids=list(models.MODEL_NAMES) + ["shared"])
def test_walk_matches_torch_walks(model):
    modules, named_params, buffers = _walk(model)
    assert [(n, id(m)) for n, m in modules] == [(n, id(m)) for n, m in model.named_modules()]
    assert [(n, id(p)) for n, p in named_params] == [(n, id(p)) for n, p in model.named_parameters()]
    assert [id(b) for b in buffers] == [id(b) for b in model.buffers()]


class _PathLog(TorchDispatchMode):
    """Logs (op, ModuleStack path, ModulePathStack path) for every aten op."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b, self.log = a, b, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.log.append((str(func), self.a.current, self.b.current, len(self.b.stack)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_module_path_stack_matches_module_stack(name):
    model = models.build_model(name, "small")
    step = models.make_step_fn(model, name, 2)
    per_module = ModuleStack(model).install()
    global_hooks = ModulePathStack(model).install()
    try:
        with _PathLog(per_module, global_hooks) as log:
            step()
    finally:
        global_hooks.remove()
        per_module.remove()
    paths = {a for _, a, _, _ in log.log}
    assert len(paths) > 2  # the step ran inside several modules
    assert [a for _, a, _, _ in log.log] == [b for _, _, b, _ in log.log]
    assert global_hooks.stack == [] and global_hooks.current == ""
    step()  # the hooks are gone: a later step pushes nothing
    assert global_hooks.stack == []


def test_module_path_stack_ignores_modules_outside_the_model_and_balances_on_error():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    outsider = torch.nn.Linear(2, 2)
    seen = []

    class Boom(torch.nn.Module):
        def forward(self, x):
            seen.append(list(stack.stack))
            raise ValueError("boom")

    model.append(Boom())
    stack = ModulePathStack(model).install()
    try:
        outsider(torch.ones(1, 2))
        assert stack.stack == []
        with pytest.raises(ValueError):
            model(torch.ones(1, 2))
        assert seen == [["", "2"]]
        assert stack.stack == []  # always-called forward hooks popped both
    finally:
        stack.remove()
    with pytest.raises(RuntimeError, match="already installed"):
        stack.install().install()
    stack.remove()


def test_tensors_keeps_argument_order_and_looks_inside_lists():
    a, b, c, d = (torch.ones(1) for _ in range(4))
    got = _tensors((a, [b, 3], None, (c,)), {"alpha": 2, "other": d})
    assert [id(t) for t in got] == [id(a), id(b), id(c), id(d)]
    assert [id(t) for t in _tensors((a, b), {})] == [id(a), id(b)]
    assert _tensors((1, [2], None), {}) == []


def test_record_op_flat_lists_equal_separate_events():
    def trace(flat: bool):
        b = _C.TraceBuilder("cpu")
        b.tensor_existing(1, 64, "float32", "parameter")
        if flat:
            b.record_op("aten::mm", "fc", "forward", [1], [7, 32, "float32", 8, 16, "int64"], 2.5, 100, 64, 48)
        else:
            b.begin_op("aten::mm", "fc", "forward")
            b.tensor_used(1)
            b.tensor_allocated(7, 32, "float32")
            b.tensor_allocated(8, 16, "int64")
            b.end_op(2.5, 100.0, 64, 48)
        b.tensor_freed(7)
        return b.finish().to_json_string()

    assert trace(True) == trace(False)


def test_record_op_rejects_malformed_lists():
    b = _C.TraceBuilder("cpu")
    with pytest.raises(memsched.MemschedError, match="flat list key, bytes, dtype"):
        b.record_op("aten::mm", "", "forward", [], [7, 32], 1.0, 0, 0, 0)
    with pytest.raises(memsched.MemschedError, match="used must be a list"):
        b.record_op("aten::mm", "", "forward", (1,), [], 1.0, 0, 0, 0)
    with pytest.raises(memsched.MemschedError, match="flops must be a number"):
        b.record_op("aten::mm", "", "forward", [], [], 1.0, "many", 0, 0)


def test_parameter_added_during_the_step_gets_its_gradient_marked():
    # stop() walks the parameters again rather than reusing start()'s walk.
    model = torch.nn.Linear(2, 2)

    def step():
        model.extra = torch.nn.Parameter(torch.ones(3))
        (model(torch.ones(1, 2)).sum() + model.extra.sum()).backward()

    trace = memsched.profile(step, model=model)
    grads = sorted(t.bytes for t in trace.tensors if str(t.kind).endswith("gradient"))
    assert grads == [2 * 4, 3 * 4, 4 * 4]  # bias, extra, weight
