"""One plan per input shape (offload/shape_plans.py, Note [One plan per input shape]): batches whose
sequence length changes from step to step run a plan after the first step of each length, with
gradients equal to plain PyTorch's."""
import copy
import sys

import pytest
import torch
import torch.nn as nn

import memsched
from memsched.offload.shape_plans import MAX_SHAPE_PLANS


class _Tagger(nn.Module):
    """Token-wise layers over [batch, length, features]; called as model(tokens=...) like a Hugging Face model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4))

    def forward(self, tokens):
        return self.body(tokens)


def _batches(lengths):
    return [torch.randn(32, n, 16, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(lengths)]


def _train(model, batches, run_kwargs=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if run_kwargs is None:
        for x in batches:
            model(tokens=x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return None
    with memsched.optimize(model, opt, **run_kwargs) as run:
        for x in batches:
            model(tokens=x).pow(2).mean().backward()
            run.step()
    return run


@pytest.mark.parametrize("options", [dict(budget=0.6), dict(budget=0.6, ooo=True, fuse_optimizer=True),
                                     dict(budget=0.6, planner="hybrid")], ids=["dp", "fused", "hybrid"])
def test_lengths_that_change_every_step_each_get_a_plan_and_train_as_plain(options):
    # before: every change of length mismatched, two plain steps and a re-profile each, then plain for good
    lengths = [8, 16, 8, 24, 16, 8, 24, 16, 8, 24]
    plain, m = _Tagger(), _Tagger()
    _train(plain, _batches(lengths))
    run = _train(m, _batches(lengths), options)
    assert run.steps_profiled == 3 and run.shape_profiles == 2 and run.mismatches == 0
    assert [s.mode for s in run.step_stats] == ["planned"] * 7
    assert all(s.offloaded + s.recomputed > 0 for s in run.step_stats)  # each ran its own length's plan
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q), f"max |diff| {(p - q).abs().max().item():.3g}"
    report = run.report(file=open("/dev/null", "w")).table
    assert "3 plans, one per input shape" in report and "[32, 24, 16] float32" in report


def test_more_lengths_than_plans_run_as_before_and_train_as_plain():
    """Past MAX_SHAPE_PLANS signatures a new length meets the current plan: a mismatch, as before."""
    lengths = list(range(4, 4 + MAX_SHAPE_PLANS + 3))
    plain, m = _Tagger(), _Tagger()
    _train(plain, _batches(lengths))
    run = _train(m, _batches(lengths), dict(budget=0.6, max_reprofiles=0))
    assert run.shape_profiles == MAX_SHAPE_PLANS - 1 and run.mismatches == 3
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q)


def test_a_shape_past_max_shape_plans_is_named_and_the_plans_kept_stay_within_it():
    """A step of a new shape past max_shape_plans ran against the current plan and mismatched with no word of
    the cap; a re-profile there filed a plan beyond the cap (9 of 8; found by a helper training with dynamic
    padding as a new user)."""
    lengths = [8, 12, 16, 20, 20, 24, 24, 8, 28, 28, 12]
    plain, m = _Tagger(), _Tagger()
    _train(plain, _batches(lengths))
    with pytest.warns(RuntimeWarning) as caught:
        run = _train(m, _batches(lengths), dict(budget=0.6, max_shape_plans=3))
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q)
    no_room = [str(w.message) for w in caught if "finds no room for a plan of its own" in str(w.message)]
    assert len(no_room) == 1 and "max_shape_plans=3" in no_room[0] and "[32, 20, 16] float32" in no_room[0], no_room
    assert run.reprofiles > 0  # the lengths that stayed got their plan by a re-profile
    assert len(set(run.plans_) | {run.plan_sig_}) <= 3
    report = run.report(file=open("/dev/null", "w")).table
    assert f"{run.steps_without_room_} steps of new input shapes found no room" in report, report


def test_plans_past_the_cap_go_least_recently_used_first():
    """max_shape_plans=2: lengths 8, 12, then 8 again, then 16 three times (no room: two mismatches, then a
    re-profile files 16's plan). The plan dropped to stay within the cap is 12's, left longest ago, so the last
    8-step runs its plan; dropping by first filing dropped 8's."""
    lengths = [8, 12, 8, 16, 16, 16, 8]
    m = _Tagger()
    with pytest.warns(RuntimeWarning):
        run = _train(m, _batches(lengths), dict(budget=0.6, max_shape_plans=2))
    assert run.reprofiles == 1 and len(set(run.plans_) | {run.plan_sig_}) == 2
    assert [s.mode for s in run.step_stats][-1] == "planned", [s.mode for s in run.step_stats]
    assert {sig[0][0][1] for sig in set(run.plans_) | {run.plan_sig_}} == {8, 16}


def test_budget_none_with_a_timeline_runs_every_length_without_a_word():
    """budget=None keeps everything, for any shape: with timeline=True (hooks pushed for its samples) each step
    of another length than the first was "diverged", warned about, and steps were re-profiled (found by a helper
    as a new user). Note [Nothing to match under budget=None]."""
    import warnings

    lengths = [16, 32, 48, 16, 32, 48, 16, 8]
    plain, m = _Tagger(), _Tagger()
    _train(plain, _batches(lengths))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = _train(m, _batches(lengths), dict(budget=None, timeline=True))
    assert run.steps_profiled == 1 and run.mismatches == 0 and run.reprofiles == 0
    assert [s.mode for s in run.step_stats] == ["planned"] * (len(lengths) - 1)
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("timeline", [False, True])
def test_budget_none_still_re_profiles_a_step_that_outgrows_the_device(timeline, monkeypatch):
    """The label check stays silent under budget=None, but a step past the share of the device budget=None keeps
    everything within is still a mismatch, warned and re-profiled, hooked for a timeline or not (the silence had
    covered it; found by a helper reviewing the change). The device's reads are stood in for."""
    import types

    run_module = sys.modules["memsched.optimize"]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=1))
    m = _Tagger()
    with pytest.warns(RuntimeWarning, match="of the device's memory"):
        with memsched.optimize(m, torch.optim.AdamW(m.parameters(), lr=1e-2), budget=None, timeline=timeline) as run:
            for k, x in enumerate(_batches([8, 8, 16, 24])):  # longer batches: labels differ too
                if k == 1:
                    monkeypatch.setattr(run, "_measures_device_peak", lambda: True)
                    monkeypatch.setattr(run_module, "_DEVICE_MEMORY_FRACTION", -1.0)  # every step outgrows it
                m(tokens=x).pow(2).mean().backward()
                run.step()
    assert run.mismatches >= 2 and run.reprofiles >= 1
    diverged = [s for s in run.step_stats if s.mode == "diverged"]
    assert diverged and all("of the device's memory" in s.mismatch for s in diverged), [s.mismatch for s in diverged]


