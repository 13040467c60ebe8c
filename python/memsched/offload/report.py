"""Reports for memsched.optimize(): the planned-vs-measured table and the timeline PNG.

Entry points: planned_activation_curve(trace, plan), format_table(rows),
RunReport, save_timeline(path, ...). Pure Python + matplotlib (Agg).
"""
import statistics
from dataclasses import dataclass, field

from memsched.offload.schedule import held_past_step, plan_decisions
from memsched.units import format_bytes


def planned_activation_curve(trace, plan):
    """Bytes of saved activations resident on the device during each op, if `plan` runs exactly.

    Kept activation: resident from its producer op to its free op. Offloaded:
    from its producer to max(offload_after_op, last forward use, held_until_op), then
    again from prefetch_at_op to its free op (Note [Tensor lifetime convention] and
    Note [Held by the caller] in trace.h). Recomputed: from its producer to its last
    forward use (or held_until_op), then again from recompute_at_op to its free op.
    A planned offload of a tensor held past the step counts as kept: the executor keeps it
    (Note [Activations held past the step] in offload/schedule.py).
    This is the quantity the CPU executor measures (storages alive).
    """
    ops = trace.ops
    n = len(ops)
    curve = [0] * n
    offload = {}
    if plan is not None:
        for d in plan_decisions(plan):
            if d.offload or getattr(d, "recompute", False):
                offload[d.tensor_id] = d
    held = {rec.id for rec in trace.tensors if held_past_step(rec)}
    for rec in trace.tensors:
        if rec.kind != "activation":
            continue
        start = 0 if rec.producer_op < 0 else rec.producer_op
        end = n - 1 if rec.freed_after_op < 0 else rec.freed_after_op
        d = offload.get(rec.id)
        if d is None or rec.id in held:
            spans = [(start, end)]
        else:
            fwd = [u for u in rec.uses if ops[u].phase == "forward"]
            release = max([d.offload_after_op, rec.held_until_op] + fwd)
            back = d.recompute_at_op if getattr(d, "recompute", False) else d.prefetch_at_op
            spans = [(start, min(release, end)), (max(back, release + 1), end)]
        for a, b in spans:
            for i in range(a, b + 1):
                curve[i] += rec.bytes
    return curve


LARGEST_SHOWN = 5  # planned activations run.report() names, largest first


def largest_planned(schedule, n=LARGEST_SHOWN):
    """The `n` largest activations a schedule offloads or recomputes, largest first (ties: ordinal): dicts
    with action ('offload' or 'recompute'), bytes, ordinal, module, shape, dtype and label (the trace's
    "act:<ordinal>:<module>:<shape>:<dtype>", Note [Activation identity])."""
    if schedule is None:
        return []
    acted = [(k, "offload") for k in schedule.offload] + [(k, "recompute") for k in schedule.recompute]
    acted.sort(key=lambda ka: (-schedule.bytes[ka[0]], ka[0]))
    out = []
    for k, action in acted[:n]:
        label = schedule.labels.get(k, "")
        parts = label.split(":", 2)  # act, ordinal, "<module>:<shape>:<dtype>"
        rest = parts[2].rsplit(":", 2) if len(parts) == 3 else []
        module, shape, dtype = rest if len(rest) == 3 else ("", "", "")
        out.append(dict(action=action, bytes=schedule.bytes[k], ordinal=k, module=module, shape=shape,
                        dtype=dtype, label=label))
    return out


def format_largest(largest, offloaded, recomputed):
    """run.report()'s lines for largest_planned(): one per activation, aligned; [] when there is none."""
    if not largest:
        return []
    what = " and ".join(x for x in (f"{offloaded} offloaded" if offloaded else "",
                                    f"{recomputed} recomputed" if recomputed else "") if x)
    if len(largest) < offloaded + recomputed:
        total = f"{offloaded + recomputed}: {what}" if offloaded and recomputed else what
        lines = [f"largest planned activations ({len(largest)} of {total}):"]
    else:
        lines = [f"planned activations ({what}):"]
    rows = [[a["action"], format_bytes(a["bytes"]), a["module"] or "(root)", f"{a['shape']} {a['dtype']}".strip(),
             f"act {a['ordinal']}"] for a in largest]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  " + "  ".join(c.rjust(w) if i == 1 else c.ljust(w)
                                      for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    return lines


