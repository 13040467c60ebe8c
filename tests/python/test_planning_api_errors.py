"""memsched.planning.compare and a DeviceModel passed as device: bad arguments are errors naming the
argument, before any work -- never a pybind11 signature dump, a silently split planner name, or a
simulation reporting an infinite step time."""
import math

import pytest

import memsched
from memsched import planning
from trace_helpers import two_activation_trace


@pytest.mark.parametrize("trace", [None, "t.json", 5])
def test_compare_checks_the_trace(trace):
    with pytest.raises(TypeError, match="trace: expected a memsched.Trace"):
        planning.compare(trace, None)


def test_compare_reads_one_planner_name_as_one_planner():
    rows = planning.compare(two_activation_trace(), None, planners="dp")
    assert [r["planner"] for r in rows] == ["dp"]  # was: rows for planners 'd' and 'p'
    assert rows[0]["ok"]


@pytest.mark.parametrize("planners", [["nope"], "nope", ["dp", 3], 5])
def test_compare_refuses_unknown_planners(planners):
    with pytest.raises(ValueError, match="planners"):
        planning.compare(two_activation_trace(), None, planners=planners)


@pytest.mark.parametrize("planners", ["all", None, ["keep_all", "dp"]])
def test_compare_planner_forms(planners):
    rows = planning.compare(two_activation_trace(), None, planners=planners)
    assert rows and all(r["ok"] for r in rows)


def _model(**fields):
    base = memsched.load_device("h100-pcie")
    d = memsched.DeviceModel()
    for f in ("peak_flops", "hbm_bw_gbps", "d2h_bw_gbps", "h2d_bw_gbps", "d2h_latency_us", "h2d_latency_us",
              "memory_bytes"):
        setattr(d, f, fields.get(f, getattr(base, f)))
    return d


@pytest.mark.parametrize("field", ["d2h_latency_us", "h2d_latency_us", "peak_flops", "hbm_bw_gbps",
                                   "d2h_bw_gbps", "h2d_bw_gbps"])
def test_device_model_with_an_infinite_field_is_refused(field):
    d = _model(**{field: math.inf})
    t = two_activation_trace()
    with pytest.raises(ValueError, match=f"device: .*'{field}' must be a finite number"):
        planning.plan(t, None, "offload_all_sync", device=d)
    with pytest.raises(ValueError, match=field):
        planning.simulate(t, planning.plan(t, None, "offload_all_sync"), device=d)


def test_device_model_with_finite_fields_simulates_finitely():
    d = _model()
    t = two_activation_trace()
    r = planning.simulate(t, planning.plan(t, None, "offload_all_sync", device=d), device=d)
    assert math.isfinite(r.step_time_us) and math.isfinite(r.stall_us)
