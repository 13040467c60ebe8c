"""A saved input that its own op writes after saving it (rrelu's noise) is copied after the op.

See Note [Copy after the op] in offload/executor.py.
"""
import copy

import pytest
import torch
import torch.nn as nn

from memsched.optimize import optimize


@pytest.mark.parametrize("planner", ["offload_all_sync", "offload_all_prefetch"])
@pytest.mark.parametrize("inplace", [False, True])
def test_rrelu_noise_is_copied_after_the_kernel_filled_it(planner, inplace):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.RReLU(inplace=inplace), nn.Linear(6, 2))
    twin = copy.deepcopy(model)
    xs = [torch.randn(4, 5) for _ in range(4)]
    torch.manual_seed(1)
    opt = torch.optim.AdamW(twin.parameters(), lr=0.1)
    for x in xs:
        twin(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with optimize(model, optimizer=opt, budget="1GiB", planner=planner) as run:
        for x in xs:
            model(x).pow(2).sum().backward()
            run.step()
    assert all(s.mode == "planned" and s.offloaded > 0 for s in run.step_stats)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