def test_an_evaluation_forward_under_no_grad_does_not_pick_a_plan():
    """An evaluation batch of another shape, under no_grad between steps, is no step of that shape."""
    lengths = [8, 8, 8]
    m = _Tagger()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with memsched.optimize(m, opt, budget=0.6) as run:
        for x in _batches(lengths):
            with torch.no_grad():
                m(tokens=torch.randn(2, 40, 16))
            m(tokens=x).pow(2).mean().backward()
            run.step()
    assert run.shape_profiles == 0 and [s.mode for s in run.step_stats] == ["planned"] * 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_max_shape_plans_is_checked_before_any_step(bad):
    with pytest.raises(ValueError, match=r"max_shape_plans: expected an int >= 1"):
        memsched.optimize(_Tagger(), budget=0.6, max_shape_plans=bad)


def test_one_shape_plan_matches_steps_of_other_shapes_against_the_one_plan():
    """max_shape_plans=1: as before this feature, a step of other shapes mismatches the one plan."""
    run = _train(_Tagger(), _batches([8, 16, 16, 16]), dict(budget=0.6, max_shape_plans=1))
    assert run.shape_profiles == 0 and run.mismatches == 2 and run.reprofiles == 1


@pytest.mark.parametrize("evaluate_first", [False, True], ids=["eval-between-steps", "eval-before-training"])
def test_evaluation_forwards_under_no_grad_do_not_stop_the_plan_per_shape(evaluate_first):
    """An evaluation under no_grad between steps began the executor's step, so the next training forward
    kept the other length's plan and ran plainly; one before the first step opened the profile with no
    shapes, and no step ever switched plans (found by a helper probing per-shape plans)."""
    lengths = [8, 16, 8, 16, 8, 16, 8, 16]
    plain, m = _Tagger(), _Tagger()
    _train(plain, _batches(lengths))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with memsched.optimize(m, opt, budget=0.6) as run:
        for i, x in enumerate(_batches(lengths)):
            if i == 0 or not evaluate_first:
                with torch.no_grad():
                    m(tokens=torch.randn(2, 40, 16))
            m(tokens=x).pow(2).mean().backward()
            run.step()
    assert run.steps_profiled == 2 and [s.mode for s in run.step_stats] == ["planned"] * 6
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q)


