"""min_offload_bytes: activations the executor keeps on the device for their size are kept by the plan too
(Note [The executor's size floor] in csrc/core/trace.h), so the measured peak is the planned one and a
refusal names a budget that works."""
import re

import pytest
import torch
import torch.nn as nn

import memsched
from memsched import models


def _run(budget, floor, steps=3):
    torch.manual_seed(0)
    model = models.build_model("transformer")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = models.example_batch("transformer", 8)
    with memsched.optimize(model, opt, budget=budget, planner="dp", min_offload_bytes=floor) as run:
        for _ in range(steps):
            models.loss_fn("transformer", model(x), y).backward()
            run.step()
    return run


@pytest.mark.parametrize("floor", [0, 20_000, "32KiB"])
def test_the_measured_peak_is_the_planned_one_whatever_the_floor(floor):
    """Was: with min_offload_bytes="64KiB" the plan counted 16 KiB activations as offloaded, and the step
    measured 499332 saved-activation bytes against 218372 planned, over the budget without a word."""
    run = _run(0.75, floor)
    planned = run.planned_figures()["activation_peak_bytes"]
    assert run.step_stats[-1].peak_bytes == planned, run.report()
    floor_bytes = memsched.parse_bytes(floor)
    assert run.trace.min_offload_bytes == floor_bytes
    sizes = {t.id: t.bytes for t in run.trace.tensors}
    moved = [d.tensor_id for d in run.plan.decisions if d.action != "keep"]
    assert moved and all(sizes[i] >= floor_bytes for i in moved)


def test_a_budget_below_what_the_floor_allows_names_one_that_works():
    with pytest.raises(memsched.MemschedError, match=r"at least (\d+) bytes") as info:
        _run(500_000, 20_000, steps=1)
    least = int(re.search(r"at least (\d+) bytes", str(info.value)).group(1))
    run = _run(least, 20_000)
    assert run.steps_planned == 2 and run.step_stats[-1].peak_bytes == run.planned_figures()["activation_peak_bytes"]


def test_the_floor_travels_with_the_trace(tmp_path):
    t = memsched._C.synthetic_trace(num_layers=2, ops_per_layer=2, seed=1)
    least = memsched._C.least_budget_bytes(t)
    t.min_offload_bytes = max(x.bytes for x in t.tensors) + 1  # nothing may leave
    assert memsched._C.least_budget_bytes(t) > least
    t.to_json(tmp_path / "t.json")
    back = memsched.Trace.from_json(tmp_path / "t.json")
    assert back.min_offload_bytes == t.min_offload_bytes
    assert memsched._C.least_budget_bytes(back) == memsched._C.least_budget_bytes(t)
    with pytest.raises(memsched.MemschedError, match="Trace.min_offload_bytes: expected an int >= 0"):
        t.min_offload_bytes = -1


def test_a_fraction_refused_because_of_the_size_floor_names_the_floor():
    """Every activation of this step is below the floor, so no plan moves any: the refusal named the least
    fraction that works (1.0) but not that min_offload_bytes was the limit."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4))
    x = torch.randn(64, 32)
    with pytest.raises(memsched.MemschedError, match=r"activations smaller than min_offload_bytes=1048576 .* are "
                                                     r"never offloaded or recomputed"):
        with memsched.optimize(m, torch.optim.SGD(m.parameters(), lr=0.1), budget=0.5,
                               min_offload_bytes="1MiB") as run:
            m(x).sum().backward()
            run.step()
