"""memsched.plan / memsched.simulate: plan activation offload for a Trace under a budget, and predict
what the plan does to step time and memory. The algorithms live in csrc/core (planner.h,
simulator.h); this module resolves budgets and device models and formats the comparison table.

Entry points:
  plan(trace, budget, planner="dp", device=None, durations="auto") -> Plan
    (planner="hybrid" may also recompute activations: TensorDecision.action, .recompute_ops)
  simulate(trace, plan, device=None, durations="auto") -> SimResult
  compare(trace, budget, planners="all", device=None) -> list of rows (one per planner)
  format_table(rows), save_timeline(trace, result, path, title)
  planner_names(), parse_budget(budget), resolve_budget(budget, trace), fraction_budget(trace, f)

Note [Budget forms]
  One meaning for memsched.plan, memsched.optimize and `python -m memsched plan --budget`; a budget
  is always the device memory of the whole step (parameters, gradients, optimizer state included):
  - an int, or a string with a unit ("6GiB", "512MiB", "4096"): bytes, in [0, 2**63 - 1]. A float
    that is a whole number > 1 (6e9) is bytes too.
  - a string "P%": P percent of the trace's keep_all peak, P in (0, 1000].
  - a float f in (0, 1] (or a string reading as one, "0.5"): f of plain's activation memory: the
    step's peak if its saved activations never exceeded f times their keep-all peak (the most
    saved-activation bytes live at one op, planned_activation_curve in offload/report.py), i.e.
    max over ops of live bytes - max(0, saved activations - f * activation peak). Where the step's
    peak lies at the activation peak this is peak - (1 - f) * activation peak (the budgets of the
    benchmark). Where it lies elsewhere (gradients in backward, optimizer state, temporaries: what
    activation offload cannot lower) that op's live bytes bound the budget instead, so a fraction is
    never refused for a peak that offload could not have lowered; fraction_budget() names the op.
    Until this Note, plan(budget=0.5) read 0.5 as 0 bytes while optimize read it as a fraction.
  - anything else -- a float > 1 that is not whole, NaN, infinities, negative or out-of-range
    numbers, 0.0, booleans -- is a ValueError naming budget and these forms, before any work.
  - None: no budget.
"""
import json
import math
import numbers
import os

from memsched import _C
from memsched.device import _FIELDS as _DEVICE_FIELDS, resolve_device
from memsched.units import format_bytes, parse_bytes

Plan = _C.Plan
SimResult = _C.SimResult
TensorDecision = _C.TensorDecision
_NO_BUDGET = 2**63 - 1


def planner_names():
    """Registered planners, in table order."""
    return list(_C.planner_names())


BUDGET_FORMS = ("bytes (an int in [0, 2**63 - 1], or a string like '6GiB'), a percentage of keep_all's "
                "peak ('50%'), a fraction of the activation memory (a float in (0, 1], e.g. 0.5), or None "
                "(no limit)")


def parse_budget(budget):
    """Check a budget without a trace; return it normalised: None, int bytes, float fraction in (0, 1],
    or a percentage string "P%" with P in (0, 1000]. See Note [Budget forms].

    Raises ValueError naming budget, the accepted forms and the range.
    """
    if budget is None:
        return None
    if isinstance(budget, bool):
        raise ValueError(f"budget: expected {BUDGET_FORMS}; got {budget!r}")
    if isinstance(budget, str):
        text = budget.strip()
        if text.endswith("%"):
            try:
                pct = float(text[:-1])
            except ValueError:
                raise ValueError(f"budget: cannot read {budget!r} as a percentage; write e.g. '50%'") from None
            if not 0 < pct <= 1000:  # also refuses nan% and inf%
                raise ValueError(f"budget: a percentage of keep_all's peak must be in (0, 1000], got {budget!r}")
            return f"{pct!r}%"
        try:
            number = float(text)
        except ValueError:
            number = None
        if number is None:
            return parse_bytes(budget, name="budget")  # a size with a unit, or a clear error (no chained one)
        if text.isdigit():
            return parse_bytes(budget, name="budget")
        return parse_budget(number)  # "0.5" reads like 0.5, "1e9" like 1e9
    if isinstance(budget, numbers.Integral):
        if budget < 0:
            raise ValueError(f"budget: must not be negative, got {budget!r}; accepted: {BUDGET_FORMS}")
        return parse_bytes(int(budget), name="budget")
    if isinstance(budget, numbers.Real):
        f = float(budget)
        if math.isfinite(f) and 0.0 < f <= 1.0:
            return f
        if math.isfinite(f) and f <= 0.0:
            raise ValueError(f"budget: must be positive, got {budget!r}; accepted: {BUDGET_FORMS}")
        if math.isfinite(f) and f > 1.0 and f == int(f):
            return parse_bytes(f, name="budget")  # a whole number of bytes written as a float (6e9)
        raise ValueError(f"budget: a float is a fraction of the activation memory in (0, 1] (or a whole number "
                         f"of bytes such as 6e9), got {budget!r}; accepted: {BUDGET_FORMS}")
    raise ValueError(f"budget: expected {BUDGET_FORMS}; got {type(budget).__name__}")