def test_a_frozen_parameter_read_by_a_recomputed_chain_does_not_stop_the_recompute():
    """The replay rule keeps a save whose chain reads a parameter without its gradient (Note [A replay that
    reads a parameter without its gradient]); a frozen parameter gets no gradient and is never updated inside
    backward, but every frozen weight was taken for one: a frozen backbone lost its recomputes (found by a
    helper reviewing the rule)."""
    from device_helpers import slow_copies

    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.l1, self.l2, self.out = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8)
            self.shift = nn.Parameter(torch.randn(64), requires_grad=False)  # frozen

        def forward(self, x):
            a = (x + self.shift).sin_()
            return self.out(torch.relu(self.l2(torch.relu(self.l1(a)))))

    m = Shifted()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    data = [(torch.randn(64, 64, generator=torch.Generator().manual_seed(k)), torch.randn(64, 8)) for k in range(4)]
    with memsched.optimize(m, opt, budget=0.6, planner="hybrid", device_model=slow_copies()) as run:
        for x, y in data:
            nn.functional.mse_loss(m(x), y).backward()
            run.step()
    assert all(s.recomputed > 0 for s in run.step_stats), [s.recompute_kept_reasons for s in run.step_stats]


def test_a_run_entered_again_plans_anew():
    """Plans of the first `with` survived into the second, where the model had changed (a layer unfrozen, as
    the unfreeze refusal advises): each step of an old shape mismatched its stale plan."""
    m = _Tagger()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m.body[0].requires_grad_(False)
    run = memsched.optimize(m, opt, budget=0.6, ooo=True)
    for unfreeze in (False, True):
        if unfreeze:
            m.body[0].requires_grad_(True)
        with run:
            for x in _batches([8, 16, 8, 16, 8]):
                m(tokens=x).pow(2).mean().backward()
                run.step()
    assert run.mismatches == 0


def test_a_step_of_new_shapes_that_no_plan_fits_is_refused_and_the_other_shapes_keep_their_plans():
    """A byte budget a longer batch cannot meet: the refusal threw the other shapes' plans away, and every
    later step of them was profiled again."""
    m = _Tagger()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    probe = memsched.profile(lambda: m(tokens=_batches([8])[0]).pow(2).mean().backward(), model=m)
    budget = int(memsched._C.least_budget_bytes(probe) * 1.3)
    m.zero_grad(set_to_none=True)
    refused = []
    with memsched.optimize(m, opt, budget=budget) as run:
        for n in (8, 8, 64, 8, 8):
            try:
                m(tokens=_batches([n])[0]).pow(2).mean().backward()
                run.step()
            except memsched.MemschedError as e:
                refused.append(str(e))
    assert len(refused) == 1 and "a step with new input shapes ([32, 64, 16] float32)" in refused[0]
    assert run.steps_profiled == 2 and [s.mode for s in run.step_stats] == ["planned"] * 3


