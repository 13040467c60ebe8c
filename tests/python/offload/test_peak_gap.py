"""Note [Where the peak went] (offload/peak_gap.py): a planned step's measured peak above its plan is
split into the optimizer update, late releases and memory the profiled step did not hold, and
run.report() prints that split; the profiled step's update above the budget is refused, naming the
least budget. The device's counters exist on CUDA only: here a scripted meter stands in for them
(its readings are what the allocator would report), and the run is told its peak is the device's."""
import warnings

import pytest
import torch
import torch.nn as nn

import memsched
from memsched.offload.executor import StepStats
from memsched.offload.peak_gap import PhasePeaks, explain_peak_gap
from memsched.optimize import optimize

MiB = 1 << 20


def _stats(forward, backward, update, sampled=0, in_flight=0, reserved=0):
    s = StepStats(mode="planned")
    s.phase_peaks = PhasePeaks(forward=forward, backward=backward, update=update)
    s.peak_bytes = max(forward, backward, update)
    s.sampled_peak_bytes, s.in_flight_at_sampled_peak, s.reserved_peak_bytes = sampled, in_flight, reserved
    return s


def test_a_peak_within_two_percent_of_the_plan_is_not_explained():
    gap = explain_peak_gap(100 * MiB, _stats(101 * MiB, 101 * MiB, 101 * MiB))
    assert not gap.explained and gap.lines() == []


def test_copies_in_flight_at_the_guards_highest_reading_are_late_releases():
    # planned 100; the guard read 130 while 20 were held for copies in flight; the step peaked at 140
    gap = explain_peak_gap(100 * MiB, _stats(140 * MiB, 120 * MiB, 110 * MiB, sampled=130 * MiB, in_flight=20 * MiB))
    assert gap.peak_phase == "forward"
    assert gap.categories == {"late release": 20 * MiB, "not in the profiled step": 20 * MiB}
    assert sum(gap.categories.values()) == gap.gap_bytes == 40 * MiB


def test_late_release_is_at_most_the_readings_excess_over_the_plan():
    # at the reading only 5 over the plan, though 50 were in flight: 5 are late, the rest is not
    gap = explain_peak_gap(100 * MiB, _stats(110 * MiB, 130 * MiB, 0, sampled=105 * MiB, in_flight=50 * MiB))
    assert gap.peak_phase == "backward"
    assert gap.categories == {"late release": 5 * MiB, "not in the profiled step": 25 * MiB}


def test_a_peak_in_the_update_is_the_updates():
    gap = explain_peak_gap(100 * MiB, _stats(90 * MiB, 95 * MiB, 120 * MiB, sampled=90 * MiB, in_flight=30 * MiB))
    assert gap.peak_phase == "update"
    assert gap.categories == {"optimizer update": 20 * MiB}
    text = str(gap)
    assert "reached in the update" in text and "fused=True" in text


def test_fragmentation_is_reported_beside_the_gap_not_in_it():
    gap = explain_peak_gap(100 * MiB, _stats(150 * MiB, 120 * MiB, 110 * MiB, reserved=180 * MiB))
    assert gap.fragmentation_bytes == 30 * MiB
    assert sum(gap.categories.values()) == 50 * MiB
    assert "reserved 30.00 MiB beyond its allocated peak" in str(gap)


class ScriptedMeter:
    """Stands in for the device allocator's counters (profiler.unmodeled.DeviceCounters): peak()
    returns the next scripted reading, the last one repeated."""

    def __init__(self, readings, reserved=0):
        self.readings, self.reserved, self.resets, self.reads = list(readings), reserved, 0, 0

    def peak(self):
        self.reads += 1
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]

    def reset(self):
        self.resets += 1

    def reserved_peak(self):
        return self.reserved


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(64, 32)


def _on_the_device(monkeypatch, run, meter):
    monkeypatch.setattr(run, "_measures_device_peak", lambda: True)
    monkeypatch.setattr(run.executor, "meter", meter)


