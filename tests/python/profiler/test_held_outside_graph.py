"""The profiler records how long something besides the autograd graph holds a saved storage
(Note [Held outside the graph] in profiler/recorder.py; held_until_op, Note [Held by the caller] in
csrc/core/trace.h), and the plan releases an offloaded activation no earlier."""
import torch
from torch import nn

import memsched
from memsched import _C


def _record(trace, producer_name, nth=0):
    ops = [o.id for o in trace.ops if o.name == producer_name and o.phase == "forward"]
    return next(t for t in trace.tensors if t.producer_op == ops[nth])


def test_held_until_the_frame_lets_go():
    x = torch.randn(256, requires_grad=True)

    def step():
        a = x.exp()        # op 0: saved by exp (its output) and by sin (its input)
        b = a.sin()        # op 1
        c = b * 2.0        # op 2: saves nothing of b (a constant factor)
        d = c * 3.0        # op 3
        del a              # the frame lets go of a after op 3
        d.sum().backward()  # op 4: sum

    trace = memsched.profile(step)
    names = [o.name for o in trace.ops if o.phase == "forward"]
    assert names[:5] == ["aten::exp", "aten::sin", "aten::mul", "aten::mul", "aten::sum"]
    a = _record(trace, "aten::exp")
    assert a.kind == "activation"
    assert [u for u in a.uses if trace.ops[u].phase == "forward"] == [1]
    assert a.held_until_op == 3


def test_temporary_is_held_only_through_its_use():
    x = torch.randn(256, requires_grad=True)

    def step():
        y = torch.sin(x.exp())   # exp's output: a temporary the frame drops after sin
        z = y * 2.0
        z.sum().backward()

    trace = memsched.profile(step)
    a = _record(trace, "aten::exp")
    assert a.kind == "activation" and a.held_until_op <= 1


def test_held_into_backward_is_no_candidate():
    x = torch.randn(256, requires_grad=True)
    kept = []

    def step():
        a = x.exp()
        kept.append(a)            # a module attribute or a list keeps it through backward
        a.sin().sum().backward()

    trace = memsched.profile(step)
    a = _record(trace, "aten::exp")
    first_bwd = next(o.id for o in trace.ops if o.phase == "backward")
    assert a.held_until_op >= first_bwd
    assert a.id not in _C.offloadable_tensor_ids(trace)


def test_nested_sequential_releases_after_the_inner_block():
    """The outer nn.Sequential's `input` keeps blocks.0's output until blocks.1 returns: the
    plan's curve must count it there (the executor measures it there)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.ReLU()),
                          nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU()),
                          nn.Linear(16, 2))
    x = torch.randn(4, 8)
    trace = memsched.profile(lambda: model(x).sum().backward(), model=model)
    relu0 = _record(trace, "aten::relu", 0)   # blocks.0's output, blocks.1's input
    last_inner = max(o.id for o in trace.ops if o.phase == "forward" and o.module_path.startswith("1."))
    assert relu0.held_until_op == last_inner


def test_trace_json_keeps_held_until_op(tmp_path):
    t = memsched.Trace()
    for _ in range(3):
        t.add_op("aten::mul")
    t.add_tensor(64, "float32", "activation", producer_op=0, uses=[1], freed_after_op=2, held_until_op=2)
    t.add_tensor(64, "float32", "activation", producer_op=0, uses=[1], freed_after_op=2)
    t.to_json(str(tmp_path / "t.json"))
    back = memsched.Trace.from_json(str(tmp_path / "t.json"))
    assert [r.held_until_op for r in back.tensors] == [2, -1]


def test_held_until_op_is_validated():
    t = memsched.Trace()
    for _ in range(3):
        t.add_op("aten::mul")
    t.add_tensor(64, "float32", "activation", producer_op=1, uses=[2], freed_after_op=2, held_until_op=0)
    try:
        t.validate()
    except _C.MemschedError as e:
        assert "held_until_op" in str(e) and "before its producer" in str(e)
    else:
        raise AssertionError("held_until_op before the producer was accepted")
