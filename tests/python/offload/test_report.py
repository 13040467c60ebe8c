"""run.report()'s table (offload/report.py build_report): a measured peak more than 2% above the plan's is
called out with what the plan does not model on that device."""
import io

import torch
import torch.nn as nn

import memsched
from memsched.offload.executor import StepStats
from memsched.offload.report import build_report
from memsched.optimize import optimize


def _report(device, planned, peaks):
    stats = [StepStats(mode="planned", peak_bytes=b, memory_source="x") for b in peaks]
    info = dict(device=device, planner="dp", budget_bytes=1 << 20, steps_profiled=1, host_source="pool")
    return build_report(info, planned, stats)


def test_cpu_activation_peak_above_the_plan_gets_a_note():
    r = _report("cpu", {"activation_peak_bytes": 100_000}, [100_500, 103_000])
    assert "saved-activation peak is 2.93 KiB (3.0%) above the plan's" in r.table


def test_the_measured_column_says_its_peaks_are_the_highest_step():
    r = _report("cpu", {"activation_peak_bytes": 100_000}, [90_000, 99_000, 91_000])
    assert "measured (median; peaks: max)" in r.table
    assert r.measured["activation_peak_bytes"] == 99_000  # the highest step, not the median (91_000)


def test_within_two_percent_no_note():
    r = _report("cpu", {"activation_peak_bytes": 100_000}, [101_500])
    assert "above the plan's" not in r.table


def test_cuda_compares_the_allocator_peak_and_names_unmodelled_memory():
    r = _report("cuda:0", {"peak_bytes": 10 << 30, "activation_peak_bytes": 4 << 30}, [12 << 30])
    assert "peak memory is 2.00 GiB (20.0%) above the plan's" in r.table and "workspaces" in r.table


def test_counts_of_one_read_in_the_singular():
    from memsched.wording import counted
    assert counted(1, "storage") == "1 storage" and counted(0, "storage") == "0 storages"
    assert counted(2, "re-profile") == "2 re-profiles"


def test_largest_planned_activations_are_named_with_module_bytes_and_action():
    from memsched.offload.report import largest_planned
    from memsched.offload.schedule import OffloadSchedule
    s = OffloadSchedule()
    sizes = {0: 100, 1: 4096, 2: 1 << 20, 3: 512, 4: 2048, 5: 8192, 6: 64}
    for k, b in sizes.items():
        s.labels[k] = f"act:{k}:enc.layers.{k}.mlp:[{b // 4}]:float32"
        s.bytes[k] = b
    s.offload = {1, 2, 3, 6}
    s.recompute = {4, 5}
    info = dict(device="cpu", planner="hybrid", budget_bytes=1 << 20, steps_profiled=1, host_source="pool")
    r = build_report(info, {"offloaded": 4, "recomputed": 2}, [], largest=largest_planned(s))
    assert [(a["ordinal"], a["action"]) for a in r.largest] == [(2, "offload"), (5, "recompute"),
                                                                 (1, "offload"), (4, "recompute"), (3, "offload")]
    assert "largest planned activations (5 of 6: 4 offloaded and 2 recomputed):" in r.table
    line = next(l for l in r.table.splitlines() if "enc.layers.2.mlp" in l)
    assert line.split() == ["offload", "1.00", "MiB", "enc.layers.2.mlp", "[262144]", "float32", "act", "2"]
    assert "enc.layers.0.mlp" not in r.table and "enc.layers.6.mlp" not in r.table  # the smallest are left out
    s.recompute = set()
    r = build_report(info, {"offloaded": 4}, [], largest=largest_planned(s, n=3))
    assert "largest planned activations (3 of 4 offloaded):" in r.table


def test_run_report_names_what_a_plan_offloads():
    import torch
    import torch.nn as nn
    import memsched
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    with memsched.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=0.3,
                           planner="offload_all_prefetch") as run:
        for _ in range(2):
            model(torch.randn(16, 32)).sum().backward()
            run.step()
    r = run.report()
    n = len(run.schedule.offload)
    assert n > 0 and len(r.largest) == min(n, 5)
    assert all(a["action"] == "offload" and a["module"] for a in r.largest)
    assert [a["bytes"] for a in r.largest] == sorted((a["bytes"] for a in r.largest), reverse=True)
    assert "offload" in r.table and r.largest[0]["module"] in r.table


def test_a_stall_a_hair_below_zero_prints_as_zero():
    r = _report("cpu", {"stall_s": -1e-12, "activation_peak_bytes": 1}, [1])
    line = next(l for l in r.table.splitlines() if l.startswith("stall time"))
    assert "-0.00" not in line and "0.00 ms" in line


def test_report_says_what_a_fraction_came_to_and_whether_the_budget_held(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 32)
    with optimize(model, opt, budget=0.7, planner="dp") as run:
        for _ in range(3):
            model(x).sum().backward()
            run.step()
        table = run.report(file=io.StringIO()).table
        assert f"budget 0.7 = {memsched.format_bytes(run.budget_bytes)};" in table.splitlines()[0]
        assert "budget held: not measured on this device" in table
        # where the allocator's peak is measured (CUDA), the answer is yes or NO with the figures
        monkeypatch.setattr(run, "_measures_device_peak", lambda: True)
        budget = run._budget_with_state()
        for s in run.step_stats:
            s.peak_bytes = budget
        assert "budget held: yes" in run.report(file=io.StringIO()).table
        run.step_stats[-1].peak_bytes = int(budget * 1.05)
        assert "budget held: NO, 1 planned step over the budget" in run.report(file=io.StringIO()).table