def activation_peak_bytes(trace):
    """The most saved-activation bytes live at one op when every activation is kept."""
    from memsched.offload.report import planned_activation_curve
    return max(planned_activation_curve(trace, None), default=0)


def fraction_budget(trace, fraction):
    """(bytes, op id) for budget `fraction` of the activation memory; see Note [Budget forms].

    bytes: the step's peak if its saved activations never exceed `fraction` of their keep-all
    peak; op: the op where that peak lies (-1 for a trace without ops). Where that op's saved
    activations are within the fraction already (the step's peak lies outside what activation offload
    lowers: gradients, optimizer state, temporaries), bytes is that op's live bytes.
    """
    from memsched.offload.report import planned_activation_curve
    live = trace.live_bytes()
    act = planned_activation_curve(trace, None)
    if not live:
        return trace.peak_bytes(), -1
    cap = fraction * max(act, default=0)
    best, best_op = None, -1
    for i, (b, a) in enumerate(zip(live, act)):
        bound = int(b - max(0.0, a - cap))
        if best is None or bound > best:
            best, best_op = bound, i
    return best, best_op


def planner_least_bytes(err, trace):
    """The least budget, bytes, that a planner's refusal `err` names ("raise the budget to at least N
    bytes": the planner's own least, e.g. vdnn's), else the least any plan reaches on `trace`."""
    import re
    found = re.findall(r"raise the budget to at least (\d+) bytes", str(err))
    return int(found[0]) if found else _C.least_budget_bytes(trace)


