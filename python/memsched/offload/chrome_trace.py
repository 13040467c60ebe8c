"""The step timeline as a Chrome trace event file (opens in Perfetto and chrome://tracing).

Entry points: timeline_trace(...) -> dict (the JSON object), write_json(path, obj),
merge_with_torch_trace(obj, torch_trace_path, offset_us=None) -> dict. run.save_timeline("x.json")
calls them (optimize.py); the PNG of report.save_timeline() shows the same data.

Note [Timeline as a Chrome trace]
  Rationale: people who profile GPUs read torch.profiler's Chrome/Perfetto traces, not our PNG;
  the same file format lets them open memsched's step next to (or merged into) such a trace.
  Approach: the JSON Object Format of the Trace Event Format: {"traceEvents": [...],
  "displayTimeUnit": "ms", "memsched": {summary}}. Time stamps and durations are microseconds
  (floats) from the start of the step (its first forward op); durations are never negative.
  Two processes:
    pid 1 "memsched planned (simulated)": the simulator's compute stream (one "X" event per op,
      named by the op, args: op id, module, phase; a hybrid plan's recompute of a tensor is one "X"
      named "recompute tensor N", cat "recompute", args: tensor id, label, bytes), its D2H and H2D copy streams (one "X" per
      copy, args: tensor id, label, bytes; copies the plan runs on the compute stream --
      offload_all_sync, save_on_cpu -- are on the copy tracks with on_compute_stream: true), the
      compute stream's stalls ("X" on their own track, ending where the waiting op starts) and
      the memory counter ("C", bytes): on CUDA the simulator's device memory, on CPU the planned
      saved-activation curve (what the CPU run measures). Without a simulation (no plan: keep
      everything) the ops are laid end to end by their profiled durations.
    pid 2 "memsched measured (last executed step)", only with timeline=True: the step's wall clock
      span, the measured D2H / H2D copies, and the measured memory counter (CUDA:
      memory_allocated; CPU: saved-activation storages alive). Ops are not timed one by one in
      executed steps (that is the profiler's cost), and stalls are only known as a total: it is
      in the step event's args and in "memsched".
  Merging: torch.profiler's trace has absolute time stamps. merge_with_torch_trace() appends our
  events to its traceEvents with our pids moved above every pid it uses and our time stamps
  shifted by offset_us: by default the start of its last "ProfilerStep#N" event (the last step
  prof.step() marked), else its first event. Limitation: that alignment puts our step start on the
  profiled step start; the two clocks are not otherwise tied together.
"""
import json
import math
import os

PID_PLANNED = 1
PID_MEASURED = 2
TID_COMPUTE = 1
TID_D2H = 2
TID_H2D = 3
TID_STALL = 4
_TRACKS = {TID_COMPUTE: "compute stream", TID_D2H: "D2H copies", TID_H2D: "H2D copies",
           TID_STALL: "compute stalls (waiting for H2D)"}
_COPY_TID = {"d2h": TID_D2H, "h2d": TID_H2D}


def _us(x):
    """A finite, non-negative float of microseconds."""
    x = float(x)
    return x if math.isfinite(x) and x > 0 else 0.0


def _span(name, cat, pid, tid, start_us, end_us, args=None):
    start = _us(start_us)
    ev = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": start,
          "dur": max(0.0, _us(end_us) - start)}
    if args:
        ev["args"] = args
    return ev


def _counter(name, pid, t_us, nbytes):
    return {"name": name, "cat": "memory", "ph": "C", "pid": pid, "tid": 0, "ts": _us(t_us),
            "args": {"bytes": int(nbytes)}}


