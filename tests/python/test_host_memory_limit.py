"""optimize(host_memory_limit=...): Note [Host memory limit] in offload/host_buffers.py."""
import copy

import pytest
import torch
import torch.nn as nn

import memsched
from memsched.offload.host_buffers import host_ram_bytes, parse_host_limit
from memsched.optimize import optimize


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


@pytest.mark.parametrize("bad", [1.5, 0.0, -1, "lots", True, [1]])
def test_a_bad_limit_is_refused_before_any_step(bad):
    model = _model()
    with pytest.raises(ValueError, match="host_memory_limit"):
        optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=0.5, host_memory_limit=bad)


def test_the_default_is_half_the_ram_and_forms_agree():
    assert parse_host_limit(None)[0] == int(0.5 * host_ram_bytes())
    assert parse_host_limit("2GiB")[0] == parse_host_limit(2 << 30)[0] == 2 << 30
    assert parse_host_limit(0.25)[0] == int(0.25 * host_ram_bytes())


def test_a_plan_that_needs_more_host_memory_than_the_limit_is_refused_at_planning():
    model = _model()
    before = copy.deepcopy(model.state_dict())
    with optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=0.3, planner="offload_all_prefetch",
                  host_memory_limit=256) as run:
        model(torch.randn(16, 32)).sum().backward()
        with pytest.raises(memsched.MemschedError, match=r"more than memsched may use \(256 B.*host_memory_limit"):
            run.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])  # the optimizer did not step


def test_offloads_past_the_limit_at_run_time_stay_on_the_device_and_gradients_stay_plain():
    model = _model()
    twin = copy.deepcopy(model)
    xs = [torch.randn(16, 32) for _ in range(4)]
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for x in xs:
        twin(x).sum().backward()
        opt.step()
        opt.zero_grad()
    with optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=0.3,
                  planner="offload_all_prefetch") as run:
        for i, x in enumerate(xs):
            if i == 2:
                run.host.limit = 0  # as if the step saved more than its trace: no room left
            model(x).sum().backward()
            run.step()
    assert run.step_stats[0].offloaded > 0 and run.step_stats[0].host_limited == 0
    assert run.step_stats[-1].offloaded == 0 and run.step_stats[-1].host_limited > 0
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
