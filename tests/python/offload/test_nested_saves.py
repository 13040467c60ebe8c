"""Saved nested tensors (torch.nested, strided and jagged layouts) are left as autograd saved them, and the
rest of the step is planned as usual (Note [Nested tensors are not planned], activation_numbering.h)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched


class _NestedNet(nn.Module):
    """Three sequences of different lengths through a Linear applied to a nested tensor, which saves it."""

    def __init__(self, layout):
        super().__init__()
        torch.manual_seed(0)
        self.layout = layout
        self.inp, self.mid, self.a, self.out = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        nt = torch.nested.as_nested_tensor(list(torch.split(h, [10, 20, 34])), layout=self.layout)
        nt = torch.relu(self.mid(nt))
        pooled = torch.stack([t.mean(0) for t in nt.unbind()], 0)
        return self.out(torch.tanh(self.a(pooled)))


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_a_saved_nested_tensor_trains_as_plain_and_the_plan_runs(layout):
    # strided: labelling it raised 'NestedTensorImpl doesn't support sizes' in the profiled step;
    # jagged: its ragged size is a new symbol at every forward, so no step matched the trace
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(64, 32, generator=g), torch.randint(0, 10, (3,), generator=g)) for _ in range(4)]
    plain = _NestedNet(layout)
    m = copy.deepcopy(plain)
    popt, mopt = torch.optim.AdamW(plain.parameters()), torch.optim.AdamW(m.parameters())
    for x, y in data:
        F.cross_entropy(plain(x), y).backward()
        popt.step()
        popt.zero_grad()
    with memsched.optimize(m, mopt, budget=0.5, planner="dp") as run:
        for x, y in data:
            F.cross_entropy(m(x), y).backward()
            run.step()
    assert [s.mode for s in run.step_stats] == ["planned"] * 3, [s.mismatch for s in run.step_stats]
    assert all(s.offloaded + s.recomputed > 0 for s in run.step_stats)  # the other activations were planned
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q)