def _metadata(pid, process, tids):
    out = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process}},
           {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
    for tid in tids:
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": _TRACKS[tid]}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return out


def _op_args(op):
    return {"op_id": op.id, "module": op.module_path, "phase": op.phase, "profiled_us": op.duration_us}


def _tensor_args(tensors, tensor_id, nbytes, on_compute_stream=False):
    """tensors: trace.tensors, read once by the caller (each read copies every record)."""
    args = {"tensor_id": tensor_id, "bytes": int(nbytes)}
    if 0 <= tensor_id < len(tensors) and tensors[tensor_id].label:
        args["label"] = tensors[tensor_id].label
    if on_compute_stream:
        args["on_compute_stream"] = True
    return args


def planned_events(trace, simulation, memory, memory_name):
    """Events of pid 1: the simulated step (or the profiled ops end to end without a simulation).
    memory: [(t_s, bytes)] the counter to draw (Run._planned_timeline()'s curve)."""
    ev = _metadata(PID_PLANNED, "memsched planned (simulated)", (TID_COMPUTE, TID_D2H, TID_H2D, TID_STALL))
    ops = trace.ops
    tensors = trace.tensors  # once: each read of the property copies every record (Note [Element lists are copies])
    if simulation is not None:
        tl = simulation.timeline
        for e in tl.get("compute", []):
            if e["kind"] == "op":
                op = ops[e["id"]]
                ev.append(_span(op.name, "compute", PID_PLANNED, TID_COMPUTE, e["start_us"], e["end_us"],
                                _op_args(op)))
            elif e["kind"] == "recompute":  # the ops that recreate tensor e["id"], on the compute stream
                ev.append(_span(f"recompute tensor {e['id']}", "recompute", PID_PLANNED, TID_COMPUTE,
                                e["start_us"], e["end_us"], _tensor_args(tensors, e["id"], e["bytes"])))
            else:  # a copy the plan runs on the compute stream (Note [Plan semantics])
                ev.append(_span(f"{e['kind'].upper()} tensor {e['id']}", "copy", PID_PLANNED, _COPY_TID[e["kind"]],
                                e["start_us"], e["end_us"], _tensor_args(tensors, e["id"], e["bytes"], True)))
        for kind, tid in _COPY_TID.items():
            for e in tl.get(kind, []):
                ev.append(_span(f"{kind.upper()} tensor {e['id']}", "copy", PID_PLANNED, tid, e["start_us"],
                                e["end_us"], _tensor_args(tensors, e["id"], e["bytes"])))
        for op, stall, start in zip(ops, simulation.stall_us_per_op, simulation.op_start_us):
            if stall > 0:
                ev.append(_span(f"stall before {op.name}", "stall", PID_PLANNED, TID_STALL, start - stall, start,
                                {"op_id": op.id, "module": op.module_path, "stall_us": stall}))
    else:
        t = 0.0
        for op in ops:
            d = _us(op.duration_us)
            ev.append(_span(op.name, "compute", PID_PLANNED, TID_COMPUTE, t, t + d, _op_args(op)))
            t += d
    ev.extend(_counter(memory_name, PID_PLANNED, t_s * 1e6, b) for t_s, b in memory)
    return ev


def measured_events(stats, memory_name):
    """Events of pid 2 from one executed step's StepStats (recorded with timeline=True)."""
    ev = _metadata(PID_MEASURED, "memsched measured (last executed step)", (TID_COMPUTE, TID_D2H, TID_H2D))
    ev.append(_span("step (measured)", "step", PID_MEASURED, TID_COMPUTE, 0.0, stats.duration_s * 1e6,
                    {"mode": stats.mode, "stall_us": stats.stall_s * 1e6, "offloaded": stats.offloaded,
                     "prefetched": stats.prefetched, "on_demand": stats.on_demand,
                     "d2h_bytes": stats.d2h_bytes, "h2d_bytes": stats.h2d_bytes}))
    for kind, start_s, end_s, nbytes in stats.copies:
        ev.append(_span(kind.upper(), "copy", PID_MEASURED, _COPY_TID[kind], start_s * 1e6, end_s * 1e6,
                        {"bytes": int(nbytes)}))
    ev.extend(_counter(memory_name, PID_MEASURED, t_s * 1e6, b) for t_s, b in stats.samples)
    return ev


def timeline_trace(trace, simulation, planned_memory, memory_name, measured=None, summary=None):
    """The Chrome trace object of one step (Note [Timeline as a Chrome trace]). measured: the
    StepStats of an executed step recorded with timeline=True, or None."""
    events = planned_events(trace, simulation, planned_memory, memory_name)
    if measured is not None:
        events.extend(measured_events(measured, memory_name))
    return {"traceEvents": events, "displayTimeUnit": "ms", "memsched": dict(summary or {})}


def merge_with_torch_trace(obj, torch_trace_path, offset_us=None):
    """Our trace object appended to torch.profiler's Chrome trace (prof.export_chrome_trace(path)):
    pids moved above its own, time stamps shifted by offset_us (default: the start of its last
    ProfilerStep#N, else its first event). Returns the merged object."""
    torch_trace_path = os.fspath(torch_trace_path)
    try:
        with open(torch_trace_path) as f:
            base = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"torch_trace: {torch_trace_path} does not exist; pass the file written by "
                         "torch.profiler's prof.export_chrome_trace(path)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"torch_trace: {torch_trace_path} is not JSON ({e}); pass the file written by "
                         "prof.export_chrome_trace(path)") from None
    if isinstance(base, list):  # the JSON Array Format
        base = {"traceEvents": base}
    if not isinstance(base, dict) or not isinstance(base.get("traceEvents"), list):
        raise ValueError(f"torch_trace: {torch_trace_path} has no 'traceEvents' list; pass the file written by "
                         "prof.export_chrome_trace(path)")
    theirs = base["traceEvents"]
    if offset_us is None:
        steps = [e for e in theirs if isinstance(e, dict) and e.get("ph") == "X"
                 and str(e.get("name", "")).startswith("ProfilerStep#") and isinstance(e.get("ts"), (int, float))]
        stamps = [e["ts"] for e in theirs if isinstance(e, dict) and isinstance(e.get("ts"), (int, float))
                  and e.get("ph") != "M"]
        offset_us = max(steps, key=lambda e: e["ts"])["ts"] if steps else (min(stamps) if stamps else 0.0)
    elif isinstance(offset_us, bool) or not isinstance(offset_us, (int, float)) or not math.isfinite(offset_us) \
            or offset_us < 0:
        raise ValueError(f"offset_us: expected a finite number of microseconds >= 0 (where our step starts on the "
                         f"torch trace's clock; a Chrome trace has no negative time stamps) or None, got {offset_us!r}")
    pids = [e["pid"] for e in theirs if isinstance(e, dict) and isinstance(e.get("pid"), int)
            and not isinstance(e.get("pid"), bool)]
    shift = max(pids, default=0)
    merged = []
    for e in obj["traceEvents"]:
        e = dict(e)
        e["pid"] = e["pid"] + shift
        if e["ph"] == "M" and e["name"] == "process_sort_index":
            e["args"] = {"sort_index": e["args"]["sort_index"] + shift}
        elif e["ph"] != "M":
            e["ts"] = e["ts"] + offset_us
        merged.append(e)
    out = dict(base)
    out["traceEvents"] = theirs + merged
    out["memsched"] = dict(obj.get("memsched", {}), merged_offset_us=offset_us, pid_shift=shift)
    return out


def write_json(path, obj):
    """Write obj to exactly `path` (a folder is a clear error). Returns path."""
    if os.path.isdir(os.fspath(path)):
        raise ValueError(f"save_timeline: path {os.fspath(path)}: is a folder; give a file path, e.g. "
                         f"{os.path.join(os.fspath(path), 'step.json')}")
    with open(path, "w") as f:
        json.dump(obj, f)
    return path
