"""memsched.optimize() wired to the real profiler (and the real planners once memsched.plan exists).

The profiler session that optimize() opens inside the user's first step must
record what memsched.profile() records for the same step.
"""
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import memsched
from memsched.optimize import optimize
from offload_standins import install_standins
from test_optimize_cpu import MODELS, _assert_bitwise, _data, _loss, _pair, _train

HAVE_PLANNER = hasattr(memsched, "plan")


@pytest.fixture
def planner_if_missing(monkeypatch):
    install_standins(monkeypatch, only_missing=True)


def _op_rows(trace):
    return [(o.name, o.phase, o.module_path, o.flops, o.bytes_read, o.bytes_written) for o in trace.ops]


def _tensor_rows(trace):
    return [(t.kind, t.label, t.bytes, t.dtype, t.producer_op, t.uses, t.freed_after_op) for t in trace.tensors]


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_optimize_records_what_profile_records(with_optimizer):
    """The trace optimize() records in the user's first step (a ProfilerSession opened at the first
    forward, stopped by run.step()) is memsched.profile()'s trace of the same step: same ops,
    same tensors, same peak. With an optimizer, profile() also records optimizer.step(), which
    optimize() runs after its trace is closed: the forward + backward part must still agree."""
    torch.manual_seed(0)
    model = MODELS["cnn"]()
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if with_optimizer else None
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2) if with_optimizer else None
    x, y = _data("cnn", 0)

    ref = memsched.profile(lambda: _loss("cnn", twin(x), y).backward(), model=twin, optimizer=twin_opt)
    with optimize(model, opt, budget=None, planner="keep_all") as run:
        _loss("cnn", model(x), y).backward()
        run.step()
    got = run.trace
    assert run.steps_profiled == 1 and got.activation_bytes() > 0
    if not with_optimizer:
        assert _op_rows(got) == _op_rows(ref)
        assert _tensor_rows(got) == _tensor_rows(ref)
        assert got.peak_bytes() == ref.peak_bytes() and got.live_bytes() == ref.live_bytes()
    else:
        ref_ops = _op_rows(ref)
        n = len(got.ops)
        assert _op_rows(got) == ref_ops[:n]
        assert {r[1] for r in ref_ops[n:]} == {"optimizer"} and len(ref_ops) > n
        assert [t for t in _tensor_rows(got) if t[0] == "activation"] == \
            [t for t in _tensor_rows(ref) if t[0] == "activation"]
    assert all(o.phase != "optimizer" for o in got.ops)


def _assert_nothing_installed(optimizer):
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


@pytest.mark.parametrize("then", ["retry", "leave"])
def test_profiled_step_that_raises_is_aborted(then):
    """A forward that raises while the ProfilerSession records is dropped: the next step is
    recorded instead (and its trace is profile()'s), or leaving the `with` removes the session."""
    from test_optimize_cpu import Boom, Exploding

    torch.manual_seed(0)
    model = Exploding()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data("mlp", 0)
    with pytest.raises(Boom) if then == "leave" else contextlib.nullcontext():
        with optimize(model, opt, budget=None, planner="keep_all") as run:
            model.explode = True
            with pytest.raises(Boom):
                model(x)
            if then == "leave":
                raise Boom("leave the with")
            model.explode = False
            _loss("mlp", model(x), y).backward()
            run.step()
    _assert_nothing_installed(opt)
    if then == "retry":
        ref = memsched.profile(lambda: _loss("mlp", twin(x), y).backward(), model=twin)
        assert run.steps_profiled == 1
        assert _op_rows(run.trace) == _op_rows(ref)
        assert _tensor_rows(run.trace) == _tensor_rows(ref)
    else:
        assert run.steps_profiled == 0 and run.trace is None


def _train_lean(kind, model, run, steps):
    """_train without the gradient clones (which would be part of the profiled step's memory)."""
    for step in range(steps):
        x, y = _data(kind, step)
        _loss(kind, model(x), y).backward()
        run.step()


def _halfway_budget(kind, model):
    """(bytes halfway between the least budget any plan reaches and keep_all's peak, least, peak), with the
    AdamW state that every step after the first holds (Note [Optimizer state the profiled step did not see])."""
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    with optimize(twin, opt, budget=1.0, planner="keep_all") as run:
        _train_lean(kind, twin, run, 1)
    extra = run.optimizer_state_extra_
    least, peak = memsched._C.least_budget_bytes(run.trace) + extra, run.trace.peak_bytes() + extra
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
        assert len(run.schedule.offload) == (run.plan.num_offloaded() - run.schedule.skipped_small
                                            - run.schedule.skipped_held) > 0


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
    extra = run.optimizer_state_extra_
    assert extra > 0 and max(memsched._C.modelled_memory(run.trace, run.plan)) + extra <= run.budget_bytes + extra == budget
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
