"""memsched.plan / memsched.simulate / device presets / `python -m memsched plan` (issue 3)."""
import os

import pytest

import memsched
from memsched import planning
from memsched.__main__ import main as cli_main


def trace_b():
    """Four 10 us ops: op0 fwd makes A (100 B, read by op3 bwd); op1 fwd makes C (60 B temporary read
    by op2 bwd). Same trace as tests/cpp/sim/test_simulator.cpp."""
    t = memsched.Trace()
    for i, phase in enumerate(["forward", "forward", "backward", "backward"]):
        t.add_op(f"op{i}", phase=phase, duration_us=10.0)
    t.add_tensor(100, "float32", "activation", producer_op=0, uses=[3], freed_after_op=3)
    t.add_tensor(60, "float32", "temporary", producer_op=1, uses=[2], freed_after_op=2)
    t.validate()
    return t


def tiny_device():
    d = memsched.DeviceModel()
    d.name = "tiny"
    d.d2h_bw_gbps = 10e-3  # 10 B/us
    d.h2d_bw_gbps = 20e-3  # 20 B/us
    d.d2h_latency_us = 1.0
    d.h2d_latency_us = 2.0
    return d


def test_simulate_hand_computed_plan():
    # Budget 120 B: op1 waits for A's D2H (10 -> 21), A's H2D waits for op2 to free C (41 -> 48),
    # op3 waits for A (48). Step 58 us, stalls 11 + 7, peak 100 B (see the C++ test for the steps).
    t = trace_b()
    plan = memsched.Plan()
    plan.planner = "hand"
    plan.budget_bytes = 120
    plan.decisions = [memsched._C.TensorDecision(0, True, 0, 2)]
    r = memsched.simulate(t, plan, device=tiny_device())
    assert r.step_time_us == 58.0
    assert r.stall_us == 18.0
    assert r.stall_us_per_op == [0.0, 11.0, 0.0, 7.0]
    assert r.peak_bytes == 100
    assert (r.bytes_to_host, r.bytes_to_device) == (100, 100)
    tl = r.timeline
    assert set(tl) == {"compute", "d2h", "h2d", "memory"}
    assert [(e["start_us"], e["end_us"]) for e in tl["d2h"]] == [(10.0, 21.0)]
    assert [(e["start_us"], e["end_us"]) for e in tl["h2d"]] == [(41.0, 48.0)]
    assert [e["id"] for e in tl["compute"]] == [0, 1, 2, 3]
    assert max(b for _, b in tl["memory"]) == 100
    r.check_invariants(t, plan)


@pytest.fixture(scope="module")
def synthetic():
    return memsched._C.synthetic_trace(num_layers=12, ops_per_layer=2, seed=5)


@pytest.mark.parametrize("planner", planning.planner_names())
def test_every_planner_within_budget(synthetic, planner):
    least = memsched._C.least_budget_bytes(synthetic)
    budget = (least + synthetic.peak_bytes()) // 2
    try:
        plan = memsched.plan(synthetic, budget=budget, planner=planner, device="h100-pcie")
    except memsched.MemschedError as e:
        assert planner in ("keep_all", "vdnn") and "needs at least" in str(e)
        return
    assert plan.planner == planner and plan.budget_bytes == budget
    ids = [d.tensor_id for d in plan.decisions]
    assert ids == sorted(ids) == memsched._C.offloadable_tensor_ids(synthetic)
    r = memsched.simulate(synthetic, plan, device="h100-pcie")
    assert r.peak_bytes <= budget and not r.over_budget
    assert r.step_time_us == pytest.approx(r.compute_us + r.recompute_us + r.stall_us)
    assert r.bytes_to_host == r.bytes_to_device == plan.offloaded_bytes(synthetic)
    r.check_invariants(synthetic, plan)


def test_budget_forms(synthetic):
    peak = synthetic.peak_bytes()
    assert planning.resolve_budget("50%", synthetic) == int(peak * 0.5)
    assert planning.resolve_budget("6GiB", synthetic) == 6 * 2**30
    assert planning.resolve_budget(12345, synthetic) == 12345
    p = memsched.plan(synthetic, budget="70%", planner="dp")
    assert p.budget_bytes == int(peak * 0.7)
    with pytest.raises(ValueError, match="budget"):
        memsched.plan(synthetic, budget="lots", planner="dp")
    with pytest.raises(ValueError, match="percentage"):
        planning.resolve_budget("x%", synthetic)


def test_budget_below_least_states_it(synthetic):
    least = memsched._C.least_budget_bytes(synthetic)
    with pytest.raises(memsched.MemschedError, match=f"at least {least} bytes"):
        memsched.plan(synthetic, budget=least - 1, planner="dp")