def format_table(header, rows):
    """Plain-text table: header is a list of column names, rows lists of strings."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths)))
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep] + [line(r) for r in rows])


def _ms(seconds):
    if seconds is not None and abs(seconds) < 5e-6:
        seconds = 0.0  # the simulator's float sums may end a hair below zero: never print "-0.00 ms"
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _b(n):
    return "-" if n is None else format_bytes(n)


@dataclass
class RunReport:
    """What run.report() computed; str() is the printed table."""
    device: str = ""
    planner: str = ""
    budget_bytes: int = None           # None: no budget (keep all)
    budget_text: str = ""              # the budget as asked: alone while not resolved, else before the bytes
    steps_profiled: int = 0            # COUNT
    steps_planned: int = 0             # COUNT executed with the plan
    steps_plain: int = 0               # COUNT run plainly (mismatch / no plan)
    planned: dict = field(default_factory=dict)   # name -> value (simulated / from the plan)
    measured: dict = field(default_factory=dict)  # name -> value (median over planned steps)
    memory_source: str = ""
    host_source: str = ""
    profile: str = ""                  # how the profiled step held saved activations: "offload" or "keep"
    notes: list = field(default_factory=list)
    largest: list = field(default_factory=list)   # largest_planned(): the biggest offloaded/recomputed activations
    peak_gap: object = None            # peak_gap.PeakGap of the step with the highest peak (accelerator), or None
    table: str = ""

    def __str__(self):
        return self.table

    def __repr__(self):
        key = "peak_bytes" if self.device.startswith("cuda") else "activation_peak_bytes"
        return (f"RunReport(device={self.device!r}, planner={self.planner!r}, steps_planned={self.steps_planned}, "
                f"measured_{key}={self.measured.get(key)})")


def build_report(run_info, planned, step_stats, notes=(), counts=None, largest=(), peak_gap=None):
    """RunReport from the run's settings, the planned figures and the StepStats of executed steps
    (the medians come from those; counts: (planned, plain) over the whole run when step_stats is a
    bounded window of it; largest: largest_planned() of the schedule; peak_gap: the PeakGap of the
    step with the highest measured peak, Note [Where the peak went])."""
    r = RunReport(**run_info)
    r.peak_gap = peak_gap
    r.notes = list(notes)
    r.largest = list(largest)
    executed = [s for s in step_stats if s.mode == "planned"]
    r.steps_planned = len(executed)
    r.steps_plain = len(step_stats) - len(executed)
    if counts is not None:
        r.steps_planned, r.steps_plain = counts
    r.planned = dict(planned)
    if executed:
        med = lambda key: statistics.median(getattr(s, key) for s in executed)
        r.measured = {
            "step_time_s": med("duration_s"),
            # the allocator's peak: measured on an accelerator only (on CPU the executor counts saved
            # activations, in activation_peak_bytes; the planned peak_bytes is the whole step's)
            "peak_bytes": max(s.peak_bytes for s in executed) if r.device.startswith("cuda") else None,
            # CPU counts saved storages in the hooks: none in a keep-all plan's steps (Note [A plan with nothing to do])
            "activation_peak_bytes": (max((s.peak_bytes for s in executed if s.hooked), default=None)
                                      if not r.device.startswith("cuda") else None),
            "bytes_moved": med("d2h_bytes") + med("h2d_bytes"),
            "stall_s": med("stall_s"),
            "offloaded": int(med("offloaded")),
            "offloaded_bytes": int(med("offloaded_bytes")),
            "prefetched": int(med("prefetched")),
            "on_demand": int(med("on_demand")),
            "recomputed": int(med("recomputed")),
            "recomputed_bytes": int(med("recomputed_bytes")),
            "recompute_s": med("replay_s"),
        }
        r.memory_source = executed[-1].memory_source
    m, p = r.measured, r.planned
    cuda = r.device.startswith("cuda")
    rows = [
        ["peak memory (allocated)", _b(p.get("peak_bytes")), _b(m.get("peak_bytes")) if cuda else "- (CPU)"],
        ["peak saved activations", _b(p.get("activation_peak_bytes")),
         _b(m.get("activation_peak_bytes")) if not cuda else "-"],
        ["step time", _ms(p.get("step_time_s")), _ms(m.get("step_time_s"))],
        ["bytes moved (D2H + H2D)", _b(p.get("bytes_moved")), _b(m.get("bytes_moved"))],
        ["stall time", _ms(p.get("stall_s")), _ms(m.get("stall_s"))],
        ["offloaded activations", str(p.get("offloaded", "-")), str(m.get("offloaded", "-"))],
        ["prefetched / on demand", f"{p.get('prefetched', '-')} / {p.get('on_demand', '-')}",
         f"{m.get('prefetched', '-')} / {m.get('on_demand', '-')}"],
    ]
    if p.get("recomputed") or m.get("recomputed"):
        rows += [
            ["recomputed activations", f"{p.get('recomputed', '-')} ({_b(p.get('recomputed_bytes'))})",
             f"{m.get('recomputed', '-')} ({_b(m.get('recomputed_bytes'))})"],
            # measured: host time in the replays (on CUDA their launches; the kernels are in step time)
            ["recompute time", _ms(p.get("recompute_s")), _ms(m.get("recompute_s"))],
        ]
    if r.budget_bytes is not None:
        budget = (r.budget_text + " " if r.budget_text else "") + format_bytes(r.budget_bytes)
    else:
        budget = r.budget_text or "none (keep all)"
    head = (f"memsched.optimize: device {r.device}, planner {r.planner}, budget {budget}; steps: "
            f"{r.steps_profiled} profiled, {r.steps_planned} planned, {r.steps_plain} plain")
    # the peaks are the highest of the planned steps (a budget is a promise for each), the rest medians
    lines = [head, format_table(["", "planned (simulated)", "measured (median; peaks: max)"], rows)]
    if r.memory_source:
        lines.append(f"measured memory: {r.memory_source}; host buffers: {r.host_source}")
    lines.extend(format_largest(r.largest, p.get("offloaded", 0), p.get("recomputed", 0)))
    if peak_gap is not None and peak_gap.explained:
        lines.extend(peak_gap.lines())
    else:
        gap = _peak_gap_note(p, m, cuda)
        if gap:
            lines.append(gap)
    lines.extend(r.notes)
    r.table = "\n".join(lines)
    return r


PEAK_GAP = 0.02  # a measured peak this far above the plan's gets a note


def _peak_gap_note(planned, measured, cuda):
    """A line when the measured peak exceeds the planned one by more than PEAK_GAP, naming what the plan
    does not model on this device; "" otherwise. CPU compares saved activations (what it measures)."""
    key = "peak_bytes" if cuda else "activation_peak_bytes"
    want, got = planned.get(key), measured.get(key)
    if not want or got is None or got <= want * (1 + PEAK_GAP):
        return ""
    what = "peak memory" if cuda else "saved-activation peak"
    why = ("memory the trace does not model: the autocast cache of low-precision weights, cuBLAS/cuDNN "
           "workspaces, allocator rounding, blocks freed while another stream still used them" if cuda else
           "saved storages alive longer than the trace recorded (an input a Python frame still holds, an "
           "output allocated while its input is alive), which the plan does not see")
    return (f"note: the measured {what} is {format_bytes(got - want)} ({(got - want) / want:.1%}) above the "
            f"plan's; likely {why}")


def save_timeline(path, title, planned_curve, measured, copies, planned_copies=None):
    """Write the step's memory timeline as a PNG.

    planned_curve: [(t_s, bytes)], measured: [(t_s, bytes)], copies:
    [(kind, start_s, end_s, bytes)] measured on the copy streams, planned_copies
    likewise from the simulator (optional).
    """
    from memsched._images import image_format

    fmt = image_format(path, "save_timeline: path")  # before any plotting: a clear error, the exact file
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, lanes) = plt.subplots(2, 1, figsize=(10, 6), sharex=True,
                                    gridspec_kw={"height_ratios": [3, 1]})
    mib = 2.0 ** 20
    if planned_curve:
        ax.step([t * 1e3 for t, _ in planned_curve], [b / mib for _, b in planned_curve], where="post",
                label="planned", color="tab:blue", alpha=0.8)
    if measured:
        # each sample holds until the next one (as the planned curve): no slope between them
        ax.step([t * 1e3 for t, _ in measured], [b / mib for _, b in measured], where="post", label="measured",
                color="tab:red", marker=".", markersize=3, linewidth=1)
    ax.set_ylabel("memory (MiB)")
    ax.set_title(title)
    ax.legend(loc="upper right")
    lane_y = {"d2h": 2, "h2d": 1}
    for kind, y in lane_y.items():
        spans = [(s * 1e3, max((e - s) * 1e3, 1e-3)) for k, s, e, _ in copies if k == kind]
        if spans:
            lanes.broken_barh(spans, (y - 0.35, 0.3), color="tab:red", label=f"measured {kind}")
        if planned_copies:
            spans = [(s * 1e3, max((e - s) * 1e3, 1e-3)) for k, s, e, _ in planned_copies if k == kind]
            if spans:
                lanes.broken_barh(spans, (y + 0.05, 0.3), color="tab:blue", alpha=0.7)
    from matplotlib.patches import Patch
    lanes.legend(handles=[Patch(color="tab:red", label="measured"), Patch(color="tab:blue", alpha=0.7,
                                                                          label="planned (simulated)")],
                 loc="upper right", fontsize=8)
    lanes.set_yticks([2, 1])
    lanes.set_yticklabels(["D2H stream", "H2D stream"])
    lanes.set_ylim(0.4, 2.6)
    lanes.set_xlabel("time in step (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format=fmt)
    plt.close(fig)
    return path