def test_a_planned_steps_peak_covers_its_update_and_the_report_explains_it(monkeypatch):
    model, opt, x = _setup()
    with optimize(model, opt, budget=0.7, planner="dp") as run:
        model(x).sum().backward()
        run.step()  # profiled and planned (no meter yet: nothing read)
        planned = run.planned_figures()["peak_bytes"]
        budget = run._budget_with_state()
        # forward and backward within the plan, the update half as much again (only the profiled
        # step's update is checked against the budget: no plan changes an update)
        update = int(planned * 1.5)
        meter = ScriptedMeter([planned, planned, update], reserved=int(budget * 2))
        _on_the_device(monkeypatch, run, meter)
        model(x).sum().backward()
        run.step()
        stats = run.step_stats[-1]
        assert stats.phase_peaks == PhasePeaks(forward=planned, backward=planned, update=update)
        assert stats.peak_bytes == update, "the step's peak includes its update"
        assert stats.reserved_peak_bytes == int(budget * 2)
        assert meter.resets == 0, "a planned step's peak is never restarted mid-step"
        report = run.report(file=open("/dev/null", "w"))
    assert report.peak_gap is not None and report.peak_gap.peak_phase == "update"
    assert report.peak_gap.categories == {"optimizer update": update - planned}
    assert report.peak_gap.fragmentation_bytes == int(budget * 2) - update
    assert "reached in the update" in report.table and "optimizer update:" in report.table
    assert "budget held: NO" in report.table


def test_the_profiled_steps_update_over_a_byte_budget_is_refused_after_it_ran(monkeypatch):
    model, opt, x = _setup()
    with optimize(model, opt, budget="1GiB", planner="dp") as run:
        before = [p.detach().clone() for p in model.parameters()]
        meter = ScriptedMeter([10 ** 12])  # the update's peak: far above any budget of this model
        _on_the_device(monkeypatch, run, meter)
        model(x).sum().backward()
        with pytest.raises(memsched.MemschedError, match=r"The least budget the update meets is 1000000000000 bytes"):
            run.step()
        assert meter.resets == 1, "the update's own peak: restarted after the profiled step's per-op resets"
        assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), \
            "the step completed: its update ran, as in plain PyTorch"
        assert run.profiled_update_peak_ == 10 ** 12
    # an update within the budget trains on; the plan shows what it expects of every update
    model, opt, x = _setup()
    with optimize(model, opt, budget=0.7, planner="dp") as run:
        _on_the_device(monkeypatch, run, ScriptedMeter([1]))
        model(x).sum().backward()
        run.step()
        assert run.planned_figures()["update_peak_bytes"] == 1


def test_an_update_over_a_fractions_budget_warns(monkeypatch):
    """A fraction is a share of the saved activations' memory, which the update is not: the update
    above the bytes it came to warns (run.report() shows the update as the gap) instead of refusing."""
    model, opt, x = _setup()
    with optimize(model, opt, budget=0.7, planner="dp") as run:
        _on_the_device(monkeypatch, run, ScriptedMeter([10 ** 12]))
        model(x).sum().backward()
        with pytest.warns(RuntimeWarning, match=r"the optimizer update .*every step will peak there.*fused=True"):
            run.step()
        assert run.planned_figures()["update_peak_bytes"] == 10 ** 12


def test_a_fused_update_is_not_measured_as_an_update(monkeypatch):
    """fuse_optimizer=True updates inside backward: nothing runs at the step boundary, so no update
    peak is read (the backward's covers it) and nothing is checked against the budget there."""
    model, opt, x = _setup()
    meter = ScriptedMeter([10 ** 12])
    with optimize(model, opt, budget="1GiB", planner="dp", fuse_optimizer=True) as run:
        _on_the_device(monkeypatch, run, meter)
        model(x).sum().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            run.step()
        assert meter.reads == 0 and run.profiled_update_peak_ is None
        assert "update_peak_bytes" not in run.planned_figures()