def test_bad_planner_and_device(synthetic):
    with pytest.raises(ValueError, match="known planners: keep_all"):
        memsched.plan(synthetic, budget="50%", planner="magic")
    with pytest.raises(ValueError, match="known presets"):
        memsched.plan(synthetic, budget="50%", device="tpu-v9")
    with pytest.raises(TypeError, match="memsched.Trace"):
        memsched.plan("trace.json", budget="50%")


def test_presets_and_durations(synthetic):
    assert {"h100-pcie", "h100-sxm", "cpu"} <= set(memsched.device.device_presets())
    d = memsched.load_device("h100-pcie5")  # alias
    assert d.name == "h100-pcie" and d.h2d_bw_gbps > 0 and "datasheet" in d.source
    cpu_trace = trace_b()
    cpu_trace.device = "cpu"
    # A CPU trace on a GPU preset: roofline; on the cpu preset: measured durations.
    assert not memsched.device.resolve_device("h100-sxm", cpu_trace).use_measured_durations
    assert memsched.device.resolve_device("cpu", cpu_trace).use_measured_durations
    assert memsched.device.resolve_device("h100-sxm", synthetic).use_measured_durations
    assert not memsched.device.resolve_device("h100-sxm", synthetic, durations="roofline").use_measured_durations
    # A DeviceModel is used as given.
    own = tiny_device()
    own.use_measured_durations = False
    assert not memsched.device.resolve_device(own, synthetic).use_measured_durations


def test_measure_device_without_gpu_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(memsched.MemschedError, match="no CUDA device"):
        memsched.measure_device()


@pytest.mark.requires_cuda
def test_measure_device_on_gpu():
    d = memsched.measure_device(copy_bytes=64 << 20, matmul_n=2048, repeats=3)
    assert d.d2h_bw_gbps > 1 and d.h2d_bw_gbps > 1 and d.peak_flops > 1e12 and "measured" in d.source


def test_dp_no_slower_than_heuristics_on_a_profiled_model():
    """On a real (small) transformer trace, dp's simulated step time is the best of all offload-only
    planners, and hybrid's the best of all."""
    model = memsched.models.build_model("transformer", "small")
    step = memsched.models.make_step_fn(model, "transformer", batch=8, size="small")
    trace = memsched.profile(step, model=model)
    for budget in ("50%", "70%"):
        rows = planning.compare(trace, budget)
        ok = {r["planner"]: r for r in rows if r["ok"]}
        assert "dp" in ok, budget
        for name, r in ok.items():
            if name != "hybrid":  # hybrid may recompute, which dp cannot
                assert ok["dp"]["step_time_us"] <= r["step_time_us"] * (1 + 1e-9), (budget, name)
            assert ok["hybrid"]["step_time_us"] <= r["step_time_us"] * (1 + 1e-9), (budget, name)


def test_cli_plan_table_and_png(synthetic, tmp_path, capsys):
    path = tmp_path / "trace.json"
    synthetic.to_json(str(path))
    png = tmp_path / "timeline.png"
    rc = cli_main(["plan", str(path), "--budget", "60%", "--planner", "all", "--out", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    for name in planning.planner_names():
        assert name in out
    assert "vs no budget" in out and "best:" in out
    assert png.exists() and png.stat().st_size > 1000
    rc = cli_main(["plan", str(path), "--budget", "1KiB", "--planner", "dp", "--out", str(png)])
    assert rc == 1
    assert "below the least budget" in capsys.readouterr().out


def test_plan_keeps_its_inputs_for_a_crash_only_when_asked(synthetic, tmp_path, monkeypatch):
    """Note [Planning inputs kept for a crash]: with MEMSCHED_PLAN_DUMP_DIR set every plan() call leaves
    its trace, device model, budget and planner there, and replaying them plans the same decisions;
    without it nothing is written."""
    device = memsched.load_device("h100-pcie")
    device.d2h_latency_us = 7.5  # a field off the preset: the replay must use the model as planned
    monkeypatch.chdir(tmp_path)
    memsched.plan(synthetic, budget="60%", planner="hybrid", device=device)
    assert os.listdir(tmp_path) == []
    monkeypatch.setenv("MEMSCHED_PLAN_DUMP_DIR", str(tmp_path / "dump"))
    plans = [memsched.plan(synthetic, budget=b, planner=p, device=device)
             for b, p in (("60%", "hybrid"), ("70%", "dp"))]
    specs = sorted(str(p) for p in (tmp_path / "dump").glob("plan-*[0-9].json"))
    assert len(specs) == 2 and len(list((tmp_path / "dump").glob("*.trace.json"))) == 2
    for spec, plan in zip(specs, plans):
        again = planning.replay_planning_input(spec)
        assert again.planner == plan.planner and again.budget_bytes == plan.budget_bytes
        assert [(d.action, d.offload_after_op, d.prefetch_at_op, d.recompute_at_op) for d in again.decisions] == \
               [(d.action, d.offload_after_op, d.prefetch_at_op, d.recompute_at_op) for d in plan.decisions]
