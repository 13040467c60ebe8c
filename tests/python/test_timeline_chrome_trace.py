"""run.save_timeline("step.json"): a Chrome trace event file (Perfetto) of the simulated step and, with
timeline=True, the measured one; merged into a torch.profiler trace on request. See Note [Timeline as a
Chrome trace] in offload/chrome_trace.py."""
import json

import pytest
import torch
import torch.nn as nn

import memsched
from memsched.offload import chrome_trace


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _train(planner="offload_all_sync", budget=1.0, timeline=True, steps=3):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with memsched.optimize(model, opt, budget=budget, planner=planner, timeline=timeline) as run:
        for s in range(steps):
            g = torch.Generator().manual_seed(s)
            model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
            run.step()
    return run


def _load(path):
    with open(path) as f:
        return json.load(f)


def _tracks(obj):
    """{(pid, tid): thread name} and {pid: process name} from the metadata events."""
    threads, procs = {}, {}
    for e in obj["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
        if e["ph"] == "M" and e["name"] == "process_name":
            procs[e["pid"]] = e["args"]["name"]
    return threads, procs


def test_json_timeline_has_ops_copies_stalls_and_memory_on_their_own_tracks(tmp_path):
    run = _train()
    path = run.save_timeline(tmp_path / "step.json")
    obj = _load(path)
    events = obj["traceEvents"]
    threads, procs = _tracks(obj)
    assert procs == {chrome_trace.PID_PLANNED: "memsched planned (simulated)",
                     chrome_trace.PID_MEASURED: "memsched measured (last executed step)"}
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans + [e for e in events if e["ph"] == "C"]:
        assert isinstance(e["ts"], float) and e["ts"] >= 0
    for e in spans:
        assert e["dur"] >= 0
    by_track = {}
    for e in spans:
        by_track.setdefault(threads[(e["pid"], e["tid"])] + f"@{e['pid']}", []).append(e)
    planned = chrome_trace.PID_PLANNED
    ops = by_track["compute stream@1"]
    # every profiled op is one compute event, in order, named by the op, with its module and phase
    assert [e["args"]["op_id"] for e in ops] == list(range(len(run.trace.ops)))
    assert [e["name"] for e in ops] == [op.name for op in run.trace.ops]
    assert {e["args"]["phase"] for e in ops} >= {"forward", "backward"}
    # offload_all_sync: every planned offload is one D2H and one H2D event, with its bytes
    sim = run.simulation
    d2h, h2d = by_track["D2H copies@1"], by_track["H2D copies@1"]
    assert len(d2h) == len(h2d) == run.planned_figures()["offloaded"] > 0
    assert sum(e["args"]["bytes"] for e in d2h) == sim.bytes_to_host
    assert sum(e["args"]["bytes"] for e in h2d) == sim.bytes_to_device
    # stalls: the simulator's per-op stall, ending where the waiting op starts, in microseconds
    stalls = by_track["compute stalls (waiting for H2D)@1"]
    assert stalls and sum(e["dur"] for e in stalls) == pytest.approx(sim.stall_us)
    for e in stalls:
        assert e["ts"] + e["dur"] == pytest.approx(sim.op_start_us[e["args"]["op_id"]])
    # the last op ends at the simulated step time (microseconds, not seconds or ms)
    assert max(e["ts"] + e["dur"] for e in ops) == pytest.approx(sim.step_time_us)
    # memory counters, planned and measured (CPU: saved activations)
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["pid"] for e in counters} == {planned, chrome_trace.PID_MEASURED}
    assert all(e["name"] == "saved activations" and e["args"]["bytes"] >= 0 for e in counters)
    assert max(e["args"]["bytes"] for e in counters if e["pid"] == planned) == \
        run.planned_figures()["activation_peak_bytes"]
    # measured: the step's span and its copies
    step = by_track["compute stream@2"]
    last = run.step_stats[-1]
    assert len(step) == 1 and step[0]["dur"] == pytest.approx(last.duration_s * 1e6)
    assert len(by_track["D2H copies@2"]) == len(by_track["H2D copies@2"]) == last.offloaded > 0
    assert obj["memsched"]["planner"] == "offload_all_sync" and obj["memsched"]["measured_step"] == "planned"


def test_json_timeline_without_recorded_timeline_holds_the_simulation_only(tmp_path):
    run = _train(planner="dp", budget=0.7, timeline=False)
    obj = _load(run.save_timeline(tmp_path / "step.json"))
    assert {e["pid"] for e in obj["traceEvents"]} == {chrome_trace.PID_PLANNED}
    with pytest.raises(RuntimeError, match="timeline=True"):
        run.save_timeline(tmp_path / "step.png")  # the PNG still needs the measured samples


def test_png_timeline_still_works_and_json_options_are_checked(tmp_path):
    run = _train(steps=2)
    assert run.save_timeline(tmp_path / "step.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="torch_trace"):
        run.save_timeline(tmp_path / "step.png", torch_trace=tmp_path / "t.json")
    with pytest.raises(ValueError, match="offset_us: applies with torch_trace"):
        run.save_timeline(tmp_path / "step.json", offset_us=3.0)
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(ValueError, match="is a folder"):
        run.save_timeline(tmp_path / "dir.json")
    with pytest.raises(ValueError, match="torch_trace: .* does not exist"):
        run.save_timeline(tmp_path / "m.json", torch_trace=tmp_path / "missing.json")


def test_merged_into_a_torch_profiler_trace(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    from torch.profiler import ProfilerActivity, profile, schedule
    torch_path = tmp_path / "torch.json"
    with memsched.optimize(model, opt, budget=1.0, planner="offload_all_sync", timeline=True) as run:
        with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
                     on_trace_ready=lambda p: p.export_chrome_trace(str(torch_path))) as prof:
            for s in range(3):
                model(torch.randn(8, 16)).pow(2).mean().backward()
                run.step()
                prof.step()
    theirs = _load(torch_path)["traceEvents"]
    merged = _load(run.save_timeline(tmp_path / "merged.json", torch_trace=torch_path))
    events = merged["traceEvents"]
    assert events[:len(theirs)] == theirs  # torch's events untouched
    ours = events[len(theirs):]
    their_pids = {e["pid"] for e in theirs if isinstance(e.get("pid"), int)}
    assert not their_pids & {e["pid"] for e in ours}
    steps = [e for e in theirs if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    start = max(e["ts"] for e in steps)
    assert merged["memsched"]["merged_offset_us"] == start
    assert min(e["ts"] for e in ours if e["ph"] != "M") == pytest.approx(start)


def test_a_plan_that_recomputes_has_its_recompute_spans_on_the_compute_track(tmp_path):
    from device_helpers import slow_copies  # copies cost seconds: the hybrid planner recomputes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with memsched.optimize(model, opt, budget=0.5, planner="hybrid", device_model=slow_copies()) as run:
        for s in range(3):
            g = torch.Generator().manual_seed(s)
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            run.step()
    assert run.step_stats[-1].recomputed > 0
    run.save_timeline(str(tmp_path / "step.json"))
    obj = _load(tmp_path / "step.json")
    recomputes = [e for e in obj["traceEvents"] if e.get("cat") == "recompute"]
    planned = sum(bool(getattr(d, "recompute", False)) for d in run.plan.decisions)
    assert len(recomputes) == planned > 0
    assert all(e["ph"] == "X" and e["pid"] == 1 and e["dur"] >= 0 and e["args"]["bytes"] > 0 for e in recomputes)
