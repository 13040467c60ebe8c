"""Budgets (Note [Budget forms] in planning.py): one meaning for memsched.plan and memsched.optimize,
out-of-range and non-numbers refused with a ValueError naming budget and the forms (issue 9), and a
fraction that is not refused when the step's peak lies outside the saved activations."""
import re

import pytest
import torch
import torch.nn as nn

import memsched
from memsched import planning
from memsched.optimize import optimize


@pytest.fixture(scope="module")
def synthetic():
    return memsched._C.synthetic_trace(num_layers=6, ops_per_layer=2, seed=5)


@pytest.mark.parametrize("bad", [1e30, "1e30", 2**63, float("nan"), float("inf"), "1e400", "nan%",
                                 -1.0, 0.0, 1.5, "1.5", True])
def test_plan_refuses_unreadable_budget_with_a_clear_value_error(synthetic, bad):
    with pytest.raises(ValueError, match=r"^budget: ") as info:
        memsched.plan(synthetic, budget=bad, planner="dp")
    msg = str(info.value)
    assert "incompatible function arguments" not in msg and "convert float" not in msg
    assert any(word in msg for word in ("2**63 - 1", "(0, 1]", "(0, 1000]")), msg


@pytest.mark.parametrize("bad", [1e30, 2**63, float("nan"), 1.5, "1e30"])
def test_optimize_refuses_the_same_budgets_up_front(bad):
    with pytest.raises(ValueError, match=r"^budget: "):
        optimize(nn.Linear(2, 2), budget=bad)


def test_parse_bytes_range_and_whole_bytes():
    assert memsched.parse_bytes(2**63 - 1) == 2**63 - 1
    assert memsched.parse_bytes("9223372036854775807") == 2**63 - 1
    assert memsched.parse_bytes(6e9) == 6_000_000_000
    for bad in (2**63, 1e30, "1e30", float("nan"), 1.5):
        with pytest.raises(ValueError, match="budget"):
            memsched.parse_bytes(bad)
    # a fraction of a byte in a string was cut to whole bytes: host_memory_limit="0.5" meant 0 bytes (nothing
    # offloaded, said only in the report), where the number 0.5 means half the host's memory
    for bad in ("0.5", "1.5B", "2.25"):
        with pytest.raises(ValueError, match="is not a whole number of bytes"):
            memsched.parse_bytes(bad)
    assert memsched.parse_bytes("1.5KiB") == 1536


def test_a_fraction_means_the_same_in_plan_and_optimize(synthetic):
    # plan(budget=0.5) used to mean 0 bytes; it is half the activation memory, as in optimize
    peak = synthetic.peak_bytes()
    act_peak = planning.activation_peak_bytes(synthetic)
    assert act_peak > 0
    b = planning.resolve_budget(0.5, synthetic)
    assert 0 < b < peak
    assert peak - act_peak <= b
    assert planning.resolve_budget("0.5", synthetic) == b
    plan = memsched.plan(synthetic, budget=0.9, planner="dp")
    assert plan.budget_bytes == planning.resolve_budget(0.9, synthetic) > 0
    assert planning.resolve_budget(1.0, synthetic) == peak
    # ints stay bytes, whole floats > 1 too
    assert planning.resolve_budget(1, synthetic) == 1
    assert planning.resolve_budget(4096.0, synthetic) == 4096

    run = optimize(nn.Linear(2, 2), budget=0.5)
    assert run._resolve_budget(synthetic)[0] == b


def test_fraction_budget_bounds_the_saved_activations_not_more(synthetic):
    # The budget is the step's peak with saved activations capped at f of their peak: never below
    # the old "peak - (1 - f) * activation peak" (which could ask for what no plan reaches), never
    # above the peak, and the op it names is where that capped curve peaks.
    from memsched.offload.report import planned_activation_curve

    act = planned_activation_curve(synthetic, None)
    live = synthetic.live_bytes()
    for f in (0.3, 0.6, 1.0):
        b, op = planning.fraction_budget(synthetic, f)
        cap = f * max(act)
        capped = [int(l - max(0.0, a - cap)) for l, a in zip(live, act)]
        assert b == max(capped) == capped[op]
        assert synthetic.peak_bytes() - (1 - f) * max(act) - 1 <= b <= synthetic.peak_bytes()


class AdamMLP(nn.Module):
    """Saved activations are small next to the parameters' gradients: the step peaks in backward."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))

    def forward(self, x):
        return self.net(x)


def test_fraction_is_not_refused_when_the_peak_lies_outside_the_activations(capsys):
    torch.manual_seed(0)
    model = AdamMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 256)
    with optimize(model, opt, budget=0.7) as run:   # was: MemschedError "below the least budget"
        for _ in range(3):
            model(x).sum().backward()
            run.step()
    trace = run.trace
    peak = trace.ops[trace.peak_op()]
    assert peak.phase == "backward"
    assert run.budget_bytes >= memsched._C.least_budget_bytes(trace)
    assert [s.mode for s in run.step_stats] == ["planned", "planned"]
    report = run.report()
    text = "\n".join(report.notes)
    assert f"op {peak.id} {peak.name} (backward" in text and "cannot lower" in text


def test_an_unreachable_fraction_is_refused_with_the_least_fraction_that_works():
    """optimize(budget=0.5) on a step where offload cannot reach half the activations: the error names
    the least fraction that works, and that fraction then trains."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Sigmoid())

    x = torch.randn(3, 5)
    model = make()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(memsched.MemschedError, match=r"budget 0.5: a fraction is the step.s peak memory with its "
                                                     r"saved activations held to that share of their keep-all "
                                                     r"peak .* use budget=") as info:
        with optimize(model, opt, budget=0.5, planner="dp") as run:
            model(x).sum().backward()
            run.step()
    least = float(re.search(r"use budget=([0-9.]+)", str(info.value)).group(1))
    assert 0.5 < least <= 1.0
    model = make()
    opt = torch.optim.AdamW(model.parameters())
    with optimize(model, opt, budget=least, planner="dp") as run:
        for _ in range(3):
            model(x).sum().backward()
            run.step()
    assert run.plan is not None and run.step_stats


@pytest.mark.parametrize("bad", ["-1", -1.0, "-0.5", 0.0, "-5GiB", " -1.5 MiB"])
def test_negative_or_zero_budgets_say_so(bad):
    with pytest.raises(ValueError, match=r"budget: must be positive|must not be negative"):
        planning.parse_budget(bad)


def test_bad_budgets_name_the_accepted_forms_without_a_chained_traceback():
    from memsched.planning import parse_budget
    with pytest.raises(ValueError, match=r"budget: must not be negative, got -1; accepted: bytes") as err:
        parse_budget(-1)
    with pytest.raises(ValueError, match=r"budget: cannot read '6 gigs' as a size") as err:
        parse_budget("6 gigs")
    assert err.value.__context__ is None or err.value.__suppress_context__  # no "During handling of ..."


def test_the_unit_list_says_which_units_are_decimal_and_which_binary():
    from memsched.units import parse_bytes
    assert parse_bytes("6G") == parse_bytes("6GiB") == 6 * 2**30 and parse_bytes("6GB") == 6 * 10**9
    with pytest.raises(ValueError, match=r"TB \(powers of 1000\), KiB, MiB, GiB, TiB or K, M, G, T \(powers of 1024"):
        parse_bytes("6 gigs")
