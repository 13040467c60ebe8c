"""memsched.optimize() wired to the real profiler (and the real planners once memsched.plan exists).

The profiler session that optimize() opens inside the user's first step must
record what memsched.profile() records for the same step.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import memsched
from memsched.offload.profile_session import ProfileSession
from memsched.optimize import optimize
from offload_standins import install_standins
from test_optimize_cpu import MODELS, _assert_bitwise, _data, _loss, _pair, _train

HAVE_PLANNER = hasattr(memsched, "plan")


@pytest.fixture
def planner_if_missing(monkeypatch):
    install_standins(monkeypatch, only_missing=True)


def test_session_records_what_profile_records():
    torch.manual_seed(0)
    model = MODELS["cnn"]()
    twin = copy.deepcopy(model)
    x, y = _data("cnn", 0)

    ref = memsched.profile(lambda: _loss("cnn", twin(x), y).backward(), model=twin)
    session = ProfileSession(model, None, "cpu")
    def start(module, args):
        if not session.recording:
            session.start()

    h = model.register_forward_pre_hook(start)
    try:
        _loss("cnn", model(x), y).backward()
    finally:
        h.remove()
    got = session.stop()
    assert [(o.name, o.phase, o.module_path) for o in got.ops] == \
        [(o.name, o.phase, o.module_path) for o in ref.ops]
    assert [(t.label, t.bytes, t.producer_op, t.uses) for t in got.tensors if t.kind == "activation"] == \
        [(t.label, t.bytes, t.producer_op, t.uses) for t in ref.tensors if t.kind == "activation"]
    assert got.activation_bytes() == ref.activation_bytes() > 0


def _train_lean(kind, model, run, steps):
    """_train without the gradient clones (which would be part of the profiled step's memory)."""
    for step in range(steps):
        x, y = _data(kind, step)
        _loss(kind, model(x), y).backward()
        run.step()


def _halfway_budget(kind, model):
    """(bytes halfway between the least budget any plan reaches and keep_all's peak, least, peak)."""
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    with optimize(twin, opt, budget=1.0, planner="keep_all") as run:
        _train_lean(kind, twin, run, 1)
    least, peak = memsched._C.least_budget_bytes(run.trace), run.trace.peak_bytes()
    return (least + peak) // 2, least, peak


@pytest.mark.parametrize("kind", list(MODELS))
def test_real_profiler_and_offload_all_prefetch_is_bitwise(kind, planner_if_missing):
    model, opt, ref, ref_opt = _pair(kind)
    with optimize(model, opt, budget=1.0, planner="offload_all_prefetch") as run:
        grads = _train(kind, model, opt, 3, run=run)
    _assert_bitwise(grads, _train(kind, ref, ref_opt, 3), model, ref)
    assert [s.mode for s in run.step_stats] == ["planned", "planned"]
    assert all(s.offloaded > 0 and s.d2h_bytes > 0 and s.on_demand + s.prefetched == s.offloaded
               for s in run.step_stats)
    if HAVE_PLANNER:
        assert len(run.schedule.offload) == run.plan.num_offloaded() - run.schedule.skipped_small > 0


@pytest.mark.skipif(not HAVE_PLANNER, reason="memsched.plan (planner issue) not in this build")
@pytest.mark.parametrize("kind", list(MODELS))
def test_real_dp_plan_between_least_and_peak_is_bitwise(kind):
    model, opt, ref, ref_opt = _pair(kind)
    budget, least, peak = _halfway_budget(kind, model)
    with optimize(model, opt, budget=budget, planner="dp") as run:
        _train_lean(kind, model, run, 3)
    _train(kind, ref, ref_opt, 3)
    _assert_bitwise([], [], model, ref)
    assert [s.mode for s in run.step_stats] == ["planned", "planned"]
    assert max(memsched._C.modelled_memory(run.trace, run.plan)) <= run.budget_bytes == budget
    if least < peak:
        assert run.plan.num_offloaded() > 0
        assert all(s.offloaded > 0 for s in run.step_stats)


def test_no_budget_on_cpu_keeps_everything():
    model, opt, ref, ref_opt = _pair("mlp")
    with optimize(model, opt) as run:
        grads = _train("mlp", model, opt, 3, run=run)
    _assert_bitwise(grads, _train("mlp", ref, ref_opt, 3), model, ref)
    assert run.plan is None and all(s.offloaded == 0 and s.d2h_bytes == 0 for s in run.step_stats)


@pytest.mark.skipif(not HAVE_PLANNER, reason="memsched.plan (planner issue) not in this build yet")
def test_budget_below_minimum_gives_the_planners_error():
    model, opt, _, _ = _pair("mlp")
    with pytest.raises(memsched.MemschedError, match="budget"):
        with optimize(model, opt, budget=1024, planner="dp") as run:
            _train("mlp", model, opt, 2, run=run)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not model._forward_pre_hooks


@pytest.mark.skipif(not HAVE_PLANNER, reason="memsched.plan (planner issue) not in this build")
def test_offload_all_sync_plan_runs_copies_on_the_compute_stream():
    model, opt, ref, ref_opt = _pair("cnn")
    with optimize(model, opt, budget=1.0, planner="offload_all_sync") as run:
        grads = _train("cnn", model, opt, 3, run=run)
    _assert_bitwise(grads, _train("cnn", ref, ref_opt, 3), model, ref)
    assert run.plan.copies_on_compute_stream and run.executor.engine.on_compute_stream
    assert all(s.offloaded > 0 for s in run.step_stats)


@pytest.mark.skipif(not HAVE_PLANNER, reason="memsched.plan (planner issue) not in this build")
def test_measured_activation_peak_matches_the_plan():
    """On CPU the executor measures saved-activation storages alive; under a dp plan that peak is the
    plan's modelled activation peak, up to the prefetch rounding of Note [Plan ops to backward
    triggers] (at most the tensors of one observable op issued early)."""
    from memsched.offload.report import planned_activation_curve

    model, opt, _, _ = _pair("lstm")
    budget, least, peak = _halfway_budget("lstm", model)
    with optimize(model, opt, budget=budget, planner="dp") as run:
        _train_lean("lstm", model, run, 3)
    planned = max(planned_activation_curve(run.trace, run.plan))
    keep = max(planned_activation_curve(run.trace, None))
    measured = max(s.peak_bytes for s in run.step_stats)
    largest = max(r.bytes for r in run.trace.tensors if r.kind == "activation")
    assert planned < keep
    assert planned <= measured <= planned + largest, (planned, measured, largest)
    r = run.report()
    assert r.planned["activation_peak_bytes"] == planned and r.measured["activation_peak_bytes"] == measured
