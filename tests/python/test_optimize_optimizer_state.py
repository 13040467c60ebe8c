"""A byte budget holds the optimizer state that the first optimizer.step() creates (Note [Optimizer state
the profiled step did not see]), and a loop with no step boundary stops being profiled with a warning
(Note [A step with no end]), both in optimize.py."""
import warnings

import pytest
import torch
import torch.nn as nn

import memsched
from memsched import _C


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))


def _batch(s):
    g = torch.Generator().manual_seed(s)
    return torch.randn(64, 32, generator=g)


def _param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _least(model):
    x = _batch(0)
    return _C.least_budget_bytes(memsched.profile(lambda: model(x).pow(2).mean().backward(), model=model))


def test_byte_budget_plans_with_the_adam_state_made_by_the_first_step():
    model = _model()
    budget = _least(_model()) + 4 * _param_bytes(model)  # fits the state (2x params) with room to spare
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with memsched.optimize(model, opt, budget=budget, planner="dp") as run:
        for s in range(3):
            model(_batch(s)).pow(2).mean().backward()
            run.step()
            if s == 0:
                extra = run.optimizer_state_extra_
    assert extra >= 2 * _param_bytes(model), "exp_avg and exp_avg_sq of every parameter"
    figures = run.planned_figures()
    assert figures["peak_bytes"] == run.simulation.peak_bytes + extra <= budget
    assert run.budget_bytes == budget - extra
    assert run.steps_planned == 2 and run.mismatches == 0


def test_byte_budget_without_room_for_the_state_is_refused_before_the_first_update():
    model = _model()
    budget = _least(_model()) + _param_bytes(model) // 2  # a plan fits the trace, not the AdamW state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with memsched.optimize(model, opt, budget=budget, planner="dp") as run:
        model(_batch(0)).pow(2).mean().backward()
        with pytest.raises(_C.MemschedError, match=r"optimizer state that the first optimizer.step\(\) creates.*"
                                                    r"raise the budget to at least \d+ bytes"):
            run.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and not opt.state


def test_fraction_budgets_need_no_state_correction():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with memsched.optimize(model, opt, budget=0.5, planner="dp") as run:
        model(_batch(0)).pow(2).mean().backward()
        run.step()
        planned = run.budget_bytes
    assert run.optimizer_state_extra_ >= 2 * _param_bytes(model)
    assert planned == memsched.planning.fraction_budget(run.trace, 0.5)[0]


def test_a_loop_without_step_boundary_stops_profiling_and_says_how_to_end_a_step():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memsched.optimize(model, budget=0.5) as run:  # no optimizer passed, and no run.step() below
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for s in range(300):
                model(_batch(s % 4)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    ours = [w for w in caught if "without a step boundary" in str(w.message)]
    assert len(ours) == 1 and "run.step()" in str(ours[0].message)
    assert run.profile_ is None and run.trace is None


def test_a_run_left_before_its_first_step_boundary_says_why_nothing_was_planned():
    # was: silent; run.report() showed "no step planned yet" and nothing more
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match=r"ended while its first step was still being profiled \(5 forwards, "
                                            r"no step boundary\).*run\.step\(\)"):
        with memsched.optimize(model, budget=0.5) as run:  # no optimizer passed, and no run.step() below
            for s in range(5):
                model(_batch(s % 4)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    assert "no step boundary was reached (5 forwards profiled without one)" in run.report().table


def test_a_run_with_step_boundaries_ends_without_that_warning():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memsched.optimize(model, opt, budget=0.5) as run:
            for s in range(3):
                model(_batch(s % 4)).pow(2).mean().backward()
                run.step()
            model(_batch(0)).pow(2).mean().backward()  # a last, unfinished step after planning: no warning
    assert not [w for w in caught if "step boundary" in str(w.message)] and "step boundary" not in run.report().table


def test_a_percent_budget_below_any_plan_is_refused_in_percent():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: the percent is of the profiled peak
    with memsched.optimize(model, opt, budget="1%", planner="dp") as run:
        model(_batch(0)).pow(2).mean().backward()
        with pytest.raises(_C.MemschedError, match=r"budget '1.0%': .* use budget='(\d+(\.\d)?)%' or more") as e:
            run.step()
    import re
    pct = float(re.search(r"use budget='([\d.]+)%'", str(e.value)).group(1))
    # The percent it names works.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memsched.optimize(model, opt, budget=f"{pct}%", planner="dp") as run:
        for s in range(2):
            model(_batch(s)).pow(2).mean().backward()
            run.step()
    assert run.steps_planned == 1


def test_report_shows_the_budget_and_the_planned_peak_both_with_the_state():
    import io

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with memsched.optimize(model, opt, budget=0.5, planner="dp") as run:
        for s in range(2):
            model(_batch(s)).pow(2).mean().backward()
            run.step()
    r = run.report(file=io.StringIO())
    extra = run.optimizer_state_extra_
    assert extra > 0 and r.budget_bytes == run.budget_bytes + extra >= r.planned["peak_bytes"]
    assert "include the" in r.table and "optimizer state the first optimizer.step() created" in r.table


@pytest.mark.parametrize("make", [lambda p: torch.optim.AdamW(p, lr=1e-3),
                                  lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
                                  lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)],
                         ids=["adamw", "adam-amsgrad", "sgd-momentum"])
def test_the_state_is_predicted_before_the_first_update(make):
    """The refusal comes before the first update (parameters unchanged, gradients dropped), and the least
    budget it names works at once; a retry then trains as plain PyTorch."""
    import re

    model, plain = _model(), _model()
    opt = make(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with memsched.optimize(model, opt, budget=_least(_model()), planner="dp") as run:
        model(_batch(0)).pow(2).mean().backward()
        with pytest.raises(_C.MemschedError, match=r"raise the budget to at least (\d+) bytes") as e:
            run.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    least = int(re.search(r"at least (\d+) bytes", str(e.value)).group(1))
    with memsched.optimize(model, opt, budget=least, planner="dp") as run:
        for s in range(3):
            model(_batch(s)).pow(2).mean().backward()
            run.step()
    assert run.steps_planned == 2 and run.optimizer_state_extra_ > 0
    popt = make(plain.parameters())
    for s in range(3):
        plain(_batch(s)).pow(2).mean().backward()
        popt.step()
        popt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


@pytest.mark.parametrize("ooo", [False, True])
def test_sparse_optimizer_state_is_counted_and_trains_as_plain(ooo):
    """SGD's momentum buffer of an nn.Embedding(sparse=True) is a sparse tensor, which has no storage of its
    own: counting the state raised 'Cannot access storage of SparseTensorImpl' at the first run.step(),
    after that step's update."""
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.head = nn.Embedding(32, 16, sparse=True), nn.Linear(16, 32)

        def forward(self, x):
            return self.head(self.emb(x))

    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 32, (4, 6), generator=g), torch.randint(0, 32, (24,), generator=g)) for _ in range(3)]
    plain, m = Tagger(), Tagger()
    popt, mopt = (torch.optim.SGD(x.parameters(), lr=0.1, momentum=0.9) for x in (plain, m))
    for x, y in data:
        nn.functional.cross_entropy(plain(x).reshape(-1, 32), y).backward()
        popt.step()
        popt.zero_grad()
    with memsched.optimize(m, mopt, budget=0.7, ooo=ooo) as run:
        for x, y in data:
            nn.functional.cross_entropy(m(x).reshape(-1, 32), y).backward()
            run.step()
    assert run._optimizer_state_bytes() > 0  # the sparse momentum buffer, counted
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q)
