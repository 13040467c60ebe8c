"""An op that frees the storage of one of its own inputs while it runs -- set_, which unpickling uses for every
tensor -- is recorded as using it, then freeing it (Note [Inputs an op lets go of] in profiler/recorder.py)."""
import copy
import pickle

import pytest
import torch
import torch.nn as nn

import memsched


def _batches():
    g = torch.Generator().manual_seed(1)
    return [pickle.dumps((torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g))) for _ in range(4)]


def _train(model, opt, extra=None):
    for i, blob in enumerate(_batches()):
        x, y = pickle.loads(blob)  # a DataLoader worker's batch arrives pickled: torch.empty(0).set_(storage)
        if extra is not None and i == 0:
            extra(model)
        (nn.functional.cross_entropy(model(x), y) / 2).backward()
        if i % 2 == 1:  # two micro-batches a step: the second is unpickled inside the profiled step
            opt.step()
            opt.zero_grad()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


@pytest.mark.parametrize("extra", [None, copy.deepcopy], ids=["unpickled batches", "deepcopy of a model with buffers"])
@pytest.mark.parametrize("kwargs", [dict(budget=None), dict(budget="1MiB", planner="dp"),
                                    dict(fuse_optimizer=True, grad_accumulation_steps=2)])
def test_tensors_built_with_set_inside_the_profiled_step_train_as_plain(kwargs, extra):
    """Was: MemschedError 'TraceBuilder::tensor_used: storage ... is not live' from the profiled step."""
    plain = _model()
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    _train(plain, popt, extra)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with memsched.optimize(model, optimizer=opt, **kwargs) as run:
        _train(model, opt, extra)
    assert run.steps_profiled == 1
    for (n, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), n


def test_the_storage_set_replaces_is_used_by_set_and_freed_after_it():
    from memsched.profiler import ProfilerSession
    t = pickle.dumps(torch.randn(5))
    session = ProfilerSession().start()
    try:
        x = pickle.loads(t)
        y = x * 2
    finally:
        trace = session.stop()
    set_ops = [op.id for op in trace.ops if op.name.startswith("aten::set_")]
    assert set_ops and float(y.sum()) == float((x * 2).sum())
    freed_by_set = [r for r in trace.tensors if set_ops[0] in r.uses and r.freed_after_op == set_ops[0]]
    assert freed_by_set, [(r.producer_op, list(r.uses), r.freed_after_op) for r in trace.tensors]