def test_a_loop_that_calls_optimizer_step_itself_is_refused_alike(monkeypatch):
    """Trainer-style loops step the optimizer themselves (Note [optimizer.step() without run.step()])."""
    model, opt, x = _setup()
    with optimize(model, opt, budget="1GiB", planner="dp") as run:
        _on_the_device(monkeypatch, run, ScriptedMeter([10 ** 12]))
        model(x).sum().backward()
        with pytest.raises(memsched.MemschedError, match="The least budget the update meets"):
            opt.step()
        assert run.steps_profiled == 1 and run.planned_figures()["update_peak_bytes"] == 10 ** 12


def test_an_update_refusal_echoes_a_budget_written_with_units(monkeypatch):
    """It said "budget 1048576 (1.00 MiB)" for budget="1MiB"."""
    model, opt, x = _setup()
    with optimize(model, opt, budget="1MiB", planner="dp") as run:
        _on_the_device(monkeypatch, run, ScriptedMeter([10 ** 12]))
        model(x).sum().backward()
        with pytest.raises(memsched.MemschedError, match=r"^budget '1MiB' \(1.00 MiB\): the optimizer update"):
            run.step()


def test_a_refused_plan_leaves_no_update_check_for_a_step_that_was_not_profiled(monkeypatch):
    """A profiled step whose plan is refused never reaches its update; the update check it armed
    stayed armed, so the next step boundary without a profiled step (here run.step() again, no
    forward) measured that update as the profiled step's and refused it: 'the optimizer update
    (optimizer.step()) of the profiled step peaked at ...', of a step that was never profiled."""
    model, opt, x = _setup()
    with optimize(model, opt, budget="1KiB", planner="dp") as run:
        _on_the_device(monkeypatch, run, ScriptedMeter([10 ** 12]))
        model(x).sum().backward()
        with pytest.raises(memsched.MemschedError, match="below the least budget"):
            run.step()
        run.step()  # nothing to update: the refused step's gradients were dropped
        assert run.profiled_update_peak_ is None


class SettableMeter(ScriptedMeter):
    def __init__(self):
        super().__init__([1])

    def set(self, value):
        self.readings = [value]


def test_after_a_re_profile_the_report_holds_each_step_to_its_own_plan(monkeypatch):
    """A lasting change (the batch shrinks for good) is profiled and planned for its shapes (Note [One plan
    per input shape]); with a fraction the budget is re-resolved, lower. The steps of the first plan were
    held to the new plan's budget and peak: 'budget held: NO' and a peak gap of over 100% 'not in the
    profiled step', for steps that met their own plan."""
    model, opt, _ = _setup()
    g = torch.Generator().manual_seed(1)
    meter = SettableMeter()
    with optimize(model, opt, budget=0.5, planner="dp") as run:
        _on_the_device(monkeypatch, run, meter)

        def step(n):
            model(torch.randn(n, 32, generator=g)).sum().backward()
            run.step()

        step(256)  # profiled (its update reads 1 byte: within any budget)
        first_plan = run.planned_figures()["peak_bytes"]
        meter.set(first_plan)  # the planned steps meet their plan exactly
        step(256)
        step(256)
        meter.set(1)
        step(64)  # profiled for its new shapes
        second_plan = run.planned_figures()["peak_bytes"]
        assert run.shape_profiles == 1 and second_plan < first_plan / 1.02
        meter.set(second_plan)
        step(64)
        step(64)
        report = run.report(file=open("/dev/null", "w"))
    assert [s.mode for s in run.step_stats] == ["planned"] * 4 and [s.plan_index for s in run.step_stats] == [1, 1, 2, 2]
    assert report.peak_gap is not None and not report.peak_gap.explained, str(report.peak_gap)
    assert "budget held: yes" in report.table, report.table