def least_working_budget(err, trace, try_plan):
    """The least byte budget the planner accepts on `trace`, after it refused one with `err`:
    try_plan(budget_bytes) plans (raising MemschedError when it cannot). Starts from the least that
    `err` names -- below the least any plan reaches, a planner names that least, not its own (vdnn) --
    and follows the next refusal's figure, then bisects up to the keep-all peak (0.1% precision), so
    an error naming it never names a budget that is refused again."""
    least = planner_least_bytes(err, trace)
    for _ in range(4):
        try:
            try_plan(least)
            return least
        except _C.MemschedError as again:
            named = planner_least_bytes(again, trace)
            if named <= least:
                break
            least = named
    lo, hi = least, max(least, trace.peak_bytes())  # the keep-all peak: nothing to offload
    while hi - lo > max(1, hi // 1000):
        mid = (lo + hi) // 2
        try:
            try_plan(mid)
            hi = mid
        except _C.MemschedError:
            lo = mid
    return hi


def percent_refusal(spec, planner, least, peak, budget, peak_what, peak_note=""):
    """The MemschedError for a refused "P%" budget `spec`: the share of `peak_what` (`peak` bytes;
    peak_note follows them) is `budget` bytes, below the `least` bytes `planner` accepts; it names the
    least percent that works, rounded up."""
    pct = math.ceil(1000.0 * least / peak) / 10.0
    return _C.MemschedError(
        f"budget {spec!r}: that share of {peak_what} ({format_bytes(peak)}{peak_note}) is {format_bytes(budget)}, "
        f"below what the {planner} planner reaches ({format_bytes(least)}); use budget='{pct:g}%' or more")


def least_fraction(trace, least_bytes=None):
    """The least budget fraction (of the activation memory) whose byte budget is at least `least_bytes`
    (default: the least any plan reaches on `trace`), to two decimals rounded up; None when even 1.0 is
    below it."""
    least = _C.least_budget_bytes(trace) if least_bytes is None else least_bytes
    if fraction_budget(trace, 1.0)[0] < least:
        return None
    lo, hi = 0.0, 1.0  # fraction_budget grows with the fraction
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fraction_budget(trace, mid)[0] >= least else (mid, hi)
    return math.ceil(hi * 100) / 100


def fraction_refusal(trace, fraction, err, planner="dp", try_plan=None):
    """A MemschedError for a fraction budget the planner refused, in the user's terms: what the fraction
    is of, what it came to on this step, and the least fraction that works (checked with try_plan when
    given; See least_fraction)."""
    from memsched.offload.report import planned_activation_curve
    budget, op_id = fraction_budget(trace, fraction)
    act = planned_activation_curve(trace, None)
    act_peak = max(act, default=0)
    least_bytes = least_working_budget(err, trace, try_plan) if try_plan else planner_least_bytes(err, trace)
    least = least_fraction(trace, least_bytes)
    what = (f"budget {fraction:g}: a fraction is the step's peak memory with its saved activations held to that "
            f"share of their keep-all peak ({format_bytes(act_peak)})")
    if 0 <= op_id < len(act):
        saved = min(act[op_id], fraction * act_peak)
        what += (f"; on this step that is {format_bytes(budget)} at op {op_id} ({format_bytes(saved)} of saved "
                 f"activations plus {format_bytes(budget - saved)} of parameters, gradients and other tensors "
                 f"live there)")
    else:
        what += f"; on this step that is {format_bytes(budget)}"
    what += f", below what the {planner} planner can reach on this step"
    if least is not None:
        # 1.0, not "1": budget=1 is one byte (Note [Budget forms])
        text = f"{least:g}" if least != int(least) else f"{float(least)!r}"
        fix = (f"the least fraction that works is {text} ({format_bytes(fraction_budget(trace, least)[0])}): "
               f"use budget={text} or more")
    else:
        fix = ("even budget=1.0 is below it: activation offload cannot lower this step's peak enough with this "
               "planner; give a byte budget, another planner, or a smaller batch")
    why = f" (planner: {err})" if "cannot meet budget" in str(err) else ""  # a planner's own limits, e.g. vdnn's
    floor = trace.min_offload_bytes
    kept = sum(t.bytes for t in trace.tensors if t.kind == "activation" and 0 < t.bytes < floor) if floor else 0
    if kept:
        # the planners never move an activation below the executor's size floor (Note [The executor's size
        # floor]): a floor above the step's activations was the limit, unnamed (found by a helper)
        why += (f"; activations smaller than min_offload_bytes={floor} ({format_bytes(kept)} of them on this "
                f"step) are never offloaded or recomputed: a lower min_offload_bytes lets a plan reach less")
    return _C.MemschedError(f"{what}; {fix}{why}")


def resolve_budget(budget, trace):
    """Bytes for `budget` on `trace`: an int or a string like "6GiB" as is; "50%": that share of the
    trace's keep_all peak; a float f in (0, 1]: fraction_budget(); None: no budget.
    See Note [Budget forms]."""
    spec = parse_budget(budget)
    if spec is None:
        return _NO_BUDGET
    if isinstance(spec, float):
        return fraction_budget(trace, spec)[0]
    if isinstance(spec, str):
        return min(int(trace.peak_bytes() * float(spec[:-1]) / 100.0), _NO_BUDGET)
    return spec


def _check_trace(trace):
    if not isinstance(trace, _C.Trace):
        raise TypeError(f"trace: expected a memsched.Trace (e.g. from memsched.profile or Trace.from_json), "
                        f"got {type(trace).__name__}")


def plan(trace, budget=None, planner="dp", device=None, durations="auto"):
    """Plan which activations leave the device under `budget`.

    budget: bytes, "6GiB", "50%" (of keep_all's peak), a float in (0, 1] (that fraction of the
    activation memory; Note [Budget forms]) or None (no limit). planner: one of
    planner_names(). device: None (default preset), a preset name, or a memsched.DeviceModel.
    Raises memsched.MemschedError when the budget is below what the planner can reach (the message
    states that least budget).
    """
    _check_trace(trace)
    if not isinstance(planner, str) or planner not in planner_names():
        raise ValueError(f"planner: unknown planner {planner!r}; known planners: {', '.join(planner_names())}")
    model = resolve_device(device, trace, durations)
    spec = parse_budget(budget)
    budget_bytes = resolve_budget(spec, trace)
    if _DUMP_ENV in os.environ:
        dump_planning_input(os.environ[_DUMP_ENV], trace, model, budget_bytes, planner)
    try:
        return _C.make_plan(trace, model, budget_bytes, planner)
    except _C.MemschedError as err:
        if isinstance(spec, float) and "least budget" in str(err):
            raise fraction_refusal(trace, spec, err, planner,
                                   lambda b: _C.make_plan(trace, model, b, planner)) from None
        if isinstance(spec, str) and "least budget" in str(err):  # "P%": answer in percent
            least = least_working_budget(err, trace, lambda b: _C.make_plan(trace, model, b, planner))
            raise percent_refusal(budget, planner, least, trace.peak_bytes(), resolve_budget(spec, trace),
                                  "the trace's keep_all peak") from None
        raise


# Note [Planning inputs kept for a crash]
#   Rationale: the first H100 run had the planner crash (SIGSEGV inside _C.make_plan) on traces only a
#   GPU makes -- CUDA-timed durations, the allocator's unmodeled memory, CUDA op names -- while every
#   CPU trace, and some 600 fuzzed CUDA-like ones under AddressSanitizer, plan cleanly: without the trace the
#   crash cannot be replayed where there is no GPU.
#   Approach: with MEMSCHED_PLAN_DUMP_DIR set, plan() writes each call's inputs before it plans -- the
#   trace as JSON and one JSON of the device model, budget and planner beside it -- so the last pair
#   in the folder is the call that crashed. replay_planning_input(path) plans it again (here, or in a
#   sanitizer build). Opt-in: nothing is written without the variable; a step never reaches it
#   (planning is once per profile).
_DUMP_ENV = "MEMSCHED_PLAN_DUMP_DIR"
_dumped = [0]


def dump_planning_input(folder, trace, model, budget_bytes, planner):
    """Write plan()'s inputs into `folder` (Note [Planning inputs kept for a crash]); returns the path
    of the JSON that replay_planning_input() reads."""
    os.makedirs(folder, exist_ok=True)
    _dumped[0] += 1
    stem = os.path.join(folder, f"plan-{os.getpid()}-{_dumped[0]:04d}")
    trace.to_json(stem + ".trace.json")
    spec = {"trace": os.path.basename(stem + ".trace.json"), "budget_bytes": budget_bytes, "planner": planner,
            "device": {f: getattr(model, f) for f in _DEVICE_FIELDS + ("name", "use_measured_durations")}}
    with open(stem + ".json", "w") as f:
        json.dump(spec, f, indent=1)  # closed before the planner runs: a crash there keeps it
    return stem + ".json"


def replay_planning_input(path):
    """Plan again what dump_planning_input() wrote at `path`: the Plan, or the planner's MemschedError."""
    with open(path) as f:
        spec = json.load(f)
    trace = _C.Trace.from_json(os.path.join(os.path.dirname(os.path.abspath(path)), spec["trace"]))
    model = _C.DeviceModel()
    for field, value in spec["device"].items():
        setattr(model, field, value)
    return _C.make_plan(trace, model, spec["budget_bytes"], spec["planner"])


def simulate(trace, plan, device=None, durations="auto"):
    """Simulate one step of `trace` executing `plan`: SimResult with step_time_us, stall_us,
    stall_us_per_op, recompute_us (step_time_us == compute_us + recompute_us + stall_us), peak_bytes,
    peak_time_us, bytes_to_host, bytes_to_device, timeline."""
    _check_trace(trace)
    if not isinstance(plan, _C.Plan):
        raise TypeError(f"plan: expected a memsched.Plan (from memsched.plan), got {type(plan).__name__}")
    return _C.simulate(trace, plan, resolve_device(device, trace, durations))


def compare(trace, budget, planners="all", device=None, durations="auto"):
    """Plan and simulate `trace` with each planner at one budget. Returns one dict per planner:
    planner, ok, error, plan, result, step_time_us, stall_us, peak_bytes, bytes_moved (both ways),
    offloaded and recomputed (tensor counts), recompute_us (replay time on the compute stream),
    ratio (step time / keep_all's step time without a budget)."""
    _check_trace(trace)
    known = planner_names()
    if planners is None or (isinstance(planners, str) and planners == "all"):
        names = known
    elif isinstance(planners, str):
        names = [planners]  # one planner by name (list("dp") would be the planners 'd' and 'p')
    else:
        try:
            names = list(planners)
        except TypeError:
            raise ValueError(f"planners: expected 'all', a planner name or a list of them, got "
                             f"{type(planners).__name__}") from None
    for name in names:
        if not isinstance(name, str) or name not in known:
            raise ValueError(f"planners: unknown planner {name!r}; known planners: {', '.join(known)} (or 'all')")
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
            if "least budget" in str(e):  # the least this planner accepts, checked (least_working_budget)
                row["least_budget_bytes"] = least_working_budget(
                    e, trace, lambda b, name=name: _C.make_plan(trace, model, b, name))
            rows.append(row)
            continue
        r = _C.simulate(trace, p, model)
        row.update(ok=True, plan=p, result=r, step_time_us=r.step_time_us, stall_us=r.stall_us,
                   peak_bytes=r.peak_bytes, bytes_moved=r.bytes_to_host + r.bytes_to_device,
                   offloaded=p.num_offloaded(), recomputed=p.num_recomputed(), recompute_us=r.recompute_us,
                   ratio=r.step_time_us / baseline.step_time_us if baseline.step_time_us > 0 else math.nan)
        rows.append(row)
    return rows


def best_row(rows):
    """The fastest feasible row (ties: fewer bytes moved, then table order); None if none."""
    ok = [r for r in rows if r["ok"]]
    return min(ok, key=lambda r: (r["step_time_us"], r["bytes_moved"])) if ok else None


def format_table(rows):
    """One line per planner: step time, stall, peak, bytes moved, tensors offloaded and recomputed,
    ratio to keep_all (no budget)."""
    header = (f"{'planner':<22}{'step (ms)':>11}{'stall (ms)':>12}{'peak':>12}{'moved':>12}{'offloaded':>11}"
              f"{'recomputed':>12}{'vs no budget':>14}")
    lines = [header, "-" * len(header)]
    for r in rows:
        if not r["ok"]:
            msg = r["error"] or ""
            short = msg.split(":")[0] if "needs at least" not in msg else msg[msg.index("needs at least"):].split(";")[0].split(" (")[0]
            if r.get("least_budget_bytes") is not None:
                short = f"needs at least {r['least_budget_bytes']} bytes"
            lines.append(f"{r['planner']:<22}  infeasible: {short}")
            continue
        lines.append(f"{r['planner']:<22}{r['step_time_us'] / 1e3:>11.3f}{r['stall_us'] / 1e3:>12.3f}"
                     f"{format_bytes(r['peak_bytes']):>12}{format_bytes(r['bytes_moved']):>12}"
                     f"{r['offloaded']:>11}{r['recomputed']:>12}{r['ratio']:>13.3f}x")
    # the ratio's baseline is keep_all without a budget, also where the keep_all row above is infeasible
    lines.append("vs no budget: step time / keep_all's with no budget (every activation kept on the device)")
    return "\n".join(lines)


def save_timeline(result, path, title="simulated step", budget_bytes=None):
    """Plot a SimResult: device memory over time (top) and the compute / D2H / H2D streams
    (bottom) to a PNG (matplotlib, Agg backend)."""
    from memsched._images import image_format

    fmt = image_format(path, "save_timeline: path")  # before any plotting: a clear error, the exact file
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
    colors = {"op": "tab:blue", "recompute": "tab:red", "d2h": "tab:orange", "h2d": "tab:green"}
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
    fig.savefig(path, dpi=100, format=fmt)
    plt.close(fig)
    return path
