"""Saves of one storage through tensors with different version counters (unsafe_chunk, .data).

ATen's GRU and LSTM cells split their gate tensor with unsafe_chunk, whose outputs have
version counters of their own, and change the chunks in place. The executor must not reuse
a host copy taken before such a change. See Note [What is never offloaded] in
offload/executor.py and Note [Version counter identity] in csrc/torch/tensor_adapter.h.
"""
import copy

import pytest
import torch
import torch.nn as nn

from memsched import _C
from memsched.optimize import optimize
from memsched.profiler import recorder


def test_version_counter_key_tells_shared_counters_from_separate_ones():
    x = torch.randn(4, 4, requires_grad=True) * 2
    a, b = x.unsafe_chunk(2, 0)
    key = _C.version_counter_key
    assert key(x) != 0
    assert key(x) == key(x.detach()) == key(x[1]) == key(x.view(16))   # views share the counter
    assert len({key(x), key(a), key(b), key(x.data)}) == 4              # these have their own
    with torch.inference_mode():
        assert key(torch.ones(2)) == 0                                  # no counter at all


class ChunkedGates(nn.Module):
    """The minimal form of an RNN cell: chunks of one storage, each changed in place, then saved."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)

    def forward(self, x):
        a, b = self.lin(x).unsafe_chunk(2, 1)
        return a.sigmoid_() * b.sigmoid_()


@pytest.mark.parametrize("planner", ["offload_all_sync", "offload_all_prefetch"])
@pytest.mark.parametrize("make", [ChunkedGates, lambda: nn.GRUCell(3, 4), lambda: nn.LSTMCell(3, 4),
                                  lambda: nn.GRU(3, 4), lambda: nn.LSTM(3, 4, proj_size=2)],
                         ids=["unsafe_chunk", "GRUCell", "LSTMCell", "GRU", "LSTM-proj"])
def test_chunks_changed_in_place_train_bitwise_as_plain(make, planner, monkeypatch):
    """The executor's host copy per version counter: the planners leave a storage saved through several
    counters on the device (Note [Saves through several counters] in csrc/core/trace.h), so the profiler's
    count is switched off here, and the copies per counter -- the executor's answer to a step whose saves
    the trace does not show -- are what runs."""
    monkeypatch.setattr(recorder, "_version_counter_key", lambda t: 0)
    torch.manual_seed(0)
    model = make()
    twin = copy.deepcopy(model)
    xs = [torch.randn(3, 5, 3) if isinstance(model, (nn.GRU, nn.LSTM)) else
          torch.randn(3, 4 if isinstance(model, ChunkedGates) else 3) for _ in range(4)]

    def loss(m, x):
        out = m(x)
        return sum(o.sum() for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)) \
            if not isinstance(m, nn.LSTM) else out[0].sum()

    opt = torch.optim.AdamW(twin.parameters(), lr=0.1)
    for x in xs:
        loss(twin, x).backward()
        opt.step()
        opt.zero_grad()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with optimize(model, optimizer=opt, budget="1GiB", planner=planner) as run:
        for x in xs:
            loss(model, x).backward()
            run.step()
    assert all(s.mode == "planned" and s.offloaded > 0 for s in run.step_stats)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


class WritesItsSave(torch.autograd.Function):
    """A backward that changes its saved input in place: plain PyTorch raises at the next unpack of
    that tensor by another node (the unpacked tensor shares the saved tensor's version counter)."""
    write = False

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if WritesItsSave.write:
            x.mul_(0)
        return g * 2


class SharedSave(nn.Module):
    """h is saved by WritesItsSave and by exp (its output) and sigmoid's backward: three saves of h."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x).sigmoid()
        return (WritesItsSave.apply(h) + h.exp()).sum()


def test_a_backward_writing_an_offloaded_save_in_place_raises_as_plain():
    """Executed offloaded saves unpack onto the saved tensor's version counter (as SavedVariable::unpack
    does), so the write is seen by the other saves of h: before, their host copies trained on silently."""
    torch.manual_seed(0)
    model = SharedSave()
    x = torch.randn(8, 16)
    WritesItsSave.write = True
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        copy.deepcopy(model)(x).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with optimize(model, opt, budget=0.9, planner="offload_all_prefetch") as run:
            WritesItsSave.write = False
            for _ in range(2):  # profiled, then planned
                model(x).backward()
                run.step()
            assert run.step_stats[-1].mode == "planned" and run.step_stats[-1].offloaded > 0
            WritesItsSave.write = True
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                model(x).backward()
    finally:
        WritesItsSave.write = False
