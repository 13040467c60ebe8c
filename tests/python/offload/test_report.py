"""run.report()'s table (offload/report.py build_report): a measured peak more than 2% above the plan's is
called out with what the plan does not model on that device."""
from memsched.offload.executor import StepStats
from memsched.offload.report import build_report


def _report(device, planned, peaks):
    stats = [StepStats(mode="planned", peak_bytes=b, memory_source="x") for b in peaks]
    info = dict(device=device, planner="dp", budget_bytes=1 << 20, steps_profiled=1, host_source="pool")
    return build_report(info, planned, stats)


def test_cpu_activation_peak_above_the_plan_gets_a_note():
    r = _report("cpu", {"activation_peak_bytes": 100_000}, [100_500, 103_000])
    assert "saved-activation peak is 2.93 KiB (3.0%) above the plan's" in r.table


def test_within_two_percent_no_note():
    r = _report("cpu", {"activation_peak_bytes": 100_000}, [101_500])
    assert "above the plan's" not in r.table


def test_cuda_compares_the_allocator_peak_and_names_unmodelled_memory():
    r = _report("cuda:0", {"peak_bytes": 10 << 30, "activation_peak_bytes": 4 << 30}, [12 << 30])
    assert "peak memory is 2.00 GiB (20.0%) above the plan's" in r.table and "workspaces" in r.table
