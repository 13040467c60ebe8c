"""Note [A budget the guard cannot meet] (optimize.py): where the measured peak is the device
allocator's, a first planned step more than 2% over the budget raises before its update, naming the
peak it reached. The device counters exist on CUDA only; here the check is pointed at the executor's
stats, whose peak the test sets."""
import pytest
import torch
import torch.nn as nn

import memsched
from memsched.optimize import optimize


def _setup():
    """(model, optimizer, batch)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(64, 32)


def _peaks_at(monkeypatch, run, fraction_of_budget):
    monkeypatch.setattr(run, "_measures_device_peak", lambda: True)
    end_step = run.executor.end_step

    def measured():
        stats = end_step()
        if stats is not None:
            stats.peak_bytes = int(run._budget_with_state() * fraction_of_budget)
        return stats

    monkeypatch.setattr(run.executor, "end_step", measured)


def test_first_planned_step_over_the_budget_raises_before_its_update(monkeypatch):
    model, opt, x = _setup()
    with optimize(model, opt, budget=0.7, planner="dp") as run:
        model(x).sum().backward()
        run.step()  # profiled and planned
        _peaks_at(monkeypatch, run, 1.10)
        before = [p.detach().clone() for p in model.parameters()]
        model(x).sum().backward()
        with pytest.raises(memsched.MemschedError, match=r"The least budget this step met is (\d+) bytes") as err:
            run.step()
        least = int(err.value.args[0].split("The least budget this step met is ")[1].split(" ")[0])
        assert least == int(run._budget_with_state() * 1.10)
        assert "10.0% over" in str(err.value) and "did not run and its gradients were dropped" in str(err.value)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), "the update ran"
        assert all(p.grad is None for p in model.parameters()), "a retry would add to this step's gradients"
        assert run.step_stats[-1].peak_bytes == least  # run.report() shows the step


def test_a_step_within_two_percent_trains_on(monkeypatch):
    model, opt, x = _setup()
    with optimize(model, opt, budget=0.7, planner="dp") as run:
        model(x).sum().backward()
        run.step()
        _peaks_at(monkeypatch, run, 1.019)
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(2):
            model(x).sum().backward()
            run.step()
        assert run.steps_planned == 2
        assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_with_out_of_order_backward_it_warns_and_trains_on(monkeypatch):
    """The fused update ran during backward (and ooo counts the step): refusing after it would leave
    a half-done step, so the same figures come as a warning."""
    model, opt, x = _setup()
    with optimize(model, opt, budget=0.7, planner="dp", fuse_optimizer=True) as run:
        model(x).sum().backward()
        run.step()
        _peaks_at(monkeypatch, run, 1.10)
        model(x).sum().backward()
        with pytest.warns(RuntimeWarning, match="The least budget this step met is"):
            run.step()
        model(x).sum().backward()
        run.step()
        assert run.steps_planned == 2


def test_cpu_runs_are_not_checked_against_an_allocator_peak():
    model, opt, x = _setup()
    with optimize(model, opt, budget=0.7, planner="dp") as run:
        assert not run._measures_device_peak()
        for _ in range(2):
            model(x).sum().backward()
            run.step()
        assert run.steps_planned == 1


def test_a_re_profiled_plans_first_step_is_checked_too(monkeypatch):
    """A lasting change re-profiles and re-plans (Note [A lone mismatching step]); the new plan's first
    planned step is checked against the budget as the first plan's was."""
    model, opt, _ = _setup()
    g = torch.Generator().manual_seed(3)

    def step(n):
        model(torch.randn(n, 32, generator=g)).sum().backward()
        run.step()

    with pytest.warns(RuntimeWarning, match="does not match the profiled trace"):
        with optimize(model, opt, budget=0.7, planner="dp", max_shape_plans=1) as run:
            step(64)  # profiled
            step(64)  # planned, checked: within the budget (no device counters: the executor's count)
            for _ in range(3):
                step(32)  # two mismatching steps, then the re-profiled one
            assert run.reprofiles == 1 and run.steps_profiled == 2
            _peaks_at(monkeypatch, run, 1.10)
            with pytest.raises(memsched.MemschedError, match=r"the first planned step peaked at .*10\.0% over"):
                step(32)


def test_the_refusal_says_in_which_phase_the_step_peaked_and_what_the_plan_did_not_count(monkeypatch):
    """The H100's first refusal named only the peak; where it came (forward or backward) and what it
    was made of (Note [Where the peak went]) is what the next fix starts from."""
    from memsched.offload.peak_gap import PhasePeaks
    model, opt, x = _setup()
    with optimize(model, opt, budget=0.7, planner="dp") as run:
        model(x).sum().backward()
        run.step()
        monkeypatch.setattr(run, "_measures_device_peak", lambda: True)
        end_step = run.executor.end_step

        def measured():
            stats = end_step()
            stats.peak_bytes = int(run._budget_with_state() * 1.3)
            stats.phase_peaks = PhasePeaks(forward=run._budget_with_state() // 2, backward=stats.peak_bytes)
            return stats

        monkeypatch.setattr(run.executor, "end_step", measured)
        model(x).sum().backward()
        with pytest.raises(memsched.MemschedError, match=r"Where it went: peak gap .*reached in the backward\) is "
                                                         r".* over the planned .*: +not in the profiled step"):
            run.step()
