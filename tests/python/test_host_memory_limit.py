"""optimize(host_memory_limit=...): Note [Host memory limit] in offload/host_buffers.py."""
import copy
import re
import sys

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
    budget = _budget()
    model = _transformer()
    before = copy.deepcopy(model.state_dict())
    with optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=budget, planner="offload_all_prefetch",
                  host_memory_limit=256) as run:
        model(_XS[0]).sum().backward()
        with pytest.raises(memsched.MemschedError, match=r"more than memsched may use \(256 bytes: host_memory_limit"):
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


# -- Note [Plans within host_memory_limit] (offload/host_limit.py) -------------------------------------------
def _transformer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.Linear(8, 32), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                         nn.Linear(32, 4))


_XS = [torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def _train_transformer(limit, budget):
    model = _transformer()
    with optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=budget, planner="dp",
                  host_memory_limit=limit) as run:
        for x in _XS:
            model(x).sum().backward()
            run.step()
    return run


def _budget():
    """A byte budget between the least any plan reaches and the keep-all peak: every plan offloads."""
    run = _train_transformer(None, None)
    return (memsched._C.least_budget_bytes(run.trace) + run.trace.peak_bytes()) // 2


def _named_limit(limit, budget):
    with pytest.raises(memsched.MemschedError, match=r"host_memory_limit=(\d+)\) \(([\d.]+ \w+);") as info:
        _train_transformer(limit, budget)
    found = re.search(r"host_memory_limit=(\d+)\) \(([\d.]+) (\w+);", str(info.value))
    return int(found.group(1)), found.group(2) + found.group(3)


def test_the_host_limit_a_refusal_names_works_at_once_in_bytes_and_as_written():
    # was: the refusal named the plan's bytes rounded down ("1.12 MiB"), refused again at every retry
    budget = _budget()
    limit, written = _named_limit("1KiB", budget)
    assert parse_host_limit(written)[0] >= limit
    for retry in (limit, written):
        run = _train_transformer(retry, budget)
        assert [s.mode for s in run.step_stats] == ["planned", "planned"]
        assert run.schedule.offloaded_bytes <= limit
        assert all(s.host_limited == 0 and s.offloaded == len(run.schedule.offload) for s in run.step_stats)


def test_the_named_host_limit_works_when_the_retry_plans_other_offloads(monkeypatch):
    """The plan moves with the profiled op times (CPU noise; the profiled step's own copies, which the host
    limit bounds): a retry whose planner keeps more in host memory than the limit the refusal named runs
    another plan within it, and says so."""
    budget = _budget()
    limit, _ = _named_limit("1KiB", budget)
    opt_mod = sys.modules["memsched.optimize"]
    real = opt_mod.make_plan

    def offload_everything(trace, budget, planner, device):  # as if the op times had changed the dp plan
        return real(trace, budget, "offload_all_prefetch", device)

    monkeypatch.setattr(opt_mod, "make_plan", offload_everything)
    with pytest.warns(RuntimeWarning, match="host_memory_limit"):
        run = _train_transformer(limit, budget)
    assert [s.mode for s in run.step_stats] == ["planned", "planned"]
    assert all(s.host_limited == 0 for s in run.step_stats)
    assert run.schedule.offloaded_bytes <= limit
    assert "host_memory_limit" in run.report().table and "instead" in run.report().table


def test_a_host_limit_of_exactly_the_plans_bytes_offloads_every_planned_activation():
    """The copy engine counts the bytes of host copies alive, not the pool's rounded blocks: a limit of
    exactly what the plan keeps in host memory leaves no planned offload on the device (each activation
    below is 932,400 bytes, which the pool rounds to 932,864)."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(700, 700), nn.Tanh())], nn.Linear(700, 4))

    xs = [torch.randn(333, 700, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    plain = model()
    with optimize(plain, torch.optim.SGD(plain.parameters(), lr=0.1), budget=0.5,
                  planner="offload_all_prefetch") as run:
        for x in xs:
            plain(x).sum().backward()
            run.step()
    need = run.schedule.offloaded_bytes
    assert need % 512 != 0 or any(b % 512 for b in run.schedule.bytes.values())
    limited = model()
    with optimize(limited, torch.optim.SGD(limited.parameters(), lr=0.1), budget=0.5,
                  planner="offload_all_prefetch", host_memory_limit=need) as run2:
        for x in xs:
            limited(x).sum().backward()
            run2.step()
    assert run2.schedule.offloaded_bytes == need
    assert all(s.host_limited == 0 and s.offloaded == len(run2.schedule.offload) for s in run2.step_stats)
    for p, q in zip(plain.parameters(), limited.parameters()):
        assert torch.equal(p, q)