def test_the_report_after_a_shorter_last_batch_shows_the_plan_that_ran():
    """An epoch's last, shorter batch is profiled for its shapes at the end of training: the report showed
    its plan, with no step measured, instead of the plan every other step ran."""
    run = _train(_Tagger(), _batches([16, 16, 16, 16, 8]), dict(budget=0.6))
    report = run.report(file=open("/dev/null", "w"))
    assert report.steps_planned == 3 and report.measured, report.table
    assert "the figures are those of the plan for inputs [32, 16, 16] float32" in report.table
    assert run.plan_sig_[0][0] == (32, 8, 16)  # the Run itself still holds the last plan


def test_a_micro_batch_of_other_shapes_than_the_first_names_the_fix_and_trains_as_plain():
    """Gradient accumulation whose second micro-batch has another length than the first (dynamic padding per
    micro-batch): the step's plan is chosen by its first forward, so it mismatches; the warning and the report
    say why and what to do (Note [One plan per input shape], Limitations)."""
    steps = [(8, 8), (8, 16), (8, 8), (8, 16)]
    plain, m = _Tagger(), _Tagger()
    batches = _batches([n for step in steps for n in step])
    for run_kwargs in (None, dict(budget=0.6)):
        model = plain if run_kwargs is None else m
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with (memsched.optimize(model, opt, **run_kwargs) if run_kwargs else _NoRun(opt)) as run, \
                pytest.warns(RuntimeWarning) if run_kwargs else _nothing() as caught:
            for i in range(len(steps)):
                for x in batches[2 * i:2 * i + 2]:
                    model(tokens=x).pow(2).mean().backward()
                run.step()
    assert run.mismatches >= 1
    warned = " ".join(str(w.message) for w in caught)
    assert "forward 2 with gradients of this step had inputs [32, 16, 16] float32" in warned
    assert "where the step its plan was made from had [32, 8, 16] float32" in warned
    assert "padding='max_length'" in warned
    report = run.report(file=open("/dev/null", "w")).table
    assert f"of those, {run.mismatches} step" in report and "micro-batch of gradient accumulation" in report
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q), f"max |diff| {(p - q).abs().max().item():.3g}"


@pytest.mark.parametrize("evaluate_first", [False, True], ids=["train_only", "no_grad_forward_first"])
def test_a_micro_batch_compared_with_the_same_micro_batch_of_the_plans_step(evaluate_first):
    """The profiled step's micro-batches had lengths 16 and 32; later steps pad theirs to one length, 16 and 16,
    as the advice says: each mismatches at its second micro-batch, and the warning says so (it compared with
    the first micro-batch, found it equal and said nothing of micro-batches; found by a helper trying the
    advice as a new user). An evaluation forward under no_grad before them does not shift the position."""
    steps = [(16, 32), (16, 16), (16, 16), (16, 16)]
    m = _Tagger()
    batches = _batches([n for step in steps for n in step])
    with memsched.optimize(m, torch.optim.AdamW(m.parameters(), lr=1e-2), budget=0.6, max_reprofiles=0) as run, \
            pytest.warns(RuntimeWarning) as caught:
        for i in range(len(steps)):
            if evaluate_first and i > 0:
                with torch.no_grad():
                    m(tokens=batches[0][:, :8])
            for x in batches[2 * i:2 * i + 2]:
                m(tokens=x).pow(2).mean().backward()
            run.step()
    assert run.mismatches == 3
    warned = " ".join(str(w.message) for w in caught)
    assert "forward 2 with gradients of this step had inputs [32, 16, 16] float32, where the step its plan was made from had " \
           "[32, 32, 16] float32" in warned, warned
    report = run.report(file=open("/dev/null", "w")).table
    assert "of those, 3 steps had a later forward" in report, report


class _NoRun:
    """Plain PyTorch's loop under the same `with` as a Run: step() is optimizer.step() and zero_grad()."""

    def __init__(self, opt):
        self.opt = opt

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step(self):
        self.opt.step()
        self.opt.zero_grad()


class _nothing:
    def __enter__(self):
        return []

    def __exit__(self, *exc):
        return False
