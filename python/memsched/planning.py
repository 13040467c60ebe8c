"""memsched.plan / memsched.simulate: plan activation offload for a Trace under a budget, and predict
what the plan does to step time and memory. The algorithms live in csrc/core (planner.h,
simulator.h); this module resolves budgets and device models and formats the comparison table.

Entry points:
  plan(trace, budget, planner="dp", device=None, durations="auto") -> Plan
  simulate(trace, plan, device=None, durations="auto") -> SimResult
  compare(trace, budget, planners="all", device=None) -> list of rows (one per planner)
  format_table(rows), save_timeline(trace, result, path, title)
  planner_names(), resolve_budget(budget, trace)
"""
import math

from memsched import _C
from memsched.device import resolve_device
from memsched.units import format_bytes, parse_bytes

Plan = _C.Plan
SimResult = _C.SimResult
TensorDecision = _C.TensorDecision
_NO_BUDGET = 2**63 - 1


def planner_names():
    """Registered planners, in table order."""
    return list(_C.planner_names())


def resolve_budget(budget, trace):
    """Bytes from an int, a string like "6GiB", a percentage string like "50%" (of the trace's
    keep_all peak), or None (no budget)."""
    if budget is None:
        return _NO_BUDGET
    if isinstance(budget, str) and budget.strip().endswith("%"):
        text = budget.strip()[:-1]
        try:
            pct = float(text)
        except ValueError:
            raise ValueError(f"budget: cannot read {budget!r} as a percentage; write e.g. '50%'") from None
        if not 0 < pct <= 1000:
            raise ValueError(f"budget: percentage must be in (0, 1000], got {budget!r}")
        return int(trace.peak_bytes() * pct / 100.0)
    return parse_bytes(budget, name="budget")


def _check_trace(trace):
    if not isinstance(trace, _C.Trace):
        raise TypeError(f"trace: expected a memsched.Trace (e.g. from memsched.profile or Trace.from_json), "
                        f"got {type(trace).__name__}")


def plan(trace, budget=None, planner="dp", device=None, durations="auto"):
    """Plan which activations leave the device under `budget`.

    budget: bytes, "6GiB", "50%" (of keep_all's peak) or None (no limit). planner: one of
    planner_names(). device: None (default preset), a preset name, or a memsched.DeviceModel.
    Raises memsched.MemschedError when the budget is below what the planner can reach (the message
    states that least budget).
    """
    _check_trace(trace)
    if not isinstance(planner, str) or planner not in planner_names():
        raise ValueError(f"planner: unknown planner {planner!r}; known planners: {', '.join(planner_names())}")
    model = resolve_device(device, trace, durations)
    return _C.make_plan(trace, model, resolve_budget(budget, trace), planner)


def simulate(trace, plan, device=None, durations="auto"):
    """Simulate one step of `trace` executing `plan`: SimResult with step_time_us, stall_us,
    stall_us_per_op, peak_bytes, peak_time_us, bytes_to_host, bytes_to_device, timeline."""
    _check_trace(trace)
    if not isinstance(plan, _C.Plan):
        raise TypeError(f"plan: expected a memsched.Plan (from memsched.plan), got {type(plan).__name__}")
    return _C.simulate(trace, plan, resolve_device(device, trace, durations))


def compare(trace, budget, planners="all", device=None, durations="auto"):
    """Plan and simulate `trace` with each planner at one budget. Returns one dict per planner:
    planner, ok, error, plan, result, step_time_us, stall_us, peak_bytes, bytes_moved (both ways),
    ratio (step time / keep_all's step time without a budget)."""
    names = planner_names() if planners in ("all", None) else list(planners)
    budget_bytes = resolve_budget(budget, trace)
    model = resolve_device(device, trace, durations)
    baseline = _C.simulate(trace, _C.make_plan(trace, model, _NO_BUDGET, "keep_all"), model)
    rows = []
    for name in names:
        row = {"planner": name, "budget_bytes": budget_bytes, "ok": False, "error": None, "plan": None,
               "result": None}
        try:
            p = _C.make_plan(trace, model, budget_bytes, name)
        except _C.MemschedError as e:
            row["error"] = str(e)
            rows.append(row)
            continue
        r = _C.simulate(trace, p, model)
        row.update(ok=True, plan=p, result=r, step_time_us=r.step_time_us, stall_us=r.stall_us,
                   peak_bytes=r.peak_bytes, bytes_moved=r.bytes_to_host + r.bytes_to_device,
                   offloaded=p.num_offloaded(),
                   ratio=r.step_time_us / baseline.step_time_us if baseline.step_time_us > 0 else math.nan)
        rows.append(row)
    return rows


def best_row(rows):
    """The fastest feasible row (ties: fewer bytes moved, then table order); None if none."""
    ok = [r for r in rows if r["ok"]]
    return min(ok, key=lambda r: (r["step_time_us"], r["bytes_moved"])) if ok else None


def format_table(rows):
    """One line per planner: step time, stall, peak, bytes moved, ratio to keep_all (no budget)."""
    header = f"{'planner':<22}{'step (ms)':>11}{'stall (ms)':>12}{'peak':>12}{'moved':>12}{'offloaded':>11}{'vs keep_all':>13}"
    lines = [header, "-" * len(header)]
    for r in rows:
        if not r["ok"]:
            msg = r["error"] or ""
            short = msg.split(":")[0] if "needs at least" not in msg else msg[msg.index("needs at least"):].split(";")[0].split(" (")[0]
            lines.append(f"{r['planner']:<22}  infeasible: {short}")
            continue
        lines.append(f"{r['planner']:<22}{r['step_time_us'] / 1e3:>11.3f}{r['stall_us'] / 1e3:>12.3f}"
                     f"{format_bytes(r['peak_bytes']):>12}{format_bytes(r['bytes_moved']):>12}"
                     f"{r['offloaded']:>11}{r['ratio']:>12.3f}x")
    return "\n".join(lines)


def save_timeline(result, path, title="simulated step", budget_bytes=None):
    """Plot a SimResult: device memory over time (top) and the compute / D2H / H2D streams
    (bottom) to a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result.timeline
    fig, (ax_mem, ax_st) = plt.subplots(2, 1, figsize=(12, 6), sharex=True,
                                        gridspec_kw={"height_ratios": [2, 1]})
    mem = tl["memory"]
    end_ms = result.step_time_us / 1e3
    if mem:
        xs = [t / 1e3 for t, _ in mem] + [end_ms]
        ys = [b / 2**30 for _, b in mem]
        ys = ys + [ys[-1]]
        ax_mem.step(xs, ys, where="post", label="device memory")
    if budget_bytes is None:
        budget_bytes = result.budget_bytes
    if budget_bytes and budget_bytes < _NO_BUDGET:
        ax_mem.axhline(budget_bytes / 2**30, color="red", linestyle="--", label="budget")
    ax_mem.set_ylabel("GiB")
    ax_mem.legend(loc="upper right")
    ax_mem.set_title(title)
    colors = {"op": "tab:blue", "d2h": "tab:orange", "h2d": "tab:green"}
    for row, stream in enumerate(("compute", "d2h", "h2d")):
        spans = [(e["start_us"] / 1e3, (e["end_us"] - e["start_us"]) / 1e3) for e in tl[stream]]
        kinds = [e["kind"] for e in tl[stream]]
        if spans:
            ax_st.broken_barh(spans, (row - 0.4, 0.8), facecolors=[colors[k] for k in kinds])
    ax_st.set_yticks([0, 1, 2])
    ax_st.set_yticklabels(["compute", "D2H", "H2D"])
    ax_st.set_xlabel("time (ms)")
    ax_st.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
